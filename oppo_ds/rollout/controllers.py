"""Online control of OPPO's knobs. ``ChunkSizeController`` picks the streaming chunk size.

Chunk size trades two costs. Every hand-over to the scorers has a fixed cost (a forward
call, its launch and bookkeeping), so small chunks pay it often; the scorers cannot start on a
chunk before the actor has decoded it, so large chunks leave a long scoring tail after the
actor's last token. The cost model sets the actor's measured decode time per step against the
scorers' measured prefill time:

- the scorers' prefill of a chunk of ``t`` tokens takes ``a + b * t`` seconds per scorer
  (``fit_prefill_cost``, from two calibration steps at the smallest and the largest
  candidate);
- the actor decodes a step in ``d`` seconds and spends ``h`` seconds on each hand-over (both
  measured on its timeline), and the rows decode as many tokens as the calibration steps'
  rows did (``Pipeline.lengths``).

With the scorers running concurrently (``colocated``, ``stage``), ``overlapped_cost`` plays the
rollout through for each candidate: chunk ``k`` is handed over when the actor has decoded it,
the scorers take the chunks in order, and the cost of the candidate is the time from the end
of pure decoding (all steps at ``d``) to the end of the scoring: the hand-overs plus the
scoring tail, including any backlog when the scorers cannot keep up with small chunks. The
smallest wins. ``inline`` hides nothing (the scoring runs between chunks, in the actor's
time), so there the fewest hand-overs win: the largest candidate.

After choosing from the model the controller follows the paper's rule: every
``explore_every`` steps it tries each candidate for one step and keeps the fastest (seconds per
generated token of the rollout). Every decision is returned with its reason so the trainer
can log it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

QUANTILES = 8  # groups of rows in ``Pipeline.lengths``


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


@dataclass(frozen=True)
class Pipeline:
    """What a streamed rollout showed of the actor's side: ``decode_s`` seconds per decode
    step, ``handover_s`` seconds per hand-over, ``rows`` rows, and the tokens they decoded as
    ``QUANTILES`` values, each standing for ``rows / QUANTILES`` rows (``lengths``)."""
    decode_s: float
    handover_s: float
    rows: float
    lengths: tuple[float, ...]

    @classmethod
    def from_timing(cls, timing) -> Optional["Pipeline"]:
        """From a rollout's ``StreamTiming``; None when it decoded nothing."""
        tokens = sorted(timing.row_tokens)
        if not tokens or tokens[-1] <= 0:
            return None
        n = len(tokens)
        lengths = tuple(float(tokens[min(n - 1, int((i + 0.5) * n / QUANTILES))])
                        for i in range(QUANTILES - 1))
        return cls(decode_s=timing.chunk_decode_s / tokens[-1],
                   handover_s=timing.handover_s / max(timing.chunks - 1, 1),
                   rows=float(n), lengths=lengths + (float(tokens[-1]),))

    SIZE = 3 + QUANTILES  # len(as_list())

    def as_list(self) -> list[float]:
        """``SIZE`` numbers (for averaging over ranks and for checkpoints)."""
        return [self.decode_s, self.handover_s, self.rows, *self.lengths]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> "Pipeline":
        return cls(float(values[0]), float(values[1]), float(values[2]),
                   tuple(float(v) for v in values[3:]))


def overlapped_cost(chunk: int, pipe: Pipeline, call_s: float, token_s: float,
                    scorers: int) -> float:
    """Seconds that chunk size ``chunk`` adds to a rollout whose scorers run concurrently
    with decoding: from the end of pure decoding (every step at ``pipe.decode_s``) to the end
    of the scoring. Chunk k is handed over (``pipe.handover_s``) once the actor has decoded
    it; each of the ``scorers`` then prefills it in ``call_s + token_s * tokens`` seconds,
    taking the chunks in order."""
    steps = max(pipe.lengths)
    per_group = pipe.rows / len(pipe.lengths)
    now = done = 0.0  # the actor's clock; when the scorers finish the work handed to them
    start = 0
    while start < steps:
        end = min(start + chunk, steps)
        now += (end - start) * pipe.decode_s + pipe.handover_s
        tokens = per_group * sum(min(n, end) - min(n, start) for n in pipe.lengths)
        done = max(done, now) + scorers * (call_s + token_s * tokens)
        start = end
    return done - steps * pipe.decode_s


