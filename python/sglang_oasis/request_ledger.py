"""``RequestLedger``: each request's own decode figures, returned with its response.

``/oasis/stats`` sums over every request the server ran. A client that sends requests with different
settings at once (``custom_params``: ``request_options.py``; ``bench_accuracy``'s shared server runs
every sparse config of a task together) needs each request's own: the decode steps it took, the blocks
and bytes its decode read from the host tier (working-set loads, tails, dense layers, summaries'
catch-up: what ``decode_bytes_host_to_device`` counts), the blocks its first working sets loaded at its
extend (a recall target loads at decode what a larger fixed K loads there), and the recall its sampled
steps held. The backend's parts add them here by request row as they add the server's counters; hook 10
(``sglang_hooks.report_request_figures``) extends SGLang's output streamer (``streamer_with_figures``)
to hand a finished request's figures on, so ``/generate`` answers carry them as ``meta_info["oasis"][0]``.

A row's owner is the request the latest forward pass ran in it (``begin``). Selection jobs finish one
step late, so their loads are attributed by the (row, generation) they were launched for; the loads of
the jobs a request's last step launched (for a step it never takes) finish after its response and are
not in its figures (they are in the server's counters).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, astuple, dataclass
from typing import TYPE_CHECKING, Any

from sglang_oasis.sglang_contract import FIGURES_KEY

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

KEEP = 4096  # requests whose figures are kept until taken (the oldest go first)


@dataclass(slots=True)
class RequestFigures:
    decode_steps: int = 0
    decode_blocks_loaded: int = 0  # working-set blocks loaded from the host tier at decode
    decode_bytes_host_to_device: int = 0  # those blocks' bytes and every other decode-time host read
    admission_blocks_loaded: int = 0  # its first working sets' blocks (at its extend; none with K >= blocks)
    admission_bytes_host_to_device: int = 0
    recall_samples: int = 0  # sampled (layer, KV head) pairs
    recall_sum: float = 0.0
    agreement_sum: float = 0.0

    def report(self) -> dict[str, Any]:
        """What the response carries: the counts, and mean recall / lookahead agreement (None: unsampled)."""
        out: dict[str, Any] = asdict(self)
        samples = out.pop("recall_samples")
        recall, agreement = out.pop("recall_sum"), out.pop("agreement_sum")
        out["recall_samples"] = samples
        out["recall_mean"] = round(recall / samples, 6) if samples else None
        out["lookahead_agreement_mean"] = round(agreement / samples, 6) if samples else None
        return out


class RequestLedger:
    """Figures by rid, added by request row (foreground only, like the counters)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._owners: dict[int, tuple[int, str]] = {}  # row -> (generation, rid) of the latest pass
        self._figures: OrderedDict[str, RequestFigures] = OrderedDict()

    def begin(
        self, reqs: Sequence[int], generations: Sequence[int], rids: Sequence[str] | None, decode: bool
    ) -> None:
        """A forward pass over request rows ``reqs`` (``rids``; none: nothing is attributed): it owns the
        rows now, and a decode (or verify) pass is a step of each."""
        if not rids:
            return
        for req, generation, rid in zip(reqs, generations, rids, strict=True):
            self._owners[req] = (generation, rid)
            entry = self._figures.get(rid)
            if entry is None:
                entry = self._figures[rid] = RequestFigures()
                while len(self._figures) > self.keep:
                    self._figures.popitem(last=False)
            entry.decode_steps += decode

    def add_bytes(self, reqs: Sequence[int], nbytes: Sequence[int]) -> None:
        """Host-tier bytes the current pass read for rows ``reqs``."""
        for req, n in zip(reqs, nbytes, strict=True):
            entry = self._owned(req)
            if entry is not None and n:
                entry.decode_bytes_host_to_device += int(n)

    def add_loads(
        self, loads: Iterable[tuple[int, int, int]], bytes_per_block: int, admission: bool = False
    ) -> None:
        """Working-set loads ``(row, generation, blocks)`` of a finished selection job (a decode step's, or
        with ``admission`` an extend's first working sets): attributed only to the request that still
        holds the row in that generation."""
        for req, generation, blocks in loads:
            entry = self._owned(req, generation)
            if entry is None:
                continue
            if admission:
                entry.admission_blocks_loaded += blocks
                entry.admission_bytes_host_to_device += blocks * bytes_per_block
            else:
                entry.decode_blocks_loaded += blocks
                entry.decode_bytes_host_to_device += blocks * bytes_per_block

    def add_recall(self, req: int, samples: int, recall_sum: float, agreement_sum: float) -> None:
        entry = self._owned(req)
        if entry is not None:
            entry.recall_samples += samples
            entry.recall_sum += recall_sum
            entry.agreement_sum += agreement_sum

    def take(self, rid: str) -> dict[str, Any] | None:
        """The report of request ``rid``'s figures (``take_figures``)."""
        entry = self.take_figures(rid)
        return None if entry is None else entry.report()

    def take_figures(self, rid: str) -> RequestFigures | None:
        """The figures of request ``rid``, forgotten now (what its rows add later is dropped); None for a
        request no pass ran."""
        return self._figures.pop(rid, None)

    def _owned(self, req: int, generation: int | None = None) -> RequestFigures | None:
        """The figures of the request that holds row ``req`` (in ``generation``); None once taken."""
        owner = self._owners.get(req)
        if owner is None or (generation is not None and owner[0] != generation):
            return None
        return self._figures.get(owner[1])


