"""The launcher in sparse mode: the SGLang arguments it needs (the oasis backend, pages = blocks, the
lookahead's speculative worker, the host tier's size, a running-request cap the device tier holds working
sets for) and what it refuses before SGLang starts, naming the option (contradicting options, models it
would serve wrongly, tiers that do not fit, CUDA without ``--oasis-cuda-untested``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from sglang_oasis.config import OasisConfig
from sglang_oasis.launcher.argv import LaunchError, given, model_ranks, option_value, say
from sglang_oasis.memory.device_layout import DeviceTierError, TierShape, budget_bytes
from sglang_oasis.memory.device_layout import layout as device_tier_layout
from sglang_oasis.memory.host_tier import (
    HostTierError,
    KVFootprint,
    available_host_memory,
    check_fits,
    default_host_kv_tokens,
    gib,
    kv_footprint,
    model_config,
)
from sglang_oasis.serving_gates import Serving, ServingRefused, check_sparse_serving

# SGLang's options that start more than one model rank: sparse mode serves tensor parallelism only.
UNSERVED_PARALLEL_OPTIONS = (
    "--dp-size", "--data-parallel-size", "--dp", "--pp-size", "--pipeline-parallel-size",
)  # fmt: skip


def check_untested_cuda(argv: Sequence[str], sglang_argv: Sequence[str], config: OasisConfig) -> OasisConfig:
    """Sparse mode on a GPU only with ``--oasis-cuda-untested true``, which says loudly that it never ran
    there, and only where it is written (``serving_gates.py``: the backend asks the same); the decode step
    in SGLang's CUDA graphs is the captured one unless ``--oasis-decode-step`` is given."""
    graphs = not given(sglang_argv, "--disable-cuda-graph")
    if graphs and not given(argv, "--oasis-decode-step"):
        config = dataclasses.replace(config, decode_step="captured")
    serving = Serving(
        "cuda", tp_size=model_ranks(sglang_argv), cuda_graphs=graphs,
        torch_compile=given(sglang_argv, "--enable-torch-compile"),
    )  # fmt: skip
    try:
        check_sparse_serving(config, serving)
    except ServingRefused as error:
        raise LaunchError(str(error)) from None
    say(
        "WARNING: --oasis-cuda-untested: sparse mode on CUDA has NEVER RUN ON A GPU; its outputs are not "
        "verified there (docs/gpu.md)"
    )
    return config


def sparse_mode_args(sglang_argv: Sequence[str], config: OasisConfig, on_cpu: bool = True) -> list[str]:
    """SGLang arguments sparse mode needs: the oasis backend, pages = blocks, the host-tier size, and a
    running-request cap that fits the working sets in the device budget."""
    extra: list[str] = []
    backend = option_value(sglang_argv, "--attention-backend")
    if backend not in (None, "oasis"):
        raise LaunchError(
            f"--attention-backend {backend}: sparse mode uses the oasis backend (or pass --oasis-mode dense)"
        )
    if backend is None:
        extra += ["--attention-backend", "oasis"]
    for option in UNSERVED_PARALLEL_OPTIONS:
        value = option_value(sglang_argv, option)
        if value is not None and value.isdigit() and int(value) > 1:
            raise LaunchError(
                f"{option} {value}: sparse mode runs one engine replica with all layers per rank (data "
                "parallelism would need a device tier, a counters block and Mooncake identities per replica, "
                "pipeline parallelism a selection split across stages; neither is built, docs/design.md); "
                "use --tp-size, or serve it with --oasis-mode dense"
            )
    if given(sglang_argv, "--enable-mixed-chunk"):  # decode rows would go through the extend path
        raise LaunchError(
            "--enable-mixed-chunk: sparse mode decodes over working sets and cannot batch decode rows with "
            "a prefill chunk (or pass --oasis-mode dense)"
        )
    page_size = option_value(sglang_argv, "--page-size")
    if page_size is not None and page_size != str(config.block_size):
        raise LaunchError(
            f"--page-size {page_size}: sparse mode pages the KV by --oasis-block-size {config.block_size}"
        )
    if page_size is None:
        extra += ["--page-size", str(config.block_size)]
    if config.host_kv_tokens is not None:
        if given(sglang_argv, "--max-total-tokens"):
            raise LaunchError(
                "--max-total-tokens and --oasis-host-kv-tokens both set the host KV tier: give one"
            )
        extra += ["--max-total-tokens", str(config.host_kv_tokens)]
    extra += lookahead_args(sglang_argv, config)
    # prefill runs eagerly; decode too, but on CUDA, where SGLang's runner captures it (graph_hooks.py)
    for phase in ("prefill",) if not on_cpu else ("decode", "prefill"):
        if not given(sglang_argv, f"--cuda-graph-backend-{phase}"):
            extra += [f"--cuda-graph-backend-{phase}", "disabled"]
    return extra


