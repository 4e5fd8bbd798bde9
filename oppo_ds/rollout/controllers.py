"""Online control of OPPO's knobs. ``ChunkSizeController`` picks the streaming chunk size.

Chunk size trades two costs. Every hand-over to the scorers has a fixed cost (a forward
call, its launch and bookkeeping), so small chunks pay it often; the last chunk's prefill is
left after the actor's final token, so large chunks leave a long scoring tail. With a scorer
prefill of ``a + b * c`` seconds for a chunk of ``c`` tokens and responses of ``L`` tokens, the
hand-over cost ``(L / c) * a`` plus the tail ``a + b * c`` is smallest at ``c* = sqrt(L a / b)``.

The controller starts from that cost model, fitted to the scorer timings of two calibration
steps (at the smallest and the largest candidate), and then follows the paper's rule: every ``explore_every`` steps it tries each
candidate for one step and keeps the fastest (seconds per generated token of the rollout).
Every decision is returned with its reason so the trainer can log it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence


def fit_prefill_cost(observations: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Fit ``busy = a * calls + b * tokens`` by least squares over steps, each observed as
    (scorer calls, tokens prefilled, scorer busy seconds); returns (a, b) clamped at >= 0
    (a negative cost is noise). Needs steps that used different chunk sizes."""
    sxx = sum(c * c for c, _, _ in observations)
    syy = sum(t * t for _, t, _ in observations)
    sxy = sum(c * t for c, t, _ in observations)
    sxz = sum(c * z for c, _, z in observations)
    syz = sum(t * z for _, t, z in observations)
    det = sxx * syy - sxy * sxy
    if det <= 1e-12 * max(sxx * syy, 1e-30):
        raise ValueError("the observations do not separate per-call from per-token cost: "
                         "measure at least two different chunk sizes")
    a = (sxz * syy - syz * sxy) / det
    b = (syz * sxx - sxz * sxy) / det
    return max(a, 0.0), max(b, 0.0)


def model_chunk_size(a: float, b: float, response_len: float, candidates: Sequence[int],
                     overlapped: bool = True) -> int:
    """The candidate nearest (in log scale) to ``sqrt(L a / b)``. Without overlap (the inline
    placement) no scoring is hidden, so the fewest hand-overs win: the largest candidate."""
    if b <= 0 or not overlapped:
        return max(candidates)  # prefill cost does not grow with the chunk: fewest hand-overs
    if a <= 0:
        return min(candidates)
    best = math.sqrt(response_len * a / b)
    return min(candidates, key=lambda c: abs(math.log(c) - math.log(best)))


