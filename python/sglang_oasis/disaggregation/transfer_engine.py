"""One Mooncake transfer engine per process, with registered memory and checked, batched reads.

The engine runs in P2P-handshake mode (no metadata server): a peer is named by its session id
``"host:rpc_port"``. Every engine call returns 0 or a negative code and never raises, so each return code
is checked here and turned into an exception that names the call. Reads to one peer go in batches of at
most ``MAX_BATCH_REQUESTS`` (more than 2048 requests per peer in one batch fail with Mooncake 0.3.13 and can
leave the connection broken).

Environment defaults (set only when unset, before the engine starts): ``MC_FORCE_TCP=1`` with the CPU build
(the protocol argument alone does not force TCP), ``MC_LOG_LEVEL=ERROR``, and ``MC_TRANSFER_TIMEOUT=30``
(seconds a read to a frozen peer may block before it fails).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import torch

from sglang_oasis.disaggregation.mooncake_builds import CPU_BUILD, check_single_mooncake_build

MAX_BATCH_REQUESTS = 1024


class TransferEngineError(RuntimeError):
    """The transfer engine could not start, or memory could not be (un)registered."""


TRANSFER_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"  # Mooncake's per-transfer timeout, seconds
DEFAULT_TRANSFER_TIMEOUT_S = 30


def transfer_timeout_s() -> float:
    """Seconds a Mooncake transfer may take before it fails (``MC_TRANSFER_TIMEOUT``, else ours)."""
    return float(os.environ.get(TRANSFER_TIMEOUT_ENV, DEFAULT_TRANSFER_TIMEOUT_S))


class RemoteReadError(RuntimeError):
    """A read from a peer failed (peer gone, frozen past the timeout, or an unregistered address)."""

    def __init__(self, session: str, requests: int, nbytes: int, code: int, reason: str = "") -> None:
        super().__init__(
            f"Mooncake read of {requests} region(s), {nbytes} bytes, from {session} failed "
            f"({reason or f'code {code}'})"
        )
        self.session = session


def engine_env_defaults() -> dict[str, str]:
    """The ``MC_*`` settings every Mooncake engine of the project runs with (ours and SGLang's in the
    servers ``launch_pd`` starts): the environment's values where set, else ``MC_LOG_LEVEL=ERROR`` and,
    with the CPU build, ``MC_FORCE_TCP=1``."""
    defaults = {"MC_LOG_LEVEL": "ERROR"}
    if check_single_mooncake_build() == CPU_BUILD:
        defaults["MC_FORCE_TCP"] = "1"
    return {name: os.environ.get(name, value) for name, value in defaults.items()}


class MooncakeEndpoint:
    """A transfer engine on ``host`` that registers local tensors and reads peers' registered memory."""

    def __init__(self, host: str = "127.0.0.1", max_batch: int = MAX_BATCH_REQUESTS) -> None:
        build = check_single_mooncake_build()
        if build is None:
            raise TransferEngineError(
                "no Mooncake build is installed: pip install sglang-oasis[mooncake-cpu] (no GPU) or "
                "sglang-oasis[mooncake-cuda]"
            )
        os.environ.update(engine_env_defaults())
        os.environ.setdefault(TRANSFER_TIMEOUT_ENV, str(DEFAULT_TRANSFER_TIMEOUT_S))
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        code = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if code != 0:
            raise TransferEngineError(f"Mooncake transfer engine failed to start on {host} (code {code})")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self.max_batch = max_batch
        self._registered: dict[int, torch.Tensor] = {}  # address -> tensor (kept alive while registered)
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.batches = 0

    def register(self, tensor: torch.Tensor) -> int:
        """Registers a contiguous tensor's memory for peers to read (or for reads into it); returns its
        address."""
        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        with self._lock:
            if address in self._registered:
                return address
            code = self.engine.register_memory(address, nbytes)
            if code != 0:
                raise TransferEngineError(f"registering {nbytes} bytes at {address:#x} failed (code {code})")
            self._registered[address] = tensor
        return address

    def unregister(self, tensor: torch.Tensor) -> None:
        with self._lock:
            if self._registered.pop(tensor.data_ptr(), None) is None:
                return
            code = self.engine.unregister_memory(tensor.data_ptr())
        if code != 0:
            raise TransferEngineError(f"unregistering {tensor.data_ptr():#x} failed (code {code})")

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._registered.values())

    def read(self, session: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> None:
        """Reads ``lengths[i]`` bytes at the peer's ``remote[i]`` into ``local[i]``, in batches of at most
        ``max_batch`` requests; raises ``RemoteReadError`` at the first failed batch."""
        if not len(local) == len(remote) == len(lengths):
            raise ValueError("local, remote and lengths must have the same length")
        for start in range(0, len(local), self.max_batch):
            end = start + self.max_batch
            batch_lengths = list(lengths[start:end])
            code = self.engine.batch_transfer_sync_read(
                session, list(local[start:end]), list(remote[start:end]), batch_lengths
            )
            if code != 0:
                raise RemoteReadError(session, len(batch_lengths), sum(batch_lengths), code)
            with self._lock:
                self.bytes_read += sum(batch_lengths)
                self.batches += 1

    def close(self) -> None:
        """Unregisters everything still registered (the engine itself stops with the process)."""
        with self._lock:
            tensors = list(self._registered.values())
        for tensor in tensors:
            self.unregister(tensor)
