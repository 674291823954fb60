"""Each request slot's working-set tables as they were before its last selection.

SGLang may retract a request after its last forward and drop that forward's token (overlap
scheduling), then redo that step after the resume (``retraction.py``). To keep the tables the redone
step starts from, every selection first calls ``remember`` (the selector, before the job that changes
the tables starts; the captured step, before a pass) with the rows it will change, and a retraction
asks ``before`` whether the request's last forward is the one SGLang dropped.

The backend builds this before the selector and hands ``remember`` to it (and to the captured step
through the selector): the selector is built with its listener, not given one afterwards.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.memory.working_set import WorkingSetPool

TABLES = ("slot_block", "last_selected", "covered", "top_k")  # the working-set tables a selection changes


class Before(NamedTuple):
    """A slot's tables before its last selection (each indexed ``[slot]``), and that step's."""

    tables: dict[str, torch.Tensor]
    step: int  # the backend's decode step the selection was made at
    admission: bool  # the selection was an admission (its first working set)


class SelectionSnapshot:
    def __init__(self, working_sets: WorkingSetPool) -> None:
        self.working_sets = working_sets
        self._tables = {name: getattr(working_sets, name).clone() for name in TABLES}
        slots = len(working_sets.covered)
        self._seq_len = torch.zeros(slots, dtype=torch.int64)
        self._step = torch.zeros(slots, dtype=torch.int64)
        self._admission = torch.zeros(slots, dtype=torch.bool)

    def remember(self, batch: BatchView, layer: int | None, seq_lens: list[int]) -> None:
        """Before a selection at ``layer`` (None: every layer, a captured pass) (the job that changes the
        tables has not started): the rows it will change, as they are."""
        slots, sets = batch.slots, self.working_sets
        at = slots if layer is None else (slots, layer)
        for name, before in self._tables.items():
            before[at] = getattr(sets, name)[at]
        self._seq_len[slots] = torch.tensor(seq_lens, dtype=torch.int64)
        self._step[slots] = batch.step
        self._admission[slots] = batch.admitting

    def before(self, slot: int, tokens: int) -> Before | None:
        """The slot's tables before its last selection if that selection's step computed the token at
        ``tokens - 1`` (a request of ``tokens`` tokens whose last forward SGLang dropped); else None."""
        if int(self._seq_len[slot]) != tokens:
            return None
        return Before(self._tables, int(self._step[slot]), bool(self._admission[slot]))

    def current(self) -> dict[str, torch.Tensor]:
        """The working-set tables as they are now (what a retraction keeps otherwise)."""
        return {name: getattr(self.working_sets, name) for name in TABLES}