@dataclass
class ChunkSizeController:
    candidates: tuple[int, ...] = (4, 8, 16, 32, 64)
    explore_every: int = 50
    overlapped: bool = True            # scorers run concurrently with decoding (not inline)
    chunk_size: Optional[int] = None   # None while calibrating
    step: int = 0
    calibration: list = field(default_factory=list)  # (calls, tokens, busy_s) per calibration step
    exploring: list = field(default_factory=list)    # candidates still to try in this round
    trials: dict = field(default_factory=dict)       # candidate -> seconds per token, this round

    def __post_init__(self):
        if not self.candidates or any(c < 1 for c in self.candidates):
            raise ValueError(f"chunk size candidates must be >= 1, got {self.candidates}")
        self.candidates = tuple(sorted(set(self.candidates)))

    def next_chunk_size(self) -> int:
        """The chunk size the coming step should use."""
        if self.chunk_size is None:  # calibrate at the two ends of the range
            return self.candidates[0] if not self.calibration else self.candidates[-1]
        return self.exploring[0] if self.exploring else self.chunk_size

    def observe(self, used: int, seconds_per_token: float, scorer_calls: float,
                scorer_tokens: float, scorer_busy_s: float, response_len: float) -> Optional[str]:
        """Record a finished step that streamed with chunk size ``used``. Returns a message
        when a decision is made (to be logged), else None."""
        self.step += 1
        if self.chunk_size is None:
            self.calibration.append((scorer_calls, scorer_tokens, scorer_busy_s))
            if len(self.calibration) < 2 or len(self.candidates) == 1:
                if len(self.candidates) == 1:
                    self.chunk_size = self.candidates[0]
                return None
            a, b = fit_prefill_cost(self.calibration)
            self.chunk_size = model_chunk_size(a, b, response_len, self.candidates, self.overlapped)
            return (f"chunk_size={self.chunk_size} from the cost model: scorer prefill "
                    f"{a * 1e3:.3f} ms/call + {b * 1e3:.4f} ms/token, responses ~{response_len:.0f} tokens")
        if self.exploring and used == self.exploring[0]:
            self.trials[used] = seconds_per_token
            self.exploring.pop(0)
            if self.exploring:
                return None
            best = min(self.trials, key=self.trials.get)
            detail = ", ".join(f"{c}: {s * 1e3:.3f}" for c, s in sorted(self.trials.items()))
            previous, self.chunk_size, self.trials = self.chunk_size, best, {}
            return f"chunk_size={best} after exploring (ms per token: {detail}; was {previous})"
        if self.explore_every and self.step % self.explore_every == 0:
            self.exploring = list(self.candidates)
            return f"exploring chunk sizes {list(self.candidates)} over the next {len(self.candidates)} steps"
        return None

    def state_dict(self) -> dict:
        return {"candidates": list(self.candidates), "explore_every": self.explore_every,
                "chunk_size": self.chunk_size, "step": self.step,
                "calibration": [list(x) for x in self.calibration],
                "exploring": list(self.exploring), "trials": dict(self.trials)}

    def load_state_dict(self, state: dict) -> None:
        self.candidates = tuple(state["candidates"])
        self.explore_every = state["explore_every"]
        self.chunk_size = state["chunk_size"]
        self.step = state["step"]
        self.calibration = [tuple(x) for x in state["calibration"]]
        self.exploring = list(state["exploring"])
        self.trials = {int(k): v for k, v in state["trials"].items()}


def slope(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` against their index (per step)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"a slope needs at least 2 values, got {n}")
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    sxy = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    sxx = sum((i - mean_x) ** 2 for i in range(n))
    return sxy / sxx


@dataclass
class DeltaController:
    """The overcommitment degree Delta, from the trend of the mean reward (the paper's rule).

    Early in training the reward climbs and the policy moves fast, and overcommitting pays:
    the long tail is cut and the slight staleness of deferred tokens costs little. As training
    converges the reward flattens, and Delta shrinks toward ``delta_min`` so the final policy is
    trained on-policy. Every ``window`` steps the least-squares slope of the per-step mean
    reward over those steps decides: above ``tolerance`` Delta grows by ``step_size``, else it
    shrinks by ``step_size``, within ``[delta_min, delta_max]``. Starts at ``delta_max``."""
    delta_min: int = 0
    delta_max: int = 8
    window: int = 10
    step_size: int = 1
    tolerance: float = 0.0
    delta: Optional[int] = None
    rewards: list = field(default_factory=list)  # mean reward of the steps of this window

    def __post_init__(self):
        if not 0 <= self.delta_min <= self.delta_max:
            raise ValueError(f"need 0 <= delta_min <= delta_max, got {self.delta_min}, {self.delta_max}")
        if self.window < 2 or self.step_size < 1:
            raise ValueError(f"window must be >= 2 and step_size >= 1, got {self.window}, {self.step_size}")
        if self.delta is None:
            self.delta = self.delta_max

    def observe(self, mean_reward: float) -> Optional[str]:
        """Record a step's mean reward. Returns a message when a window closes (to be
        logged), else None; ``delta`` is then the next steps' Delta."""
        self.rewards.append(float(mean_reward))
        if len(self.rewards) < self.window:
            return None
        trend, previous = slope(self.rewards), self.delta
        self.rewards = []
        if trend > self.tolerance:
            self.delta = min(self.delta + self.step_size, self.delta_max)
        else:
            self.delta = max(self.delta - self.step_size, self.delta_min)
        word = "rising" if trend > self.tolerance else "flat or falling"
        return f"delta={self.delta} (was {previous}): reward {word}, slope {trend:+.4f}/step over {self.window} steps"

    def state_dict(self) -> dict:
        return {"delta": self.delta, "rewards": list(self.rewards)}

    def load_state_dict(self, state: dict) -> None:
        self.delta = int(state["delta"])
        self.rewards = list(state["rewards"])
