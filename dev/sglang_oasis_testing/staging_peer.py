"""A stand-alone prefill-side staging process for RPF tests: stages seeded random KV for a few requests
in its own Mooncake transfer engine, prints one JSON line of layouts, and serves reads until stdin
closes (or it is killed, which is what the fault tests do).

    python -m sglang_oasis_testing.staging_peer --seed 3 --requests 2 --layers 2 --tokens 70 \
        --kv-heads 2 --head-dim 8 --block-size 16

``seeded_kv`` regenerates the same tensors in the test process, to compare what was read.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from sglang_oasis.disaggregation.staging import KVStagingArea
from sglang_oasis.disaggregation.transfer_engine import MooncakeEndpoint


def seeded_kv(seed: int, request: int, layers: int, tokens: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    generator = torch.Generator().manual_seed(seed * 1000 + request)
    shape = (layers, tokens, kv_heads, head_dim)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("seed", 0), ("requests", 1), ("layers", 2), ("tokens", 70), ("kv-heads", 2),
                          ("head-dim", 8), ("block-size", 16)):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    area = KVStagingArea(MooncakeEndpoint(), args.block_size)
    layouts = []
    for request in range(args.requests):
        keys, values = seeded_kv(args.seed, request, args.layers, args.tokens, args.kv_heads, args.head_dim)
        layouts.append(area.stage(f"r{request}", keys, values).to_dict())
    print(json.dumps(layouts), flush=True)
    sys.stdin.read()  # serve until the test closes our stdin


if __name__ == "__main__":
    main()
