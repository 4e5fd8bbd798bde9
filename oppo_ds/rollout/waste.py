"""Tail waste: the share of a rollout's decode slots spent on no token (rows that ended
waiting for the longest one). One formula for the trainer's sequential rollout, the pool's
rollout, the TRL peer's and oppo-bench's summaries."""
from __future__ import annotations

from typing import Optional


def idle_slots_frac(used: float, slots: float) -> float:
    """Share of ``slots`` decode slots not spent on a token (0 when nothing was decoded)."""
    return 1.0 - used / slots if slots > 0 else 0.0


def tail_waste(lengths: list[int], slots: Optional[int] = None) -> float:
    """Share of decode slots spent waiting for the longest response, for a batch that decodes
    every row until its longest one ends: 1 - sum(lengths) / (rows * max(lengths)); or
    against ``slots`` decoded when that is more (a decode that ran past a row's counted end)."""
    return idle_slots_frac(sum(lengths), max(slots or 0, len(lengths) * max(lengths, default=0)))
