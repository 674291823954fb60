"""Requests whose block transfer failed, each tagged with the generation of the request that caused it.

A prefetch job records the generation of every request it moves blocks for when it is built; a failure
it reports is filed under that generation. SGLang reuses a freed request row for the next request (with
a new generation), so a failure that surfaces after its request finished is never blamed on the row's
next owner. The scheduler hook (``sglang_hooks.abort_failed_transfers``) takes each failure when the
failing request's batch result is processed and aborts that request alone.
"""

from __future__ import annotations

import threading


class TransferFailures:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # the scheduler hook reads while the backend files
        self._pending: dict[int, tuple[int, str]] = {}  # req -> (generation, message), not yet taken
        self._reported: dict[int, int] = {}  # req -> the latest generation that failed

    def report(self, req: int, generation: int, message: str) -> bool:
        """File a failure of request ``req`` of ``generation``; False if that request already has one
        (a later layer or step of the same failure)."""
        with self._lock:
            if self._reported.get(req) == generation:
                return False
            self._reported[req] = generation
            self._pending[req] = (generation, message)
            return True

    def take(self, req: int, generation: int) -> str | None:
        """The message of request ``req`` of ``generation``, removed once taken. A failure of an older
        generation (a finished request) is dropped; one of a newer generation stays."""
        with self._lock:
            entry = self._pending.get(req)
            if entry is None:
                return None
            if entry[0] != generation:
                if entry[0] < generation:
                    del self._pending[req]
                return None
            del self._pending[req]
            return entry[1]

    def failed(self, req: int, generation: int) -> bool:
        """Whether request ``req`` of ``generation`` had a transfer fail (its working sets may map blocks
        that never arrived)."""
        return self._reported.get(req) == generation

    def held(self) -> int:
        """Failures filed and not taken by the scheduler yet."""
        return len(self._pending)

    def __bool__(self) -> bool:
        return bool(self._pending)