def check_sparse_model(sglang_argv: Sequence[str], config: OasisConfig) -> None:
    """Refuse, naming the reason, a model that sparse mode would serve wrongly: dense-layer ids it does
    not have, MLA (compressed latent KV, no per-head keys to summarise) and sliding-window attention
    (the window and the working sets would each drop different tokens). Models without a readable
    ``config.json`` are left to SGLang."""
    path = option_value(sglang_argv, "--model-path")
    model = model_config(Path(path)) if path else None
    if model is None:
        return
    text = model.get("text_config") or model
    layers = text.get("num_hidden_layers")
    if isinstance(layers, int) and config.dense_layers and config.dense_layers[-1] >= layers:
        raise LaunchError(
            f"--oasis-dense-layers {config.dense_layers[-1]}: the model has {layers} layers (ids 0..{layers - 1})"
        )
    kind = text.get("model_type") or model.get("model_type") or "this model"
    if text.get("kv_lora_rank"):
        raise LaunchError(
            f"{kind} uses multi-head latent attention (MLA), which sparse mode does not serve: pass --oasis-mode dense"
        )
    layer_types = text.get("layer_types")
    sliding = (
        any("sliding" in str(t) for t in layer_types)
        if isinstance(layer_types, list)
        else bool(text.get("sliding_window")) and text.get("use_sliding_window", True) is not False
    )
    if sliding:
        raise LaunchError(
            f"{kind} uses sliding-window attention (sliding_window {text.get('sliding_window')}), which sparse "
            "mode does not serve: pass --oasis-mode dense"
        )


def served_footprint(sglang_argv: Sequence[str], model_option: str = "--model-path") -> KVFootprint | None:
    """The KV shape of the model ``model_option`` names, in the ``--dtype`` / ``--kv-cache-dtype`` it is
    served in (None: no such option, or a model ``memory/host_tier.py`` cannot read)."""
    path = option_value(sglang_argv, model_option)
    if path is None:
        return None
    dtype = option_value(sglang_argv, "--dtype") or "auto"
    return kv_footprint(Path(path), dtype, option_value(sglang_argv, "--kv-cache-dtype") or "auto")


def host_tier_args(
    sglang_argv: Sequence[str], config: OasisConfig, on_cpu: bool, available: int | None = None
) -> list[str]:
    """The host tier's ``--max-total-tokens`` when none is given (sparse mode): the share
    ``--oasis-host-memory-fraction`` of the available host RAM (``available`` bytes; None: measured
    now) over the served model's and its draft model's KV bytes per token, at most
    ``--oasis-cpu-max-total-tokens`` on CPU with the CPU defaults. A size that is given must fit the
    available RAM. Models whose KV shape ``memory/host_tier.py`` cannot read are left to SGLang."""
    models = [opt for opt in ("--model-path", "--speculative-draft-model-path") if given(sglang_argv, opt)]
    try:
        footprints = [served_footprint(sglang_argv, model) for model in models]
        if not footprints or any(footprint is None for footprint in footprints):
            return []
        per_token = sum(footprint.bytes_per_token for footprint in footprints if footprint)
        available = available_host_memory() if available is None else available
        size = option_value(sglang_argv, "--max-total-tokens")
        if size is not None:
            option = "--oasis-host-kv-tokens" if config.host_kv_tokens is not None else "--max-total-tokens"
            if size.isdigit():
                check_fits(int(size), per_token, available, option)
            return []
        if given(sglang_argv, "--mem-fraction-static"):
            return []
        tokens = default_host_kv_tokens(per_token, available, config.host_memory_fraction, config.block_size)
    except HostTierError as error:
        raise LaunchError(str(error)) from None
    note = f"{config.host_memory_fraction} of {gib(available)} available host RAM"
    if on_cpu and config.cpu_defaults and tokens > config.cpu_max_total_tokens:
        tokens, note = config.cpu_max_total_tokens, f"--oasis-cpu-max-total-tokens; {note} holds {tokens}"
    say(
        f"host KV tier: {tokens} tokens, {gib(tokens * per_token)} at {per_token} KV bytes per token ({note})"
    )
    return ["--max-total-tokens", str(tokens)]


