"""The names sglang-oasis and its hooks (``sglang_hooks.py``) agree on, kept below both.

SGLang has no callback for a few moments the oasis backend must know of (a freed request row, a KV
backup, a retraction), so the backend sets a listener on an SGLang object it shares with the scheduler,
and a hook calls it; and a few values cross between processes by name. The backend and the hooks import
these names from here, so neither imports the other for them (the hooks import nothing of the backend).
"""

from __future__ import annotations

BACKEND_NAME = "oasis"  # ``--attention-backend oasis``
FIGURES_KEY = "oasis"  # ``meta_info`` key of a request's own figures (hook 10)

# Attributes of SGLang's request-to-token pool (one per scheduler process, shared by the target and the
# EAGLE-3 draft model), set by the oasis backend:
FREED_ROW_LISTENER = "oasis_on_free_row"  # called with each freed row (a PD decode node's pool, hook 7)
BEFORE_BACKUP_LISTENER = "oasis_before_backup"  # row -> whether its KV is whole locally (hook 7)
RETRACT_LISTENER = "oasis_on_retract"  # (row, key, tokens, backed_up) of a retracted request (7, 8)
DRAFT_KV_ATTRIBUTE = "oasis_draft_kv"  # the EAGLE-3 draft model's KV pool (set by its attention backend)

RETRACTION_KEY = "oasis_retraction_key"  # attribute of a retracted Req: what its kept state is found by
# Attribute of SGLang's Mooncake KV manager (one per prefill scheduler process): this node's stager, for
# the hooks that are handed SGLang's sender or manager and nothing of the scheduler (hook 7).
STAGER_ATTRIBUTE = "oasis_stager"
