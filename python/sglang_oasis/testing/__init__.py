"""Helpers shared by tests and benchmarks: start and stop real servers on 127.0.0.1."""