def streamer_with_figures(
    base: type[SchedulerOutputStreamer], scheduler: Scheduler, ledger: Callable[[], RequestLedger | None]
) -> type[SchedulerOutputStreamer]:
    """SGLang's output streamer class ``base``, extended (``has_additional_customized_info``, SGLang's way
    to add per-request output fields) to send each finished request's figures (``ledger()``'s, the
    scheduler's backend's; under tensor parallelism summed over the ranks, ``sum_over_ranks``) with its
    last output as ``meta_info["oasis"] = [figures]``; an unfinished one's chunks carry ``[]``."""

    def build_additional_customized_info(
        streamer: SchedulerOutputStreamer, reqs: list[Req]
    ) -> dict[str, list]:
        found = ledger()
        figures = [
            found.take_figures(str(req.rid)) if found is not None and req.finished() else None for req in reqs
        ]
        if int(getattr(scheduler, "tp_size", 1)) > 1 and any(req.finished() for req in reqs):
            figures = sum_over_ranks(scheduler, figures)
        return {FIGURES_KEY: [[] if entry is None else [entry.report()] for entry in figures]}

    namespace = {
        "__slots__": (),
        "has_additional_customized_info": True,
        "build_additional_customized_info": build_additional_customized_info,
    }
    return type("OasisOutputStreamer", (base,), namespace)


def sum_over_ranks(scheduler: Scheduler, figures: list[RequestFigures | None]) -> list[RequestFigures | None]:
    """Each request's figures summed over the tensor-parallel ranks (each rank loads its own KV heads'
    blocks): one all-reduce over the ranks' CPU group, which every rank's streamer makes for the same
    finished requests at the same step. A request with figures on no rank stays None."""
    import torch
    import torch.distributed as dist

    width = len(astuple(RequestFigures()))
    rows = torch.tensor(
        [[1.0, *astuple(entry)] if entry is not None else [0.0] * (width + 1) for entry in figures],
        dtype=torch.float64,
    ).reshape(len(figures), width + 1)
    dist.all_reduce(rows, group=scheduler.tp_cpu_group)
    out: list[RequestFigures | None] = []
    for present, *values in rows.tolist():
        if present == 0:
            out.append(None)
            continue
        summed = RequestFigures(*(type(v)(x) for v, x in zip(astuple(RequestFigures()), values, strict=True)))
        summed.decode_steps = round(summed.decode_steps / present)  # every rank counts the same steps
        out.append(summed)
    return out
