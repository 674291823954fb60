"""Lookahead: draft tokens whose query predicts the next decode step's KV blocks (the EAGLE-3 draft head
and its trained checkpoint for the default model)."""
