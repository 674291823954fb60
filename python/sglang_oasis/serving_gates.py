"""What sparse mode refuses to serve, by name, wherever the server was started.

The launcher (``launch_server.py``, from its command line, before SGLang starts) and the oasis backend (from
SGLang's parsed server arguments, as it is built: a plain ``python -m sglang.launch_server
--attention-backend oasis`` meets the same refusals) ask the same question here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from sglang_oasis.config import OasisConfig

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import KVCache
    from sglang.srt.model_executor.model_runner import ModelRunner


class ServingRefused(ValueError):
    """A start sparse mode refuses; the message names the options."""


class Serving(NamedTuple):
    """The facts about a start that the gates read."""

    device: str  # "cuda", "cpu", ...
    tp_size: int = 1
    cuda_graphs: bool = True  # SGLang captures decode passes in CUDA graphs (not --disable-cuda-graph)
    torch_compile: bool = False  # --enable-torch-compile

    @classmethod
    def of(cls, model_runner: ModelRunner) -> Serving:
        """SGLang's model runner's start (its server arguments)."""
        args = model_runner.server_args
        return cls(
            torch.device(model_runner.device).type, int(getattr(args, "tp_size", 1) or 1),
            not bool(getattr(args, "disable_cuda_graph", False)), bool(getattr(args, "enable_torch_compile", False)),
        )  # fmt: skip


def check_sparse_serving(config: OasisConfig, serving: Serving) -> None:
    """Raise ``ServingRefused`` for a start sparse mode does not serve (``config.mode`` sparse)."""
    if config.mode != "sparse":
        return
    if serving.torch_compile:
        raise ServingRefused(
            "--enable-torch-compile: sparse mode's decode step does not run under SGLang's compiled graph "
            "runners (it compiles its own program: --oasis-decode-step captured); serve without it"
        )
    if serving.device != "cuda":
        return
    if not config.cuda_untested:
        raise ServingRefused(
            "--oasis-mode sparse has never run on a GPU (docs/gpu.md): pass --oasis-mode dense, or "
            "--oasis-cuda-untested true to try the untested CUDA path"
        )
    if not serving.cuda_graphs:
        return
    if serving.tp_size > 1:
        raise ServingRefused(
            f"--tp-size {serving.tp_size} with CUDA graphs: the ranks would each decide alone whether a pass "
            "replays its graph (nothing makes them agree yet): pass --disable-cuda-graph too, or one GPU"
        )
    if config.dense_layers:
        raise ServingRefused(
            "--oasis-dense-layers on CUDA: those layers decode through SGLang's torch_native attention, "
            "which a CUDA graph cannot capture: pass --disable-cuda-graph too, or no dense layers"
        )
    if config.lookahead != "previous":
        raise ServingRefused(
            f"--oasis-lookahead {config.lookahead} on CUDA: the verify step runs eagerly and SGLang would "
            "capture it in a CUDA graph: pass --disable-cuda-graph too, or --oasis-lookahead previous"
        )
    if config.decode_step != "captured":
        raise ServingRefused(
            f"--oasis-decode-step {config.decode_step} on CUDA: SGLang captures the decode step in a CUDA "
            "graph, which only the captured step can be: pass --oasis-decode-step captured, or "
            "--disable-cuda-graph to decode eagerly"
        )


def check_host_tier(pool: KVCache, device: str | torch.device) -> None:
    """On CUDA, sparse mode's host tier must be SGLang's pool in page-locked host memory (hooks 15 and 16
    build it so in every process the plugin loads in); anything else would hold the whole KV on the GPU."""
    from sglang_oasis.memory.host_kv_pool import PinnedHostKVPool

    if torch.device(device).type == "cuda" and not (
        isinstance(pool, PinnedHostKVPool) and pool.in_host_memory()
    ):
        raise RuntimeError(
            f"oasis sparse mode on CUDA: SGLang's KV pool ({type(pool).__name__}) is not the host tier in "
            "page-locked host memory (sglang_hooks hooks 15 and 16 build it; were the plugin's hooks "
            "registered in this process?)"
        )
