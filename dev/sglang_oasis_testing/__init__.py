"""Helpers for tests and benchmarks only (not part of the runtime package): tiny random models, a PD
deployment driven in-process, a Mooncake staging peer. Servers are started with the runtime's
``sglang_oasis.server_process``."""
