"""Which of a prefill node's requests are staged, and what each staged send still needs: the decisions
hook 7's prefill hooks ask for (``sglang_hooks.mark_staged_send``, ``send_last_page_only``), one record per
bootstrap room, owned by the node's stager (before, they lived as ``_oasis_*`` attributes on SGLang's
Mooncake senders).

A request's send is decided at its first chunk once the stager can be found by decode nodes:

- the handshake: staged only when every decode session it goes to has asked this node for a hand-off
  before (``PrefillStager.fetch``); any other decode node (plain SGLang, a server that does not fetch, one
  not heard from yet) gets it whole, as SGLang sends it;
- the staging cap: staged only if its bytes fit beside what is staged and reserved
  (``PrefillStager.reserve``); otherwise whole.

A staged request's chunks send nothing (``pages`` remembers the last page SGLang chose); its last chunk
stages the whole prompt's KV and sends that one page, so SGLang's protocol (aux data, completion, failure
handling) runs unchanged. A request sent whole still gets a hand-off of its first selection at its last
chunk (``PrefillStager.hand_over_whole``): a fetching decode node asks for it, and so introduces itself.

SGLang's side of it, two hooks: ``on_chunk`` (``send_kv_chunk``, the only place that knows a send's
request: its slot, prompt length and the decode node's cached prefix) and ``on_prepared``
(``CommonKVSender._prepare_send_indices``, where every send's pages are decided). A staging failure fails
the request's transfer (SGLang's own failure path); the server goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from sglang_oasis.sglang_contract import STAGER_ATTRIBUTE

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVSender
    from sglang.srt.managers.schedule_batch import Req

    from sglang_oasis.stats import OasisStats

logger = logging.getLogger(__name__)


@dataclass
class StagedSend:
    """What was decided for one bootstrap room's send, and what its staging still needs."""

    whole: bool  # SGLang sends all of it (an unknown decode node, or over the staging cap)
    since: float  # when it was decided (records of aborted requests expire with the stager's TTL)
    stage: tuple[int, int, int] | None = None  # (request slot, tokens, decode prefix) at the last chunk
    last_page: int | None = None  # the last page SGLang's send chose so far (sent alone at the end)


class Stager(Protocol):
    """What the plans ask of the node's ``PrefillStager``."""

    ready: threading.Event

    def fetch(self, decode_sessions: Iterable[str]) -> bool: ...
    def reserve(self, room: int, num_tokens: int) -> bool: ...
    def stage(self, room: int, slot: int, num_tokens: int, decode_prefix_len: int) -> None: ...
    def hand_over_whole(self, room: int, slot: int, num_tokens: int, decode_prefix_len: int) -> None: ...


SendIndices = tuple["npt.NDArray[np.int32]", slice, bool, bool]  # what SGLang's sender prepared


