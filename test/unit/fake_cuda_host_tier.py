"""Hooks 15 and 16 on SGLang's own KV-cache configurator, on a fake CUDA device with fake memory readings
(run by ``test_fake_cuda.py`` in a child process: SGLang's server arguments and runtime context need its
CPU engine, which it reads once per process as it imports). Prints one JSON object.

The reading: a GPU with ``GPU_GIB`` free after the weights (``get_available_gpu_memory``), a host with
``HOST_GIB`` available (``available_host_memory``). SGLang's profiling runs as it does at start-up; the
hooks wrap it as SGLang's HookRegistry would (AROUND).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace as NS
from unittest import mock

import torch
from sglang.srt import runtime_context
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.server_args import ServerArgs

from sglang_oasis.config import OasisConfig
from sglang_oasis.memory import host_kv_pool
from sglang_oasis.memory.device_tier import DeviceTier
from sglang_oasis.memory.host_kv_pool import PinnedHostKVPool
from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis_testing.fake_cuda import FakeCuda

GPU_GIB, HOST_GIB, PRE_MODEL_LOAD_GIB = 40.0, 256.0, 44.0
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M's KV, in bfloat16
BYTES_PER_TOKEN = LAYERS * KV_HEADS * HEAD_DIM * 2 * 2


def configurator() -> KVCacheConfigurator:
    """SGLang's configurator of the target model on ``cuda`` (the attributes its two methods read)."""
    conf = object.__new__(KVCacheConfigurator)
    conf.device, conf.gpu_id, conf.is_draft_worker, conf.mambaish_config = "cuda", 0, False, None
    conf.model_config = NS(
        is_multimodal=False, get_num_kv_heads=lambda tp, dcp: KV_HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM
    )
    conf.kv_cache_dtype_str, conf.kv_cache_dtype = "auto", torch.bfloat16
    conf.post_capture_kv_active, conf.kv_shard_rank = False, None
    conf.layer_info = NS(num_effective_layers=LAYERS, start_layer=0, end_layer=LAYERS - 1)
    return conf


def main() -> None:
    args = ServerArgs(
        model_path=str(prepare_default_model()), device="cpu", page_size=16, mem_fraction_static=0.8
    )
    context = runtime_context.create_context(args, role="scheduler")
    context.parallel.override_permanently(world_group=NS(cpu_group=None))
    conf, config = configurator(), OasisConfig(block_size=16, top_k=32, cuda_untested=True)
    readings = (
        mock.patch(
            "sglang.srt.mem_cache.kv_cache_configurator.get_available_gpu_memory", lambda *a, **k: GPU_GIB
        ),
        mock.patch("sglang_oasis.memory.host_tier.available_host_memory", lambda: int(HOST_GIB * 2**30)),
    )
    with FakeCuda() as cuda, runtime_context.use_context(context), readings[0], readings[1]:
        dense_bytes = KVCacheConfigurator._profile_available_bytes(conf, PRE_MODEL_LOAD_GIB)  # SGLang alone
        measured = host_kv_pool.GpuKVBytes()  # what register() shares between the two hooks
        host_bytes = host_kv_pool.host_tier_bytes(
            config, measured, KVCacheConfigurator._profile_available_bytes, conf, PRE_MODEL_LOAD_GIB
        )
        kept = measured._bytes.get(id(conf))
        before = cuda.device_bytes
        # the pool itself, at a size this machine can hold (its sizing is above)
        pool = host_kv_pool.build_pool(
            measured, KVCacheConfigurator._build_mha_kv_pool, conf, max_total_num_tokens=4096,
            mha_pool_class=MHATokenToKVPool,
        )  # fmt: skip
        assert isinstance(pool, PinnedHostKVPool)
        pool_device_bytes = cuda.device_bytes - before
        requests = ReqToTokenPool(8, 4096, "cuda", False)
        tier = DeviceTier.for_pool(pool, config, None, requests, "cuda")
        refused = ""
        try:
            host_kv_pool.build_pool(
                measured, KVCacheConfigurator._build_mha_kv_pool, conf, max_total_num_tokens=64,
                mha_pool_class=PinnedHostKVPool,
            )  # fmt: skip
        except ValueError as error:
            refused = str(error)
    print(json.dumps({
        "dense_bytes": dense_bytes, "host_bytes": host_bytes, "kept_gpu_bytes": kept,
        "bytes_per_token": BYTES_PER_TOKEN, "pool_class": type(pool).__name__, "pool_gpu_kv_bytes": pool.gpu_kv_bytes,
        "in_host_memory": pool.in_host_memory(), "pool_buffers_on": pool.k_buffer[0].device.type,
        "pool_host_bytes": pool.host_bytes, "pool_device_bytes": pool_device_bytes, "device_budget": tier.layout.budget_bytes,
        "device_tensors_on": sorted({t.device.type for t in tier.tensors().values()}), "refused": refused,
    }))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