def device_request_slots(sglang_argv: Sequence[str], config: OasisConfig) -> int | None:
    """How many requests' working sets the device tier holds (``memory/device_tier.py``), from the served
    model's KV shape and the host tier's size (its summaries); None when either is unknown here."""
    footprint, host = served_footprint(sglang_argv), option_value(sglang_argv, "--max-total-tokens")
    if footprint is None or host is None or not host.isdigit():
        return None
    shape = TierShape.of(
        config,
        num_layers=footprint.num_layers,
        num_kv_heads=footprint.num_kv_heads,
        head_dim=footprint.head_dim,
        element_bytes=footprint.element_bytes,
        host_pages=int(host) // config.block_size + 3,  # SGLang's padding pages, and one to spare
    )
    try:
        return device_tier_layout(budget_bytes(config, shape), shape).request_slots
    except DeviceTierError as error:
        raise LaunchError(f"{error} (--oasis-device-kv-tokens {config.device_tokens})") from None


def running_cap_args(sglang_argv: Sequence[str], config: OasisConfig, on_cpu: bool = True) -> list[str]:
    """``--max-running-requests`` (sparse mode, unless given): the requests the device tier holds working
    sets for, so SGLang's own admission keeps the others waiting. The backend refuses a larger cap. On
    CUDA without ``--oasis-device-kv-tokens`` the budget is the GPU memory SGLang measures as it starts:
    the device tier caps SGLang's running requests there itself (``DeviceTier.cap_running_requests``)."""
    if given(sglang_argv, "--max-running-requests") or (not on_cpu and config.device_kv_tokens is None):
        return []
    slots = device_request_slots(sglang_argv, config)
    if slots is None:  # the model's shape is unknown here: the budget over one request's working sets
        slots = config.device_tokens // config.working_set_tokens
    else:
        say(
            f"device tier: {slots} running requests' working sets in --oasis-device-kv-tokens {config.device_tokens}"
        )
    return ["--max-running-requests", str(slots)]


def check_tiers_fit(sglang_argv: Sequence[str], config: OasisConfig, available: int | None = None) -> None:
    """On CPU both tiers are host RAM: the host tier (``--max-total-tokens``) and the device budget
    (``--oasis-device-kv-tokens``) of the served model's KV must fit the RAM available (``available``
    bytes; None: measured now), or the working sets' allocation fails later without naming an option."""
    footprint, host = served_footprint(sglang_argv), option_value(sglang_argv, "--max-total-tokens")
    if footprint is None or host is None or not host.isdigit():
        return
    host_bytes = int(host) * footprint.bytes_per_token
    device_bytes = config.device_tokens * footprint.bytes_per_token
    available = available_host_memory() if available is None else available
    if host_bytes + device_bytes > available:
        raise LaunchError(
            f"--oasis-device-kv-tokens {config.device_tokens}: on CPU the working sets ({gib(device_bytes)}) "
            f"and the host KV tier ({gib(host_bytes)}) are both host RAM, more than the {gib(available)} "
            "available: lower --oasis-device-kv-tokens or the host tier"
        )


def lookahead_args(sglang_argv: Sequence[str], config: OasisConfig) -> list[str]:
    """SGLang's speculative worker set up as the lookahead source: one draft step, top-k 1, two verify
    tokens (the real token and the draft token, attended in one call by the oasis backend)."""
    if given(sglang_argv, "--speculative-algorithm"):
        raise LaunchError(
            "--speculative-algorithm: in sparse mode the draft source is chosen with --oasis-lookahead "
            "(eagle3 or ngram) and --oasis-draft-policy"
        )
    if config.lookahead == "previous":
        if given(sglang_argv, "--speculative-draft-model-path"):
            raise LaunchError("--speculative-draft-model-path needs --oasis-lookahead eagle3")
        return []
    shape = ["--speculative-num-draft-tokens", str(config.verify_rows)]
    if config.lookahead == "ngram":
        return ["--speculative-algorithm", "NGRAM", "--speculative-ngram-max-bfs-breadth", "1", *shape]
    extra = [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-num-steps",
        "1",
        "--speculative-eagle-topk",
        "1",
    ]
    if not given(sglang_argv, "--speculative-draft-model-path"):
        if given(sglang_argv, "--model-path"):
            raise LaunchError(
                "--oasis-lookahead eagle3 needs --speculative-draft-model-path (an EAGLE-3 head for "
                "--model-path); the shipped head fits only the default model"
            )
        from sglang_oasis.models.default_model import DefaultModelUnavailable, default_draft_dir

        try:
            extra += ["--speculative-draft-model-path", str(default_draft_dir())]
        except DefaultModelUnavailable as error:
            raise LaunchError(f"--oasis-lookahead eagle3: {error}") from None
    return [*extra, *shape]
