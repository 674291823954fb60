"""SGLang's decode transfer queue under remote partial fetching: what the decode node's hooks
(``sglang_hooks``, hook 7) hand over, decided here.

A transferred request goes through SGLang's ``DecodeTransferQueue`` in three moments, each one hook:

1. its pollers (``gate_pollers``): a request whose own SGLang transfer has completed polls
   ``Transferring`` until its admission (the hand-off and the Mooncake reads, on ``DecodeFetcher``'s
   admission workers) is over, so the scheduler thread never waits on the network while the running
   requests decode. A failed admission polls ``Failed`` with its reason recorded as the transfer's:
   SGLang's queue takes the lowest poll over the tensor-parallel ranks, so every rank fails the request
   at that poll.
2. its commit (``admit_committed``): the admission is applied (``DecodeFetcher.admit``); a failure
   aborts the request the way SGLang aborts a corrupted transfer. With the decode radix cache on, its
   still-remote blocks are then read in the background (``DecodeFetcher.complete_later``), and the tree
   cache shares only KV that is whole locally (``share_only_whole``).
3. its row's free (``row_freed``): the freed row and the request's bootstrap address go to the pool's
   listener, ``DecodeFetcher.release_slot``, which releases the prefill node's staging.

And when SGLang retracts a request and backs its KV up (``whole_before_backup``), its still-remote blocks
are read first, so the backup is whole; if that read fails SGLang is told it cannot be backed up, and
aborts the request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol, cast

from sglang_oasis.disaggregation.decode_admission import Origin
from sglang_oasis.sglang_contract import BEFORE_BACKUP_LISTENER, FREED_ROW_LISTENER

if TYPE_CHECKING:
    import torch
    from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from sglang_oasis.disaggregation.decode_fetcher import DecodeFetcher

logger = logging.getLogger(__name__)
WRAPPED_ATTRIBUTE = "_oasis_wrapped"  # on a tree cache whose checkpoint ``share_only_whole`` wrapped


class Poller(Protocol):
    """What SGLang's transfer queue polls: a KV receiver, or a wrapper of one (HiCache's, ours)."""

    def poll(self) -> int: ...  # a KVPoll value


def gate_pollers(pollers: list[Poller], queue: DecodeTransferQueue, remote: DecodeFetcher) -> list[Poller]:
    """SGLang's pollers of the queue's requests, each gated on its request's admission (moment 1)."""
    generations = cast("ReqToTokenPool", queue.scheduler.req_to_token_pool).req_generation
    return [
        AdmissionGate(poller, entry, remote, generations)
        for poller, entry in zip(pollers, queue.queue, strict=True)
    ]


class AdmissionGate:
    """A request's poller whose ``Success`` waits for its admission."""

    def __init__(
        self, poller: Poller, decode_req: DecodeRequest, remote: DecodeFetcher, generations: torch.Tensor
    ) -> None:
        self.poller, self.req, self.remote, self.generations = poller, decode_req.req, remote, generations
        self.session = session(decode_req)
        self.kv_mgr = getattr(decode_req.kv_receiver, "kv_mgr", None)

    def poll(self) -> int:  # a KVPoll value
        from sglang.srt.disaggregation.base.conn import KVPoll

        state = int(self.poller.poll())
        found = arrival(self.req, self.session) if state == KVPoll.Success else None
        if found is None:
            return state
        slot, origin = found
        generation = int(self.generations[slot])
        if not self.remote.admission_done(slot, generation, origin):
            return int(KVPoll.Transferring)
        error = self.remote.admission_error(slot, generation)
        if error is None:
            return state
        # A failed admission is a failed transfer: every rank fails the request at this poll, with this
        # rank's message (the others': SGLang's "from another rank"), instead of one rank aborting it at
        # its commit while the others decode it.
        if self.kv_mgr is not None:
            self.kv_mgr.record_failure(origin.room, error)
        return int(KVPoll.Failed)


def admit_committed(queue: DecodeTransferQueue, decode_req: DecodeRequest, remote: DecodeFetcher) -> None:
    """After SGLang commits a transferred request: admit it with what its first working sets need (read
    by then, moment 1), or abort it alone (moment 2)."""
    req = decode_req.req
    found = arrival(req, session(decode_req))
    if found is None:  # not a real PD arrival: the prefill node sent it whole
        return
    from sglang.srt.runtime_context import get_disagg

    from sglang_oasis.disaggregation.side_channel import RemoteFetchError

    slot, origin = found
    generation = int(cast("ReqToTokenPool", queue.scheduler.req_to_token_pool).req_generation[slot])
    sharing = bool(get_disagg().disaggregation_decode_enable_radix_cache)
    if sharing:  # at the first arrival, on every rank alike (its checkpoint agrees over the ranks)
        share_only_whole(queue.tree_cache, remote)
    try:
        staged = remote.admit(slot, generation, origin)
    except Exception as error:  # the request fails, the server goes on
        if not isinstance(error, RemoteFetchError):
            logger.exception("oasis: admitting request %s failed", req.rid)
        _abort(req, f"oasis: remote partial fetching failed ({error})")
        return
    if staged and sharing:
        remote.complete_later(slot)


