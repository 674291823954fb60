"""The device tier: everything the GPU design keeps in accelerator memory, sized from one budget.

``--oasis-device-kv-tokens N`` gives the device tier the bytes a dense KV pool of N tokens would take
(N x the served model's KV bytes per token). In them it holds, and allocates exactly:

    summaries            kmin/kmax of every host block, per layer and KV head, and the blocks' epochs
                         (fixed: set by the host tier's size, whatever the load); with --oasis-selector
                         codes, every full block's keys at 2 bits per channel (``key_code_store.py``)
    per request slot     the working sets (K + sink blocks of B tokens per layer and KV head, K and V;
                         K is --oasis-recall-max-top-k when a recall target may grow them),
                         their head-wise map (block held by each slot, last selection step), the blocks
                         the last selection covered and each layer's top-K, and the prefill window's pinned block ids
                         the active blocks (``active_blocks.py``): the request's newest tokens per layer
                         and KV head (the tail after the covered blocks, and a step's new tokens)

    request slots = (budget - summaries) // bytes per request slot

Request slots are not SGLang's ``req_to_token`` rows (those include a padding row and, on a PD decode
node, the pre-allocation slots): a request takes a device slot at its first forward pass here and its
slot is reclaimed once SGLang has freed the request. The launcher caps ``--max-running-requests`` at the
number of request slots, so SGLang's own admission keeps a request waiting until one is free.

Finished requests keep their slot (and its resident blocks, which warm starts reuse) until a new request
needs it; the least recently claimed finished slot goes first.

Not here: the EAGLE-3 draft model's one-layer KV is SGLang's own pool (the draft worker's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from sglang_oasis.config import OasisConfig
from sglang_oasis.memory.active_blocks import ActiveBlocks
from sglang_oasis.memory.device_layout import (
    DeviceTierError,
    DeviceTierLayout,
    TierShape,
    budget_bytes,
    layout,
)
from sglang_oasis.memory.key_code_store import KeyCodeStore
from sglang_oasis.memory.summary_store import BlockSummaryStore
from sglang_oasis.memory.tier_tables import TierTables
from sglang_oasis.memory.working_set import WorkingSetPool

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class DeviceTier:
    """The tensors of one layout, and which request holds which request slot."""

    def __init__(
        self, shape: TierShape, plan: DeviceTierLayout, dtype: torch.dtype, device: torch.device | str,
        top_k: int | None = None,
    ):  # fmt: skip
        self.shape = shape
        self.layout = plan
        slots = plan.request_slots
        allocated = slots + plan.padding_slots  # the padding slot (if any) is the last; no request claims it
        self.summaries = BlockSummaryStore(
            shape.num_layers,
            shape.host_pages,
            shape.num_kv_heads,
            shape.head_dim,
            shape.block_size,
            dtype,
            device,
            shape.epoch_layer,
        )
        self.codes: KeyCodeStore | None = None  # --oasis-selector codes
        if shape.key_codes:
            self.codes = KeyCodeStore(
                self.summaries, shape.num_layers, shape.host_pages, shape.num_kv_heads, shape.head_dim, device
            )
        self.working_sets = WorkingSetPool(
            allocated, shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.slots_per_head,
            shape.block_size, dtype, device, top_k,
        )  # fmt: skip
        self.active = ActiveBlocks(
            allocated, shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.block_size,
            shape.active_tokens, dtype, device,
        )  # fmt: skip
        # Per request slot, layer and KV head: the blocks the prefill window keeps selected (-1: none).
        self.pinned = torch.full((allocated, shape.num_layers, shape.num_kv_heads, shape.window_blocks), -1)
        # Per request slot and layer, the recall probe's (``recall_probe.py``): samples in a row well above
        # its target, and the last sample's recall and lookahead agreement per KV head (``[.., 2, H]``).
        self.recall_streak = torch.zeros((allocated, shape.num_layers), dtype=torch.int64)
        self.recall = torch.zeros((allocated, shape.num_layers, 2, shape.num_kv_heads), dtype=torch.float32)
        # The index tables above are the host plan's (host memory); the decode program reads and writes
        # their copies on the device, kept equal once per pass (``tier_tables.py``; on CPU the same tensors).
        ws, active = self.working_sets, self.active
        self.device = torch.device(device)
        self.tables = TierTables(
            {
                "slot_block": ws.slot_block, "last_selected": ws.last_selected, "covered": ws.covered,
                "top_k": ws.top_k, "pinned": self.pinned, "active_start": active.start,
                "active_end": active.end, "recall_streak": self.recall_streak, "recall": self.recall,
            },
            device,
        )  # fmt: skip
        self._owner: list[tuple[int, int] | None] = [None] * slots  # request slot -> (req, generation)
        self._slot: dict[int, int] = {}  # SGLang req pool index -> its current request slot
        self._claimed_at = [0] * slots
        self._claims = 0

    @classmethod
    def for_pool(
        cls,
        kv_pool: MHATokenToKVPool,
        config: OasisConfig,
        max_running: int | None,
        req_to_token_pool: ReqToTokenPool,
        device: torch.device | str,
    ) -> DeviceTier:
        """The device tier of ``--oasis-device-kv-tokens`` x the KV bytes per token of SGLang's pool (the
        host tier), with request slots for ``--max-running-requests`` (None: at most SGLang's request
        rows); refuses a running-request cap the budget cannot hold, naming both options."""
        shape = TierShape.of(
            config,
            num_layers=int(kv_pool.layer_num),
            num_kv_heads=int(kv_pool.head_num),
            head_dim=int(kv_pool.head_dim),
            element_bytes=torch.empty(0, dtype=kv_pool.dtype).element_size(),
            host_pages=int(kv_pool.size) // config.block_size + 2,  # SGLang keeps padding pages past ``size``
        )
        gpu_bytes = getattr(kv_pool, "gpu_kv_bytes", None)  # on CUDA: the host tier's (host_kv_pool.py)
        if config.device_kv_tokens is None and gpu_bytes is not None:
            budget, named = int(gpu_bytes), "the GPU memory SGLang would have given its KV pool"
        else:
            budget, named = budget_bytes(config, shape), f"--oasis-device-kv-tokens {config.device_tokens}"
        fitting = layout(budget, shape)
        if max_running is not None and int(max_running) > fitting.request_slots:
            raise DeviceTierError(
                f"--max-running-requests {max_running}: the device budget ({named}) holds "
                f"{fitting.request_slots} requests' working sets; lower it or raise the budget"
            )
        limit = int(max_running) if max_running is not None else int(req_to_token_pool.req_to_token.shape[0])
        return cls(shape, layout(budget, shape, limit), kv_pool.dtype, device, config.top_k)

    def cap_running_requests(self, model_runner: ModelRunner) -> None:
        """SGLang's scheduler runs at most ``model_runner.max_running_requests`` requests (it reads it once
        the model runner, attention backend included, is built): no more than this tier has request slots
        for, whatever started the server, so a request that finds none waits in SGLang's queue. The
        launcher passes that cap as ``--max-running-requests``; a server started otherwise gets it here."""
        running = getattr(model_runner, "max_running_requests", None)
        if isinstance(running, int) and running > self.num_request_slots:
            logger.warning(
                "oasis: running requests capped at %d (the device tier's request slots; SGLang allowed %d)",
                self.num_request_slots, running,
            )  # fmt: skip
            model_runner.max_running_requests = self.num_request_slots

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the device tier holds on the device, by name (its index tables: their device copies)."""
        ws, summaries = self.working_sets, self.summaries
        return {
            "working_set_k": ws.k,
            "working_set_v": ws.v,
            "active_k": self.active.k,
            "active_v": self.active.v,
            "summary_kmin": summaries.kmin,
            "summary_kmax": summaries.kmax,
            **({} if self.codes is None else {"key_codes": self.codes.codes}),
            **self.tables.device,
        }

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """What the host plan keeps beside it in host memory, by name: the tables' host mirror (on CPU the
        same tensors as the device tier's) and the summaries' page epochs (``summary_store.py``)."""
        return {
            **{f"host_{name}": t for name, t in self.tables.host.items()},
            "summary_epoch": self.summaries.epoch,
            **({} if self.codes is None else {"key_codes_coded": self.codes.coded}),
        }

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is (a view of) one of the device tier's tensors."""
        storage = tensor.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == storage for t in self.tensors().values())

    @property
    def num_request_slots(self) -> int:
        return self.layout.request_slots

    @property
    def padding_slot(self) -> int | None:
        """The slot padding rows of a captured step write into (``--oasis-decode-step captured``)."""
        return self.layout.request_slots if self.layout.padding_slots else None

    @property
    def claims(self) -> int:
        """Claims so far: the number of the latest (a key no earlier claim of any slot had)."""
        return self._claims

    # --- request slots ---------------------------------------------------------------------------

    def slot(self, req: int) -> int:
        """The request slot of SGLang request ``req`` (its req pool index)."""
        return self._slot[req]

    def slot_of(self, req: int) -> int:
        """The request slot of ``req``, -1 if it holds none."""
        return self._slot.get(req, -1)

    def holds(self, req: int, generation: int) -> bool:
        """Whether request ``req`` of this generation has its request slot."""
        slot = self._slot.get(req)
        return slot is not None and self._owner[slot] == (req, generation)

    def owner(self, slot: int) -> tuple[int, int] | None:
        """``(req, generation)`` that holds (or, finished, last held) request slot ``slot``."""
        return self._owner[slot]

    def live_slots(self, finished: Callable[[int, int], bool]) -> list[int]:
        """Request slots whose request SGLang has not freed (``finished(req, generation)``)."""
        return [slot for slot, owner in enumerate(self._owner) if owner is not None and not finished(*owner)]

    def claim(
        self, req: int, generation: int, finished: Callable[[int, int], bool], take: int | None = None
    ) -> int:
        """Give request ``req`` (``generation``) a request slot: ``take`` if given (a finished request's
        slot whose blocks it reuses), else a free one, else the least recently claimed slot of a finished
        request. Its previous contents are left as they are (``WorkingSetPool.claim`` or ``adopt``
        resets them). Raises when every slot holds a running request: SGLang ran more requests than
        ``--max-running-requests`` allows."""
        if take is None:
            free = [slot for slot, owner in enumerate(self._owner) if owner is None]
            if free:
                take = free[0]
            else:
                done = [
                    slot for slot, owner in enumerate(self._owner) if owner is not None and finished(*owner)
                ]
                if not done:
                    raise RuntimeError(
                        f"oasis: all {len(self._owner)} device request slots hold running requests; the "
                        "scheduler ran more requests than --max-running-requests allows"
                    )
                take = min(done, key=self._claimed_at.__getitem__)
        previous = self._owner[take]
        if previous is not None and self._slot.get(previous[0]) == take:
            del self._slot[previous[0]]
        self._owner[take] = (req, generation)
        self._slot[req] = take
        self._claims += 1
        self._claimed_at[take] = self._claims
        return take

    def used_bytes(self, live_slots: int) -> int:
        """The summaries plus ``live_slots`` request slots (those of running requests)."""
        return self.layout.summary_bytes + live_slots * self.layout.request_bytes
