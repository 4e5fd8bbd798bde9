"""The length of the actor's static KV cache (``generation.static_cache``), without torch: the
decode (``static_decode.py``) and the memory planner (``plan/memory.py``) size it alike."""
from __future__ import annotations

LENGTH_ROUND = 64  # cache lengths are multiples of this: one set of buffers serves many widths


def cache_length(context: int, max_new_tokens: int, sync_every: int) -> int:
    """Positions a static cache needs for a context of ``context`` tokens: the context, every
    token decoded (a block decode may feed up to ``sync_every`` - 1 more after a row ends),
    rounded up to ``LENGTH_ROUND``."""
    need = context + max_new_tokens + sync_every
    return -(-need // LENGTH_ROUND) * LENGTH_ROUND