def _abort(req: Req, message: str) -> None:
    from http import HTTPStatus

    from sglang.srt.disaggregation.utils import prepare_abort

    req.skip_radix_cache_insert = True
    prepare_abort(req, message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)


def share_only_whole(tree_cache: BasePrefixCache, remote: DecodeFetcher) -> None:
    """Wrap this tree cache's ``checkpoint`` (once) so a finishing request's KV is inserted only if it is
    whole locally (its remaining blocks read in the background by then); it never reads."""
    if getattr(tree_cache, WRAPPED_ATTRIBUTE, False):
        return
    checkpoint = tree_cache.checkpoint

    def checkpoint_complete(req: Req, *args: Any, **kwargs: Any) -> object:
        slot = req.kv.req_pool_idx
        # Every tensor-parallel rank's cache inserts the same requests (each its own KV heads' blocks).
        if not remote.on_every_rank(slot is None or remote.whole(int(slot))):
            # Never share KV with blocks missing. SGLang checkpoints a request as it starts decoding too
            # (its prompt, ``process_prebuilt``); that one is skipped while the completion reads, and the
            # finish inserts the whole sequence.
            if req.finished():
                remote.backend.stats.add("remote_unshared_finishes")
            return None
        return checkpoint(req, *args, **kwargs)

    setattr(tree_cache, "checkpoint", checkpoint_complete)  # noqa: B010  # on this instance only
    setattr(tree_cache, WRAPPED_ATTRIBUTE, True)


def row_freed(pool: object, row: int | None, req: Req) -> None:
    """SGLang freed ``req``'s row (moment 3): the pool's listener gets the row and the request's bootstrap
    address (a request that failed or was aborted before its admission began here left no record of its
    room, yet its prefill node may have staged it)."""
    listener = getattr(pool, FREED_ROW_LISTENER, None)
    if listener is None or row is None:
        return
    try:
        listener(int(row), bootstrap(req))
    except Exception:  # releasing remote staging is not worth the scheduler
        logger.exception("oasis: releasing request row %s's remote staging failed", row)


def whole_before_backup(req_to_token_pool: ReqToTokenPool, req: Req) -> bool:
    """Whether ``req``'s KV is whole locally, its still-remote blocks read now if it has any (the pool's
    ``BEFORE_BACKUP_LISTENER``, ``DecodeFetcher.complete``); True where nothing is remote."""
    complete = getattr(req_to_token_pool, BEFORE_BACKUP_LISTENER, None)
    row = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    if complete is None or row is None:
        return True
    try:
        return bool(complete(int(row)))
    except Exception:
        logger.exception("oasis: reading request %s's remote blocks before its backup failed", req.rid)
        return False


def session(decode_req: DecodeRequest) -> str | None:
    """This node's SGLang transfer session, which the prefill node sees as the request's destination."""
    kv_mgr = getattr(decode_req.kv_receiver, "kv_mgr", None)
    return None if kv_mgr is None else str(kv_mgr.get_session_id())


def arrival(req: Req, transfer_session: str | None) -> tuple[int, Origin] | None:
    """``(request slot, origin)`` of a transferred request that remote fetching admits (a real PD arrival,
    not aborted); None for any other."""
    slot, address = req.kv.req_pool_idx, bootstrap(req)
    if req.finished() or slot is None or address is None:
        return None
    return int(cast(int, slot)), Origin(*address, transfer_session)


def bootstrap(req: Req) -> tuple[str, int, int] | None:
    """``(bootstrap host, port, room)`` of a request a real prefill node sent; None for any other."""
    host, port, room = req.bootstrap_host, req.bootstrap_port, req.bootstrap_room
    if None in (host, port, room) or host == _fake_bootstrap_host():
        return None
    return str(host), int(cast(int, port)), int(cast(int, room))


def _fake_bootstrap_host() -> str | None:
    try:
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    except ImportError:
        return None
    return str(FAKE_BOOTSTRAP_HOST)