class SendPlans:
    def __init__(self, stager: Stager, stats: OasisStats) -> None:
        self.stager = stager
        self.stats = stats
        self._sends: dict[int, StagedSend] = {}  # bootstrap room -> its send
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sends)

    def get(self, room: int) -> StagedSend | None:
        with self._lock:
            return self._sends.get(room)

    def decide(
        self, room: int, decode_sessions: Iterable[str], prompt_tokens: int, rid: str
    ) -> StagedSend | None:
        """Room ``room``'s send, decided at its first chunk after the stager is ready (None before: SGLang
        sends it as it would)."""
        with self._lock:
            send = self._sends.get(room)
        if send is not None or not self.stager.ready.is_set():
            return send
        if not self.stager.fetch(decode_sessions):
            self.stats.add("staging_unknown_decoder_sends")
            send = StagedSend(whole=True, since=time.monotonic())
        elif not self.stager.reserve(room, prompt_tokens):
            self.stats.add("staging_whole_sends")
            logger.warning(
                "oasis: staging is full (--oasis-remote-fetch-max-staged-mib); request %s goes whole", rid
            )
            send = StagedSend(whole=True, since=time.monotonic())
        else:
            send = StagedSend(whole=False, since=time.monotonic())
        with self._lock:
            self._sends[room] = send
        return send

    def last_chunk(self, room: int, slot: int, num_tokens: int, decode_prefix_len: int) -> None:
        """The request's last chunk is being sent: a staged one records what to stage (``pages`` stages it
        with the last page); one sent whole gets the hand-off of its first selection now (a failure is
        logged: the decode node then fails the request, naming the missing hand-off)."""
        send = self.get(room)
        if send is None:
            return
        if not send.whole:
            send.stage = (slot, num_tokens, decode_prefix_len)
            return
        self.forget(room)
        try:
            self.stager.hand_over_whole(room, slot, num_tokens, decode_prefix_len)
        except Exception:
            logger.exception("oasis: handing over bootstrap room %d's first selection failed", room)

    def pages(self, room: int, kv_indices: npt.NDArray[np.int32], is_last: bool) -> int | None:
        """For a chunk of room ``room`` that SGLang's sender prepared (``kv_indices``, its pages): None if
        the room is not staged (send them as SGLang would). Else nothing is sent before the last chunk
        (the last page is remembered; -1 returned), and at the last chunk the prompt's KV is staged and
        the one page to send returned (raises if staging fails: its staging is released)."""
        send = self.get(room)
        if send is None or send.whole:
            return None
        if len(kv_indices):
            send.last_page = int(kv_indices[-1])
        if not is_last:
            return -1
        self.forget(room)
        if send.stage is None or send.last_page is None:
            raise RuntimeError(f"bootstrap room {room}: its last chunk came without its stage or a page")
        self.stager.stage(room, *send.stage)
        return send.last_page

    def on_chunk(self, req: Req, last_chunk: bool, end_idx: int | None) -> None:
        """A chunk of ``req`` is about to be sent (SGLang's ``send_kv_chunk``): its send is decided, and at
        its last chunk told what to stage or hand over. The node's stager goes on SGLang's KV manager, for
        the hooks that are handed only SGLang's sender or manager."""
        sender: Any = getattr(req, "disagg_kv_sender", None)
        if not is_mooncake_sender(sender):
            return
        setattr(sender.kv_mgr, STAGER_ATTRIBUTE, self.stager)
        room, prompt = int(sender.bootstrap_room), len(req.origin_input_ids)
        self.decide(room, sender.kv_mgr.transfer_infos.get(room, {}), prompt, str(req.rid))
        if last_chunk:
            extend_end = prompt if req.extend_end is None else req.extend_end
            tokens = end_idx if end_idx is not None else min(extend_end, prompt)
            slot = int(cast(int, req.kv.req_pool_idx))
            self.last_chunk(room, slot, int(tokens), int(req.disagg_decode_prefix_len))

    def on_prepared(self, sender: CommonKVSender, prepared: SendIndices) -> SendIndices:
        """What SGLang's sender prepared for a chunk of its room, as it goes: unchanged for a room not
        staged; nothing for a staged room's chunks before the last, and its last page alone at the last
        (``pages``). A staging failure is recorded as the room's transfer failure: the request fails."""
        kv_indices, index_slice, is_last, skip = prepared
        if skip:
            return prepared
        room = int(sender.bootstrap_room)
        try:
            page = self.pages(room, kv_indices, is_last)
        except Exception as error:  # the request fails, the server goes on
            from sglang.srt.disaggregation.base.conn import KVPoll

            logger.exception("oasis: staging bootstrap room %d failed", room)
            sender.kv_mgr.record_failure(
                room, f"oasis: staging the KV for remote partial fetching failed: {error}"
            )
            sender.kv_mgr.update_status(room, cast("KVPoll", KVPoll.Failed))  # KVPoll: a class of ints
            return kv_indices[:0], index_slice, is_last, True
        if page is None:  # not staged: as SGLang sends it
            return prepared
        if not is_last:
            return kv_indices[:0], slice(index_slice.stop, index_slice.stop), is_last, False
        end = index_slice.stop
        return _one_page(kv_indices, page), slice(end - 1, end), True, False

    def forget(self, room: int) -> None:
        with self._lock:
            self._sends.pop(room, None)

    def expire(self, ttl_s: float, now: float | None = None) -> None:
        """Drop the records older than ``ttl_s`` (requests aborted before their last chunk)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for room in [room for room, send in self._sends.items() if now - send.since > ttl_s]:
                del self._sends[room]


def is_mooncake_sender(sender: object) -> bool:
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    return isinstance(sender, MooncakeKVSender)


def _one_page(kv_indices: npt.NDArray[np.int32], page: int) -> npt.NDArray[np.int32]:
    import numpy as np

    return np.asarray([page], dtype=np.asarray(kv_indices).dtype)
