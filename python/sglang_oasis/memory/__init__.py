"""Memory tiers: the host-memory block pool holding full KV, and the device working-set mapping."""
