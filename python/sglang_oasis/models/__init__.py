"""Models that work offline: the embedded default (SmolLM2 from PyPI) and tiny random test models."""
