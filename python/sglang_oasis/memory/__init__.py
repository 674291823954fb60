"""Memory tiers: block summaries, the head-wise mapping and the device working sets beside SGLang's
KV pool (which is the host tier in sparse mode), and the host tier's default size."""