def model_chunk_size(a: float, b: float, pipe: Optional[Pipeline], scorers: int,
                     candidates: Sequence[int], overlapped: bool = True) -> tuple[int, dict]:
    """The candidate with the smallest ``overlapped_cost`` and the cost of each (seconds).
    Without overlap (the inline placement) nothing is hidden, so the fewest hand-overs win:
    the largest candidate (no costs)."""
    if not overlapped or pipe is None:
        return max(candidates), {}
    costs = {c: overlapped_cost(c, pipe, a, b, scorers) for c in candidates}
    return min(candidates, key=lambda c: (costs[c], -c)), costs


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
                scorer_tokens: float, scorer_busy_s: float, scorers: int = 1,
                pipeline: Optional[Pipeline] = None) -> Optional[str]:
        """Record a finished step that streamed with chunk size ``used``: its seconds per
        generated token, the scorers' calls, tokens and busy seconds (summed over the
        ``scorers``), and the actor's side of it (``Pipeline``; without it an overlapped
        placement is modelled as inline). Returns a message when a decision is made (to be
        logged), else None.

        A step whose scorers were never called (``scorer_calls`` 0: nothing was decoded, as
        when the rollout pool already held a whole batch of finished rows) measures no chunk
        size; a calibration or exploration step tries the same size again at the next."""
        self.step += 1
        if scorer_calls <= 0 and (self.chunk_size is None or self.exploring):
            return None
        if self.chunk_size is None:
            self.calibration.append((scorer_calls, scorer_tokens, scorer_busy_s, scorers,
                                     *(pipeline.as_list() if pipeline is not None else ())))
            if len(self.calibration) < 2 or len(self.candidates) == 1:
                if len(self.candidates) == 1:
                    self.chunk_size = self.candidates[0]
                return None
            return self._from_model()
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

    def _from_model(self) -> str:
        try:
            a, b = fit_prefill_cost([obs[:3] for obs in self.calibration])
        except ValueError:
            # both sizes cost as many calls per token (every response fit in one chunk of
            # either, e.g. generation.max_new_tokens at most the smallest candidate): no size
            # saves anything, so the fewest hand-overs win; exploration still measures them
            self.chunk_size = max(self.candidates)
            return (f"chunk_size={self.chunk_size}: the calibration steps with chunk sizes "
                    f"{self.candidates[0]} and {self.candidates[-1]} made the same number of "
                    "scorer calls per token, so the size changes nothing (the fewest hand-overs)")
        pipes = [Pipeline.from_list(obs[4:]) for obs in self.calibration if len(obs) > 4]
        pipe = None
        if len(pipes) == len(self.calibration):  # the calibration steps' mean
            pipe = Pipeline.from_list([sum(v) / len(pipes) for v in
                                       zip(*(p.as_list() for p in pipes))])
        last = self.calibration[-1]  # (calls, tokens, busy[, scorers, *pipeline])
        scorers = max(int(last[3]), 1) if len(last) > 3 else 1
        self.chunk_size, costs = model_chunk_size(a, b, pipe, scorers, self.candidates,
                                                  self.overlapped)
        text = (f"chunk_size={self.chunk_size} from the cost model: scorer prefill "
                f"{a * 1e3:.3f} ms/call + {b * 1e3:.4f} ms/token")
        if costs:
            detail = ", ".join(f"{c}: {t * 1e3:.1f}" for c, t in sorted(costs.items()))
            text += (f", actor decode {pipe.decode_s * 1e3:.3f} ms/step + hand-over "
                     f"{pipe.handover_s * 1e3:.3f} ms/chunk, {max(pipe.lengths):.0f} steps; "
                     f"predicted hand-overs + scoring tail (ms): {detail}")
        else:
            text += " (nothing overlaps: the fewest hand-overs)"
        return text

    def state_dict(self) -> dict:
        return {"candidates": list(self.candidates), "explore_every": self.explore_every,
                "chunk_size": self.chunk_size, "step": self.step,
                "calibration": [list(x) for x in self.calibration],
                "exploring": list(self.exploring), "trials": dict(self.trials)}

    def load_state_dict(self, state: dict) -> Optional[str]:
        """Continue from ``state``. The candidates and the exploration period stay this
        controller's own (the run's config): a checkpoint's would override a changed
        ``oppo.chunk_candidates`` silently. With other candidates the chosen size is decided
        again from the saved calibration, and an exploration round keeps only sizes still
        among them. Returns a message (to be logged) when the candidates changed."""
        self.step = state["step"]
        self.calibration = [tuple(x) for x in state["calibration"]]
        self.chunk_size = state["chunk_size"]
        self.exploring = [c for c in state["exploring"] if c in self.candidates]
        self.trials = {int(k): v for k, v in state["trials"].items() if int(k) in self.candidates}
        saved = tuple(state["candidates"])
        if saved == self.candidates:
            return None
        text = f"chunk size candidates {list(self.candidates)}, not the checkpoint's {list(saved)}"
        if self.chunk_size is not None and not self.exploring:  # decided: decide again
            self.trials = {}
            if len(self.calibration) >= 2:
                text += "; " + self._from_model()
            else:  # a single candidate was taken without calibrating
                self.chunk_size = self.candidates[-1]
                text += f"; chunk_size={self.chunk_size}"
        return text


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
    shrinks by ``step_size``, within ``[delta_min, delta_max]``. Starts at ``delta_max``.
    When the pool draws whole prompts of n responses (a group baseline), Delta moves in steps
    of n rows, and its bounds are multiples of n: a Delta between two multiples would start
    the same pool as the next multiple while the logs named the smaller number."""
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
        if self.delta_min % self.step_size or self.delta_max % self.step_size:
            raise ValueError(f"delta_min and delta_max must be multiples of step_size "
                             f"{self.step_size}, got {self.delta_min} and {self.delta_max}")
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

    def load_state_dict(self, state: dict) -> Optional[str]:
        """Continue from ``state`` within this controller's own bounds and window (the run's
        config: a checkpoint's Delta above a lowered ``oppo.delta_max`` would stay above it
        until the next window closed). Returns a message (to be logged) when Delta moved."""
        saved = int(state["delta"])
        self.delta = min(max(saved, self.delta_min), self.delta_max)
        self.delta -= self.delta % self.step_size  # stays >= delta_min, a multiple too
        self.rewards = list(state["rewards"])[-(self.window - 1):]
        if self.delta == saved:
            return None
        if not self.delta_min <= saved <= self.delta_max:
            return f"delta={self.delta}: the checkpoint's {saved} is outside [{self.delta_min}, {self.delta_max}]"
        return f"delta={self.delta}: the checkpoint's {saved} is not a multiple of {self.step_size}"
