"""Decode side of remote partial fetching (RPF): a request's KV stays staged on the prefill node, and the
decode node's host tier (SGLang's KV pool) receives only the blocks its working sets use.

Per request and layer, each logical block is either present in the local host tier or still remote::

    logical blocks   | 0 ... c-1          | c ...                                       | last (active) |
    at admission     | radix-cached here  | remote; read if any KV head selects it      | always read   |
    later            |                    | read when a working-set load first needs it, then present |

- ``admit``: the union over KV heads of the first selection (plus the partly filled last block) and every
  block's min/max summary are read; blocks the decode node already holds through its radix cache
  (``cached_blocks``) are never transferred.
- ``ensure``: before a layer's working-set loads, the blocks not yet present are read for all requests of
  the batch at once (batched per peer, at most ``MAX_BATCH_REQUESTS`` per batch); each block is read at
  most once. A failed read fails only the requests whose blocks it carried.
- ``ensure(..., completion=True)``: with the decode radix cache on, a request's remaining blocks are read
  in the background (``DecodeFetcher.complete_later``) so its KV is whole when it finishes and can be
  shared; counted apart, and a failure there fails nothing (a working set needing the block reads it).

A release fences the request's reads: ``release`` returns only after every read already writing into
its local pages has finished (new ones no longer start), so a late read never lands in pages SGLang has
since given to another request.

Failures are remembered, so that a bad peer costs the scheduler one timeout, not one per layer and
request: a request whose read failed fails at once at every later layer (it is being aborted), and a
peer whose read ran into the transfer timeout (hung or gone, not a refused read of released memory) is
not read again for ``DEAD_PEER_TTL_S``: every read from it meanwhile fails at once, naming the failure.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from sglang_oasis.disaggregation.staging import StagedKVLayout
from sglang_oasis.disaggregation.transfer_engine import MooncakeEndpoint, RemoteReadError, transfer_timeout_s

DEAD_PEER_TTL_S = 30.0  # a peer whose read timed out is not read again for this long


@dataclass
class RemoteRequest:
    layout: StagedKVLayout
    local_pages: torch.Tensor  # [pages] local host-tier page of each logical block
    present: torch.Tensor  # bool [layers, pages]: the block's K and V are in the local host tier


class AdmissionReads(NamedTuple):
    """What one admission read (``RemotePartialFetcher.admit``)."""

    admission_bytes: int = 0
    summary_bytes: int = 0
    cached_blocks: int = 0
    admission_blocks: int = 0
    code_bytes: int = 0


@dataclass
class FetchCounters:
    admission_bytes: int = 0  # KV blocks read at admission
    summary_bytes: int = 0  # min/max summaries read at admission
    code_bytes: int = 0  # key codes read at admission (--oasis-selector codes)
    miss_bytes: int = 0  # KV blocks read later, on a working set's first use
    admission_blocks: int = 0  # (block, layer) pairs read at admission
    miss_blocks: int = 0
    completion_bytes: int = 0  # KV blocks read in the background so a request's KV is whole at its finish
    completion_blocks: int = 0
    cached_blocks: int = 0  # (block, layer) pairs never transferred: held by the decode radix cache
    failed_reads: int = 0
    per_request: dict[int, int] = field(default_factory=dict)  # request -> bytes read for it

    @property
    def total_bytes(self) -> int:
        return (
            self.admission_bytes
            + self.summary_bytes
            + self.code_bytes
            + self.miss_bytes
            + self.completion_bytes
        )


class RemotePartialFetcher:
    """Reads staged blocks from prefill nodes into the local host tier, each at most once."""

    def __init__(
        self,
        endpoint: MooncakeEndpoint,
        k_buffers: list[torch.Tensor],
        v_buffers: list[torch.Tensor],
        block_size: int,
        kmin: torch.Tensor | None = None,
        kmax: torch.Tensor | None = None,
        codes: torch.Tensor | None = None,
    ) -> None:
        """``k_buffers[l]``/``v_buffers[l]``: the local pool's ``[tokens, kv_heads, head_dim]`` buffers (a
        page = ``block_size`` consecutive tokens); ``kmin``/``kmax``: the local summary store's
        ``[layers, pages, kv_heads, head_dim]`` tensors, filled at admission (None: summaries are not read);
        ``codes``: the local key code store's ``[layers, pages, block_size, kv_heads, head_dim / 4]``,
        its full blocks' codes filled at admission (None: not read; ``--oasis-selector codes``)."""
        self.endpoint = endpoint
        self.block_size = block_size
        self.k_buffers, self.v_buffers = k_buffers, v_buffers
        _, self.num_kv_heads, self.head_dim = k_buffers[0].shape
        self.itemsize = k_buffers[0].element_size()
        self.block_bytes = block_size * self.num_kv_heads * self.head_dim * self.itemsize
        self.kmin, self.kmax, self.codes = kmin, kmax, codes
        for tensor in [
            *k_buffers,
            *v_buffers,
            *([kmin, kmax] if kmin is not None and kmax is not None else []),
            *([] if codes is None else [codes]),
        ]:
            endpoint.register(tensor)
        self.requests: dict[int, RemoteRequest] = {}
        self.counters = FetchCounters()
        self._lock = threading.Lock()
        self._reads_done = threading.Condition(self._lock)  # notified when a request's last read ends
        self._reading: dict[int, int] = {}  # request -> reads in flight into its local pages
        # A read failing after this long ran into the transfer timeout: its peer is hung or gone.
        self.hung_after_s = 0.9 * transfer_timeout_s()
        # Mooncake session -> (the failure that condemned it, when); forgotten after DEAD_PEER_TTL_S (a
        # restarted peer may come back at the same address).
        self.dead_peers: dict[str, tuple[str, float]] = {}
        self.failed: dict[int, str] = {}  # request -> its first failed read (it is being aborted)

    # --- admission ---------------------------------------------------------------------------------

    def admit(
        self,
        req: int,
        layout: StagedKVLayout,
        local_pages: torch.Tensor,
        selected: torch.Tensor,
        cached_blocks: int = 0,
        have_last: bool = False,
    ) -> AdmissionReads:
        """Starts request ``req`` (its local pages ``[pages]`` already allocated): reads its summaries and
        the blocks ``selected`` (bool ``[layers, pages]``, the union over KV heads of its first selection)
        plus its last block, skipping the first ``cached_blocks`` (held locally through the radix cache)
        and, with ``have_last``, the last block (it came with SGLang's own transfer).
        Returns what it read; raises ``RemoteReadError`` if a read fails (the request must then fail)."""
        self.check_layout(layout)
        if self.kmin is not None and layout.summary_address == 0:
            raise ValueError(f"the KV staged at {layout.session} has no summaries; this fetcher reads them")
        pages = layout.num_pages
        if local_pages.shape != (pages,) or selected.shape != (layout.num_layers, pages):
            raise ValueError(
                f"local_pages must be [{pages}] and selected [{layout.num_layers}, {pages}], got "
                f"{tuple(local_pages.shape)} and {tuple(selected.shape)}"
            )
        present = torch.zeros((layout.num_layers, pages), dtype=torch.bool)
        present[:, :cached_blocks] = True
        if have_last:
            present[:, -1] = True
        request = RemoteRequest(layout, local_pages.to(torch.int64).cpu(), present)
        cached = layout.num_layers * min(cached_blocks, pages)
        with self._lock:
            self.requests[req] = request
            self.counters.cached_blocks += cached
        wanted = selected.cpu().clone()
        wanted[:, -1] = True  # the active block: decode attends it in full
        wanted &= ~present
        layers, blocks = wanted.nonzero(as_tuple=True)
        summaries = None if self.kmin is None or self.kmax is None else (self.kmin, self.kmax)
        local, remote, lengths, summary_bytes, code_bytes = metadata_reads(
            request, cached_blocks, summaries, self.codes
        )
        try:
            if local:
                self._read(layout.session, local, remote, lengths)
            nbytes = self._read_blocks({req: (layers, blocks)})
        except RemoteReadError:
            self.release(req)
            with self._lock:
                self.counters.failed_reads += 1
            raise
        with self._lock:
            present[layers, blocks] = True
            self.counters.summary_bytes += summary_bytes
            self.counters.code_bytes += code_bytes
            self.counters.admission_bytes += nbytes
            self.counters.admission_blocks += len(blocks)
            self._charge(req, nbytes + summary_bytes + code_bytes)
        return AdmissionReads(nbytes, summary_bytes, cached, len(blocks), code_bytes)

    def _read(self, session: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        """One peer's reads; a peer that timed out before is not read again."""
        started = time.monotonic()
        with self._lock:
            dead = self.dead_peers.get(session)
        if dead is not None and started - dead[1] < DEAD_PEER_TTL_S:
            raise RemoteReadError(session, len(local), sum(lengths), -1, f"peer timed out before: {dead[0]}")
        try:
            self.endpoint.read(session, local, remote, lengths)
        except RemoteReadError as error:
            now = time.monotonic()
            if now - started >= self.hung_after_s:
                with self._lock:
                    self.dead_peers[session] = (str(error), now)
            raise

    # --- decode time --------------------------------------------------------------------------------

    def ensure(self, layer: int, wanted: dict[int, torch.Tensor], completion: bool = False) -> dict[int, str]:
        """Makes the logical blocks ``wanted[req]`` of ``layer`` present locally, reading the missing ones
        for all requests at once. Returns the requests whose reads failed (request -> message); their
        blocks stay remote and the others' become present. A ``completion`` read (a request's remaining
        blocks, read ahead of its finish: no working set waits for them) is counted apart, and its failure
        does not fail the request (a working set that needs the block reads it again)."""
        todo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        failed: dict[int, str] = {}
        with self._lock:
            for req, blocks in wanted.items():
                request = self.requests.get(req)
                if request is None:
                    continue  # not a remote request (local prefill)
                if req in self.failed:
                    failed[req] = self.failed[req]
                    continue
                blocks = blocks.to(torch.int64).cpu().unique()
                blocks = blocks[blocks < request.layout.num_pages]  # later blocks were decoded here
                missing = blocks[~request.present[layer, blocks]]
                if missing.numel():
                    todo[req] = (torch.full_like(missing, layer), missing)
        if not todo:
            return failed
        try:
            nbytes = self._read_blocks(todo)
            done = list(todo)
        except RemoteReadError:
            nbytes, done = 0, []
            for req, own in todo.items():  # find the requests whose own reads fail
                try:
                    nbytes += self._read_blocks({req: own})
                    done.append(req)
                except RemoteReadError as error:
                    failed[req] = f"remote KV read for layer {layer} failed: {error}"
        with self._lock:
            for req in done:
                layers, blocks = todo[req]
                request = self.requests.get(req)
                if request is None:  # released meanwhile (its request finished)
                    continue
                request.present[layers, blocks] = True
                if completion:
                    self.counters.completion_blocks += len(blocks)
                else:
                    self.counters.miss_blocks += len(blocks)
                self._charge(req, len(blocks) * 2 * self.block_bytes)
            if completion:
                self.counters.completion_bytes += nbytes
                return failed
            self.counters.miss_bytes += nbytes
            self.counters.failed_reads += len(failed.keys() - self.failed.keys())
            for req, message in failed.items():
                if req in self.requests:
                    self.failed.setdefault(req, message)
        return failed

    def release(self, req: int) -> None:
        """Forget request ``req`` (its pages are SGLang's again): no read for it starts from now on, and
        this waits for those in flight, each bounded by the transfer timeout."""
        with self._reads_done:
            self.requests.pop(req, None)
            self.failed.pop(req, None)
            self._reads_done.wait_for(lambda: not self._reading.get(req))

    def whole(self, req: int) -> bool:
        """Whether every block of request ``req`` is in the local host tier (a request that is not remote
        is)."""
        with self._lock:
            request = self.requests.get(req)
            return request is None or bool(request.present.all())

    def present_blocks(self, req: int) -> int:
        """(block, layer) pairs of ``req`` held in the local host tier."""
        with self._lock:
            return int(self.requests[req].present.sum())

    def host_bytes(self, req: int) -> int:
        """Local host-tier bytes the request's present blocks take (K and V)."""
        return self.present_blocks(req) * 2 * self.block_bytes

    # --- internals ------------------------------------------------------------------------------------

    def _read_blocks(self, todo: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Reads K and V of each (layer, logical block) of each request, one batch per peer; returns bytes."""
        requests: dict[int, RemoteRequest] = {}
        with self._lock:  # from here until the reads end, a release of these requests waits
            for req in todo:
                request = self.requests.get(req)
                if request is not None:  # else released meanwhile (it finished): nothing to read for it
                    requests[req] = request
                    self._reading[req] = self._reading.get(req, 0) + 1
        try:
            return self._read_into(todo, requests)
        finally:
            with self._reads_done:
                for req in requests:
                    self._reading[req] -= 1
                    if not self._reading[req]:
                        del self._reading[req]
                self._reads_done.notify_all()

    def _read_into(
        self, todo: dict[int, tuple[torch.Tensor, torch.Tensor]], requests: dict[int, RemoteRequest]
    ) -> int:
        """The reads of ``_read_blocks``, batched per peer."""
        by_peer = peer_addresses(todo, requests, (self.k_buffers, self.v_buffers), self.block_bytes)
        nbytes = 0
        for session, (local, remote) in by_peer.items():
            self._read(session, local, remote, [self.block_bytes] * len(local))
            nbytes += self.block_bytes * len(local)
        return nbytes

    def _charge(self, req: int, nbytes: int) -> None:
        self.counters.per_request[req] = self.counters.per_request.get(req, 0) + nbytes

    def check_layout(self, layout: StagedKVLayout) -> None:
        local = (len(self.k_buffers), self.block_size, self.num_kv_heads, self.head_dim, self.itemsize)
        check_staged(layout, local, self.codes is not None)


def check_staged(layout: StagedKVLayout, local: tuple[int, ...], codes: bool) -> None:
    """Raises ``ValueError`` unless KV staged as ``layout`` is this node's KV: ``local`` (layers, block,
    KV heads, head dim, itemsize) and, where it ranks blocks by them (``codes``), staged with key codes."""
    remote = (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim, layout.itemsize)
    if local != remote:
        raise ValueError(
            f"staged KV layout (layers, block, kv heads, head dim, itemsize) = {remote} does not match "
            f"the local pool's {local}"
        )
    if codes and layout.code_address == 0:
        raise ValueError(
            f"the KV staged at {layout.session} has no key codes, and this decode node ranks blocks by "
            "them: start the prefill node with --oasis-selector codes too"
        )


def metadata_reads(
    request: RemoteRequest,
    cached_blocks: int,
    summaries: tuple[torch.Tensor, torch.Tensor] | None,
    codes: torch.Tensor | None,
) -> tuple[list[int], list[int], list[int], int, int]:
    """An admission's reads besides the KV, past the ``cached_blocks`` the radix cache holds: every page's
    min and max summary rows (``summaries``: the local store's kmin, kmax) and every full block's key codes
    (``codes``: the local code store's, one contiguous run per layer and block on both nodes). Returns
    their local and remote addresses and lengths, and the summaries' and the codes' bytes."""
    layout, local, remote, lengths = request.layout, [], [], []
    summary_bytes = code_bytes = 0
    for page in range(cached_blocks, layout.num_pages):
        local_page = int(request.local_pages[page])
        for layer in range(layout.num_layers):
            for which, store in enumerate(summaries or ()):
                local.append(store[layer, local_page].data_ptr())
                remote.append(layout.summary_address_of(layer, which, page))
                lengths.append(layout.summary_row_bytes)
                summary_bytes += layout.summary_row_bytes
            if codes is not None and page < layout.full_blocks:
                local.append(codes[layer, local_page].data_ptr())
                remote.append(layout.code_address_of(layer, page))
                lengths.append(layout.code_row_bytes)
                code_bytes += layout.code_row_bytes
    return local, remote, lengths, summary_bytes, code_bytes


def peer_addresses(
    todo: dict[int, tuple[torch.Tensor, torch.Tensor]],
    requests: dict[int, RemoteRequest],
    buffers: tuple[list[torch.Tensor], list[torch.Tensor]],
    block_bytes: int,
) -> dict[str, tuple[list[int], list[int]]]:
    """Per prefill peer (its Mooncake session): the local and remote addresses of every (layer, block)
    of ``todo`` to read, K then V, for the ``requests`` still here (``buffers``: the host tier's K and V
    per layer)."""
    by_peer: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
    for req, request in requests.items():
        layers, blocks = todo[req]
        layout = request.layout
        local, remote = by_peer[layout.session]
        for layer, block in zip(layers.tolist(), blocks.tolist(), strict=True):
            offset = int(request.local_pages[block]) * block_bytes
            for kv, per_layer in enumerate(buffers):
                local.append(per_layer[layer].data_ptr() + offset)
                remote.append(layout.block_address(layer, kv, block))
    return by_peer
