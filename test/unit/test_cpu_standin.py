"""The pure-torch ``sgl_kernel`` stand-in against per-element loops, and the import hook's scope."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sglang_oasis.platform.cpu.sgl_kernel_ops import (
    assign_req_to_token_pool_cpu,
    copy_all_layer_kv_cache_cpu,
)


def _assign_reference(req_pool_indices, req_to_token, start, end, out_cache_loc):
    offset = 0
    for row, s, e in zip(req_pool_indices.tolist(), start.tolist(), end.tolist(), strict=True):
        for col in range(s, e):
            req_to_token[row, col] = out_cache_loc[offset]
            offset += 1


@pytest.mark.parametrize("batch", [1, 3, 7])
@pytest.mark.parametrize("seed", [0, 1])
def test_assign_req_to_token_pool_matches_loop(batch: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool_len = 53
    req_to_token = torch.randint(0, 1000, (11, pool_len), generator=gen, dtype=torch.int32)
    rows = torch.randperm(11, generator=gen)[:batch]
    start = torch.randint(0, 30, (batch,), generator=gen)
    end = start + torch.randint(0, 23, (batch,), generator=gen)  # includes empty ranges
    total = int((end - start).sum())
    out_cache_loc = torch.randint(0, 10_000, (total + 5,), generator=gen, dtype=torch.int64)
    expected = req_to_token.clone()
    _assign_reference(rows, expected, start, end, out_cache_loc)
    assign_req_to_token_pool_cpu(rows, req_to_token, start, end, out_cache_loc, pool_len)
    assert torch.equal(req_to_token, expected)


def test_copy_all_layer_kv_cache_reads_before_writing() -> None:
    gen = torch.Generator().manual_seed(0)
    buffers = [torch.randn(40, 3, 5, generator=gen), torch.randn(40, 7, generator=gen).to(torch.bfloat16)]
    expected = [b.clone() for b in buffers]
    # A chain of moves where targets overlap sources: 3->5, 5->9, 9->3 and two plain moves.
    src = torch.tensor([3, 5, 9, 0, 31], dtype=torch.int64)
    tgt = torch.tensor([5, 9, 3, 39, 1], dtype=torch.int64)
    for e in expected:
        e[tgt] = e[src].clone()
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers], dtype=torch.int64)
    copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)
    for got, want in zip(buffers, expected, strict=True):
        assert torch.equal(got, want)


def _run(code: str, cpu_engine: bool) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    if cpu_engine:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_standin_inactive_without_cpu_engine() -> None:
    """Off the CPU engine, nothing answers for sgl_kernel: the real (CUDA) package is what imports."""
    result = _run(
        "import sys\n"
        "from sglang_oasis.platform.cpu.import_hook import installed\n"
        "print('installed', installed())\n"
        "print('finders', [type(f).__name__ for f in sys.meta_path])\n",
        cpu_engine=False,
    )
    assert result.returncode == 0, result.stderr
    assert "installed False" in result.stdout
    assert "SglKernelStandinFinder" not in result.stdout


def test_standin_active_on_cpu_engine_from_interpreter_start() -> None:
    result = _run(
        "import sgl_kernel\n"
        "from sgl_kernel import assign_req_to_token_pool_cpu, verify_tree_greedy_cpu\n"
        "from sglang_oasis.platform.cpu import sgl_kernel_ops\n"
        "assert assign_req_to_token_pool_cpu is sgl_kernel_ops.assign_req_to_token_pool_cpu\n"
        "try:\n"
        "    from sgl_kernel import some_cuda_only_name\n"
        "except ImportError as e:\n"
        "    print('absent-ok')\n"
        "assert verify_tree_greedy_cpu is sgl_kernel_ops.verify_tree_greedy_cpu\n"
        "print('speculative-ok')\n"
        "from sgl_kernel.scalar_type import scalar_types\n",
        cpu_engine=True,
    )
    # The last import must fail as an ImportError (SGLang falls back on it), not resolve to a module.
    assert "absent-ok" in result.stdout, result.stderr
    assert "speculative-ok" in result.stdout, result.stderr
    assert "ImportError: cannot import name 'scalar_types'" in result.stderr
