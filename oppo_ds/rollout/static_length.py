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


def widest_context(max_prompt_len: int, max_new_tokens: int, carries: bool) -> int:
    """The widest context a rollout of a run can start from: a prompt of ``max_prompt_len``
    tokens and, when the rollout pool carries deferred rows, one of their partial responses
    (up to ``max_new_tokens`` - 1 tokens) packed after it. The rollout then decodes up to
    ``max_new_tokens`` more (its new rows), so the actor's cache, static or not, can reach
    this plus ``max_new_tokens`` positions."""
    return max_prompt_len + (max_new_tokens - 1 if carries else 0)


def run_cache_length(max_prompt_len: int, max_new_tokens: int, sync_every: int,
                     carries: bool) -> int:
    """The static cache length that serves every rollout of a run (``widest_context``).
    Sizing each rollout's cache by its own context instead gives a pool run a different
    length whenever its deferred rows have grown past a multiple of ``LENGTH_ROUND`` (256,
    320, 384 positions at 32 + 160 tokens), and with a CUDA graph each new length is a
    capture."""
    return cache_length(widest_context(max_prompt_len, max_new_tokens, carries), max_new_tokens,
                        sync_every)
