"""Discrete-event simulation of PPO steps under the four schedules.

One *decode group* is the set of GPUs that decode together: one rank, or the
`inference_tp_size` ranks of a hybrid-engine tensor-parallel group, which decode their
tp x (B + Delta) rows as one batch. The simulator follows every row of every group through
the steps of a run:

  * rollout: one prefill of the running rows (prompt + what a deferred row already has, left-
    and right-padded as ``start_decode`` does), then decode steps. The events are the ends of
    rows and the chunk hand-overs; between two events the active set is fixed, the context
    grows by one token per row per step, and the sum of the steps' roofline times is
    computed exactly in closed form (``_sum_max_linear``).
  * streaming (intra, oppo): every `chunk_size` tokens each streamed scorer gets a prefill job
    for the new tokens. `inline`: the job runs on the actor's lane before it decodes on.
    `colocated`: the job runs on a second lane of the same device; it gets the compute the
    decode leaves and costs the decode the host time and memory traffic it takes. `stage`:
    the scorers have a device of their own, shared by every data-parallel rank (replica):
    each job takes as long as that many. The rollout ends when the actor and the scorer
    lane are both done (the scoring tail).
  * the rollout pool (inter, oppo): B + Delta rows per rank; decoding stops, for all groups
    together (the all-reduce of ``BatchStop``), once every group has B finished rows per rank
    and every forced row (deferred `max_defer_steps` times) ended; the first B are taken
    (forced first, then earlier-finished), the others are deferred with what they generated.
  * score: the actor's old log-probs (unless the actor streams: then only for rows that
    finished in an earlier step) and every scorer that did not stream, over the B taken
    rows in micro-batches padded to their longest row; train: actor and critic, forward +
    backward per micro-batch, an optimizer step per mini-batch, ZeRO's communication. Each
    group's first rank stands for the group; where the trainer's ranks agree on a number of
    micro-batches (``ppo.micro_batch_tokens``; ZeRO-3's scoring forwards), every simulated
    rank makes as many as the simulated rank that makes most, and a phase takes the slowest.

The sequential baseline is the pool with Delta = 0 and no streaming, as in the trainer.
Megatron (``CostModel(model_split=(tp, pp))``): a decode group is one model replica; FLOPs and
weight reads divide by tp but not by pp (the stages work in turn), and decode steps pay the
tensor all-reduces, the pipeline hand-overs and the logits broadcast.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..config import FROZEN_KINDS
from ..micro_batches import MicroBatches, collective_scorers
from .costs import Device
from .shapes import ModelShape, Shapes

MODES = ("sequential", "intra", "inter", "oppo")
TP_SYNC_S = 10e-6  # latency of one tensor-parallel all-reduce of a decode step's activations
PP_HOP_S = 20e-6   # latency of one pipeline hand-over (Megatron's simple schedule), assumed


@dataclass(frozen=True)
class LengthDist:
    """Response lengths: log-normal (``median``, ``sigma``) capped to [1, max_new], or drawn
    with replacement from ``values``, or at step k from ``per_step[k]`` (a measured run's
    lengths step by step: the policy's lengths drift as it trains)."""
    max_new: int
    median: float = 16.0
    sigma: float = 0.9
    values: Optional[tuple[int, ...]] = None
    per_step: Optional[tuple[tuple[int, ...], ...]] = None

    def sample(self, rng: np.random.Generator, n: int, step: int = 0) -> np.ndarray:
        if self.per_step:  # without replacement: a step's batch is that step's lengths
            values = np.asarray(self.per_step[min(step, len(self.per_step) - 1)])
            reps = -(-n // len(values)) if n else 0
            out = np.concatenate([rng.permutation(values) for _ in range(reps)] or [values[:0]])[:n]
        elif self.values:
            out = rng.choice(np.asarray(self.values), size=n)
        else:
            out = np.rint(np.exp(rng.normal(math.log(self.median), self.sigma, size=n)))
        return np.clip(out, 1, self.max_new).astype(np.int64)


@dataclass(frozen=True)
class Schedule:
    """One mode's settings."""
    name: str
    streamed: tuple[str, ...] = ()  # scorers prefilling during decode ("reward", "reference", "critic")
    placement: str = "inline"
    chunk: int = 16
    delta: int = 0
    actor_streams: bool = False  # old log-probs from the actor's decode, not a forward after it

    @property
    def critic_on_stage(self) -> bool:
        """The critic streams on the stage placement's scorer rank, a copy there that takes
        the trained weights before each rollout (``critic_to_stage_s``)."""
        return self.placement == "stage" and "critic" in self.streamed


@dataclass(frozen=True)
class Layout:
    """Per-rank PPO sizes and the parallel layout."""
    batch: int                  # B per rank
    micro: int
    mini: int
    epochs: int
    prompt_len: int
    max_defer: int = 2
    tp: int = 1                 # ranks per decode group (hybrid engine inference_tp_size)
    groups: int = 1             # decode groups simulated (data parallel)
    gpus: int = 1               # data-parallel ranks (ZeRO partitions over them)
    gpus_per_node: int = 1
    nodes: int = 1
    per_prompt: int = 1         # responses the pool takes together (a group baseline's n)
    micro_tokens: int | None = None  # the update's micro-batches by tokens (ppo.micro_batch_tokens)
    score_tokens: int | None = None  # the scoring forwards by tokens (ppo.score_batch_tokens)
    ptx_block: int = 0          # PPO-ptx: each row's pretraining block in the actor's update


@dataclass(frozen=True)
class Job:
    """A scorer prefill: host (launch) seconds, then max(compute, memory) seconds."""
    host: float
    compute: float
    memory: float

    @property
    def alone(self) -> float:
        return self.host + max(self.compute, self.memory)


def _sum_linear(a: float, b: float, k1: int, k2: int) -> float:
    """sum_{k=k1}^{k2-1} (a + b k)."""
    n = k2 - k1
    return n * a + b * (k2 * (k2 - 1) - k1 * (k1 - 1)) / 2 if n > 0 else 0.0


def _sum_max_linear(a: float, b: float, c: float, d: float, n: int) -> float:
    """sum_{k=0}^{n-1} max(a + b k, c + d k), exactly."""
    if n <= 0:
        return 0.0
    if b == d:
        return _sum_linear(a, b, 0, n) if a >= c else _sum_linear(c, d, 0, n)
    # a + b k >= c + d k  <=>  k >= (c - a) / (b - d) when b > d
    cross = (c - a) / (b - d)
    split = min(n, max(0, math.ceil(cross)))
    if b > d:  # the second line wins before the crossing
        return _sum_linear(c, d, 0, split) + _sum_linear(a, b, split, n)
    split = min(n, max(0, math.floor(cross) + 1))
    return _sum_linear(a, b, 0, split) + _sum_linear(c, d, split, n)


class CostModel:
    """Roofline costs of the step's operations for one shape set, device and layout."""

    def __init__(self, device: Device, shapes: Shapes, layout: Layout, *, dtype_bytes: int = 2,
                 zero_stage: int = 0, offload: bool = False, checkpointing: bool = False,
                 lora_only: bool = False, hybrid_engine: bool = False,
                 partition_reference: bool = False, offload_reference: bool = False,
                 lora_dims: Optional[dict[str, int]] = None, model_split: tuple[int, int] = (1, 1),
                 whole_scorers: frozenset = frozenset(), critic: bool = True,
                 reference: bool = True, reward: bool = True):
        """``model_split``: Megatron's (tensor, pipeline) sizes; one decode group is then one
        model replica and ``layout.gpus`` its data-parallel replicas. ``whole_scorers``: the
        kinds that run unsplit on the stage placement's scorer rank. ``critic``: False for a
        critic-free ``ppo.advantage_estimator`` (nothing scores or trains one); ``reference``:
        False with the KL off (``ppo.kl_coef`` 0: nothing scores one); ``reward``: False with
        ``model.reward_function`` (a rule on the text, whose cost is not modelled)."""
        self.dev, self.shapes, self.lay, self.w = device, shapes, layout, dtype_bytes
        self.mtp, self.mpp = model_split
        self.whole_scorers = frozenset(whole_scorers)
        self.zero_stage, self.offload, self.checkpointing = zero_stage, offload, checkpointing
        self.lora_only, self.hybrid_engine = lora_only, hybrid_engine
        self.partition_reference, self.offload_reference = partition_reference, offload_reference
        self.lora_dims = lora_dims or {}
        self.trained = ("actor", "critic") if critic else ("actor",)
        self.scorers = tuple(k for k in ("reference", "critic", "reward")
                             if (k != "critic" or critic) and (k != "reference" or reference)
                             and (k != "reward" or reward))
        n = layout.gpus
        self.net_bw = (device.inter_node_bw if layout.nodes > 1 else device.intra_node_bw) if n > 1 else 0.0
        # Megatron's pipeline stages: one node holds tp x pp ranks or the stages span nodes
        self.pp_bw = (device.intra_node_bw if self.mtp * self.mpp <= layout.gpus_per_node
                      else device.inter_node_bw)

    def _gather_s(self, params: int) -> float:
        """All-gather (or reduce-scatter) of one model's 16-bit weights over the ranks."""
        n = self.lay.gpus
        return self.w * params * (n - 1) / n / self.net_bw if n > 1 else 0.0

    # ---------------------------------------------------------------- decode

    def decode_overhead(self) -> float:
        a = self.shapes.actor
        tp_sync = 2 * a.layers * TP_SYNC_S if self.lay.tp * self.mtp > 1 else 0.0
        # the simple pipeline schedule: stages in turn, one hand-over between two stages
        return self.dev.decode_call_s + a.layers * self.dev.layer_s + tp_sync + \
            (self.mpp - 1) * PP_HOP_S

    def decode_interval(self, active: int, ctx_sum: float, steps: int) -> tuple[float, float]:
        """(seconds, compute seconds) of ``steps`` decode steps of ``active`` rows whose
        contexts add up to ``ctx_sum`` at the first step (one more token per row per step)."""
        if steps <= 0 or active <= 0:
            return 0.0, 0.0
        a, tp = self.shapes.actor, self.lay.tp * self.mtp
        per_row = 2 * a.matmul_params() / tp / self.dev.decode_flops
        per_ctx = 4 * a.layers * a.heads * a.head_dim / tp / self.dev.decode_flops
        weights = self.w * a.matmul_params() / tp / self.dev.bw
        kv = a.kv_bytes_per_token(self.w) / tp / self.dev.bw
        c0, c1 = active * per_row + ctx_sum * per_ctx, active * per_ctx
        m0, m1 = weights + ctx_sum * kv, active * kv
        roof = _sum_max_linear(c0, c1, m0, m1, steps)
        # pipeline: the last stage's fp32 logits broadcast to the other stages every token
        logits = steps * active * 4 * a.vocab / self.pp_bw if self.mpp > 1 else 0.0
        return steps * self.decode_overhead() + roof + logits, _sum_linear(c0, c1, 0, steps)

    # ---------------------------------------------------------------- forwards

    def _shape(self, kind: str) -> tuple[ModelShape, bool]:
        s = self.shapes
        return {"actor": (s.actor, False), "reference": (s.reference, False),
                "reward": (s.reward, True), "critic": (s.critic, True)}[kind]

    def prefill_job(self, kind: str, tokens: float, ctx_sum: float, calls: int = 1,
                    gathered: bool = False) -> Job:
        """``calls`` no-grad forwards of model ``kind`` over ``tokens`` tokens in all, whose
        attention contexts add up to ``ctx_sum``. ``gathered``: inside a rollout, where a
        ZeRO-3 model was gathered whole once (``rollout_fixed``) and its forwards gather
        nothing (the stage's critic is a whole copy anyway)."""
        shape, head = self._shape(kind)
        split = 1 if kind in self.whole_scorers else self.mtp  # pipeline stages work in turn
        flops = (tokens * 2 * shape.matmul_params(head)
                 + 4 * shape.layers * shape.heads * shape.head_dim * ctx_sum) / split
        memory = calls * self.w * shape.matmul_params(head) / self.dev.bw / split
        host = calls * (self.dev.prefill_call_s + shape.layers * self.dev.layer_s)
        if kind not in self.whole_scorers:
            host += calls * (self.mpp - 1) * PP_HOP_S
        if self.zero_stage == 3 and kind in ("actor", "critic") and not gathered:
            # ZeRO-3 gathers per forward
            memory = max(memory, calls * self._gather_s(shape.params(head)))
        if kind == "reference" and self.partition_reference:
            part = self.w * shape.params() / self.lay.gpus
            memory = max(memory, calls * self._gather_s(shape.params()))
            if self.offload_reference:
                host += calls * part / self.dev.host_link_bw
        return Job(host, flops / self.dev.prefill_flops, memory)

    def scored_forwards(self, kind: str, lengths: np.ndarray, calls: Optional[int] = None,
                        filler: int = 1, split: Optional[MicroBatches] = None) -> float:
        """No-grad forwards over ``lengths`` rows in micro-batches (``split``, by default
        ``score_split``'s), each trimmed to its longest. ``calls``: make that many in all (a
        collective forward, as many on every rank), the micro-batches split further to as
        many (``MicroBatches.at_least``) and those past them on one row of ``filler`` response
        tokens (the trainer's filler: its batch's first row)."""
        groups = (split if split is not None else self.score_split(lengths)).at_least(calls)
        tokens = ctx = 0.0
        for g in groups:
            t, c, _ = _micro_tokens(lengths[g], len(g), self.lay.prompt_len)
            tokens, ctx = tokens + t, ctx + c
        extra = max(0, (calls or 0) - len(groups))
        if extra:
            t, c, _ = _micro_tokens(np.array([filler]), 1, self.lay.prompt_len)
            tokens, ctx = tokens + extra * t, ctx + extra * c
        if not groups and not extra:
            return 0.0
        return self.prefill_job(kind, tokens, ctx, len(groups) + extra).alone

    def score_split(self, lengths: np.ndarray) -> MicroBatches:
        """The scoring micro-batches of rows of response ``lengths`` (positions), as the
        trainer's ``Scoring._score_split`` makes them: ppo.micro_batch_size rows in order, or
        under ppo.score_batch_tokens the split by tokens."""
        lay, n = self.lay, len(lengths)
        if lay.score_tokens is None:
            return MicroBatches.fixed(n, lay.micro)
        return MicroBatches.by_tokens([lay.prompt_len] * n, [int(x) for x in lengths],
                                      lay.score_tokens, False)

    def collective_scorers(self) -> tuple[str, ...]:
        """The kinds whose scoring forwards are collectives, so that every data-parallel rank
        makes as many (the trainer's ``Scoring._agreed_calls``): under ZeRO-3 on more than one
        rank the actor, the critic and a partitioned reference."""
        return collective_scorers(self.zero_stage, self.lay.gpus, self.partition_reference)

    # ---------------------------------------------------------------- training

    def _train_model(self, kind: str, batches: list[np.ndarray]) -> float:
        shape, head = self._shape(kind)
        lay, dev = self.lay, self.dev
        # forward 1, backward 2 (activation and weight gradients); LoRA-only skips the base
        # weights' gradients; checkpointing recomputes the forward
        mult = (2 if self.lora_only and self.lora_dims.get(kind) else 3) + (1 if self.checkpointing else 0)
        params = shape.params(head)
        ptx = lay.ptx_block if kind == "actor" else 0  # PPO-ptx: a second forward, of blocks
        total = 0.0
        for mb in batches:
            tokens, ctx, _ = _micro_tokens(mb, len(mb), lay.prompt_len)
            tokens, ctx = tokens + len(mb) * ptx, ctx + len(mb) * ptx * (ptx + 1) / 2
            flops = mult * (tokens * 2 * shape.matmul_params(head)
                            + 4 * shape.layers * shape.heads * shape.head_dim * ctx) / self.mtp
            # ZeRO-3 gathers the weights for each forward and the backward
            comm = (3 + bool(ptx)) * self._gather_s(params) if self.zero_stage == 3 else 0.0
            if self.zero_stage == 3 and self.offload:
                comm += 2 * self.w * params / lay.gpus / dev.host_link_bw
            total += (dev.train_call_s + 2 * shape.layers * dev.layer_s * (2 if ptx else 1)
                      + max(flops / dev.train_flops, comm))
        return total

    def _optimizer_step(self, kind: str) -> float:
        shape, head = self._shape(kind)
        dev, n = self.dev, self.lay.gpus
        params = shape.params(head)
        lora = self.lora_dims.get(kind, 0)
        trainable = shape.lora_params(lora) + (shape.hidden if head else 0) if self.lora_only and lora else params
        part = trainable / (n if self.zero_stage >= 1 else 1) / (self.mtp * self.mpp)
        t = dev.optim_s
        if self.offload:
            t += 2 * self.w * part / dev.host_link_bw + part * self.lay.gpus_per_node / dev.cpu_adam_params_s
        else:
            t += 28 * part / dev.bw  # read master, grads, moments; write master, moments
        if self.zero_stage < 3:  # gradient reduction (+ the updated weights' all-gather)
            t += 2 * self._gather_s(trainable / (self.mtp * self.mpp))
        return t

    def train_phase(self, ranks: list[np.ndarray], rng: np.random.Generator) -> float:
        """PPO update of actor and critic on each simulated rank's B rows' response lengths:
        the slowest rank's seconds. Under ppo.micro_batch_tokens every rank makes as many
        micro-batches of a mini-batch as the simulated rank that needs most (the trainer's
        agreement; ranks past the simulated ones are not counted)."""
        lay = self.lay
        minis = []  # per rank, its mini-batches over the epochs
        for lengths in ranks:
            mine = []
            for _ in range(lay.epochs):
                order = rng.permutation(len(lengths))
                mine += [lengths[order[i:i + lay.mini]] for i in range(0, len(order), lay.mini)]
            minis.append(mine)
        totals = [0.0] * len(ranks)
        for j in range(len(minis[0]) if minis else 0):
            splits = [self._micro_batch_split(m[j]) for m in minis]
            count = max(len(s.groups) for s in splits)
            for r, (m, split) in enumerate(zip(minis, splits)):
                micros = [m[j][g] for g in split.at_least(count)]
                for kind in self.trained:
                    totals[r] += self._train_model(kind, micros) + self._optimizer_step(kind)
        return max(totals, default=0.0)

    def _micro_batch_split(self, lengths: np.ndarray) -> MicroBatches:
        """A mini-batch's rows (positions in ``lengths``) in the update's micro-batches:
        ``micro`` each, or within ``micro_tokens`` positions of prompts padded to
        ``prompt_len`` and each row's PPO-ptx block (``MicroBatches.by_tokens``)."""
        lay = self.lay
        if lay.micro_tokens is None:
            return MicroBatches.fixed(len(lengths), lay.micro)
        return MicroBatches.by_tokens([lay.prompt_len] * len(lengths), [int(x) for x in lengths],
                                      lay.micro_tokens, False, extra_per_row=lay.ptx_block)

    def critic_to_stage_s(self) -> float:
        """The stage placement's critic weights before a rollout: gathered whole on the
        sending rank (ZeRO-3 over the ranks; a Megatron replica's shards over its
        model-parallel links), then sent to the scorer rank's copy, on the node. A Megatron
        critic (an HF copy on the scorer rank: in ``whole_scorers``) is gathered into rank
        0's host memory and converted there (``MegatronModel.to_hf``), so its bytes cross
        that rank's host link twice, out and back for the send; the conversion's own host
        work is not charged (docs/megatron.md measures it)."""
        critic = self.shapes.critic.params(value_head=True)
        size, mp = self.w * critic, self.mtp * self.mpp
        if self.zero_stage == 3:
            gather = self._gather_s(critic)
        else:
            gather = size * (mp - 1) / mp / self.pp_bw if mp > 1 else 0.0
        if "critic" in self.whole_scorers:
            gather += 2 * size / self.dev.host_link_bw
        return gather + size / self.dev.intra_node_bw

    def rollout_fixed(self, streamed_critic: bool = False) -> float:
        """Per-rollout costs outside decoding: the host's setup and, under ZeRO-3, the actor
        gathered whole for the rollout (the trainer's generation context, with or without the
        hybrid engine), and the critic too where it streams on the actor ranks."""
        gather = 0.0
        if self.zero_stage == 3:
            gather = self._gather_s(self.shapes.actor.params())
            if streamed_critic:
                gather += self._gather_s(self.shapes.critic.params(value_head=True))
        return self.dev.rollout_setup_s + gather


def _micro_tokens(lengths: np.ndarray, micro: int, prompt_len: int) -> tuple[float, float, int]:
    """(padded tokens, summed attention context, calls) of forwards over ``lengths`` rows in
    micro-batches of ``micro``, each padded to its longest row."""
    tokens = ctx = 0.0
    calls = 0
    for i in range(0, len(lengths), micro):
        mb = lengths[i:i + micro]
        width = prompt_len + int(mb.max())
        tokens += len(mb) * width
        ctx += len(mb) * width * (width + 1) / 2
        calls += 1
    return tokens, ctx, calls


@dataclass
class StepResult:
    step_s: float
    phases: dict[str, float]
    tail_waste: float
    scoring_busy_s: float
    scoring_tail_s: float


@dataclass
class SimResult:
    schedule: Schedule
    steps: list[StepResult] = field(default_factory=list)

    def mean(self, key: str) -> float:
        vals = [s.step_s if key == "step_s" else s.phases.get(key, getattr(s, key, 0.0))
                for s in self.steps]
        return float(np.mean(vals)) if vals else 0.0

    def to_json(self) -> dict:
        phases = sorted({k for s in self.steps for k in s.phases})
        busy = self.mean("scoring_busy_s")
        return {"step_s": round(self.mean("step_s"), 6),
                "phases_s": {k: round(self.mean(k), 6) for k in phases},
                "tail_waste_frac": round(self.mean("tail_waste"), 4),
                "scoring_hidden_frac": round(1 - self.mean("scoring_tail_s") / busy, 4) if busy else 0.0,
                "chunk_size": self.schedule.chunk if self.schedule.streamed else None,
                "delta": self.schedule.delta}


class _Group:
    """The rows of one decode group: total lengths, tokens done, deferrals, finished flag."""

    def __init__(self):
        self.total = np.zeros(0, np.int64)
        self.done = np.zeros(0, np.int64)
        self.defer = np.zeros(0, np.int64)
        self.finished = np.zeros(0, bool)
        self.streamed_by_frozen = np.zeros(0, bool)  # reward/reference hold this row's cache
        self.prompt = np.zeros(0, np.int64)  # rows with one label answer one draw of a prompt
        self.prompts = 0

    def top_up(self, size: int, dist: LengthDist, rng: np.random.Generator, step: int,
               per_prompt: int = 1) -> int:
        new = -(-max(0, size - len(self.total)) // per_prompt) * per_prompt  # whole prompts
        self.prompt = np.concatenate([self.prompt, self.prompts + np.arange(new) // per_prompt])
        self.prompts += new // per_prompt
        self.total = np.concatenate([self.total, dist.sample(rng, new, step)])
        self.done = np.concatenate([self.done, np.zeros(new, np.int64)])
        self.defer = np.concatenate([self.defer, np.zeros(new, np.int64)])
        self.finished = np.concatenate([self.finished, np.zeros(new, bool)])
        self.streamed_by_frozen = np.concatenate([self.streamed_by_frozen, np.zeros(new, bool)])
        return new

    def keep(self, mask: np.ndarray) -> None:
        for name in ("total", "done", "defer", "finished", "streamed_by_frozen", "prompt"):
            setattr(self, name, getattr(self, name)[mask])


def _prompt_max(prompt: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's prompt as an index 0..P-1, and the largest of ``values`` (>= 0) over each
    prompt's rows."""
    _, index = np.unique(prompt, return_inverse=True)
    out = np.zeros(index.max() + 1 if index.size else 0, np.asarray(values).dtype)
    np.maximum.at(out, index, values)
    return index, out


class StepSimulator:
    """Runs ``steps`` PPO steps of one schedule and keeps every step's times."""

    def __init__(self, costs: CostModel, dist: LengthDist):
        self.costs, self.dist, self.lay = costs, dist, costs.lay

    def stop_token(self, g: _Group, need: int) -> int:
        """Decode steps after which group ``g`` has ``need`` finished rows and its forced rows ended."""
        running = ~g.finished
        rem = (g.total - g.done)[running]
        if len(rem) == 0:
            return 0
        if self.lay.per_prompt == 1:
            k = need - int(g.finished.sum())
            n = int(np.sort(rem)[k - 1]) if k > 0 else 0
        else:  # whole prompts: a prompt is done when its last response is
            _, left = _prompt_max(g.prompt, np.where(g.finished, 0, g.total - g.done))
            k = need // self.lay.per_prompt - int((left == 0).sum())
            n = int(np.sort(left[left > 0])[k - 1]) if k > 0 else 0
        forced = (g.defer[running] >= self.lay.max_defer)
        if forced.any():
            n = max(n, int(rem[forced].max()))
        return min(n, int(rem.max()))

    def rollout(self, g: _Group, n_stop: int, sched: Schedule) -> tuple[float, float, float, float]:
        """(rollout seconds, scorer busy seconds, scoring tail seconds, tail waste) of one
        group decoding its running rows for ``n_stop`` steps."""
        c, lay = self.costs, self.lay
        running = ~g.finished
        rem = (g.total - g.done)[running]
        ctx0 = lay.prompt_len + g.done[running]
        if len(rem) == 0:
            return 0.0, 0.0, 0.0, 0.0
        # one padded prefill of prompt + partial response for every running row
        width = lay.prompt_len + int(g.done[running].max())
        critic_here = "critic" in sched.streamed and not sched.critic_on_stage
        t = c.rollout_fixed(critic_here) + c.prefill_job(
            "actor", len(rem) * width / lay.tp, len(rem) * width * (width + 1) / 2 / lay.tp,
            gathered=True).alone
        if sched.critic_on_stage:
            t += c.critic_to_stage_s()  # the updated critic to the scorer rank's copy
        jobs: list[tuple[float, Job]] = []  # (ready time, job) on the scorer lane
        inline_busy = 0.0

        def submit(kinds: Sequence[str], tokens: float, ctx_sum: float) -> float:
            """Hand ``tokens`` (of the whole group) to the scorers; returns the time the actor
            loses to it: all of the work inline, the host time and memory traffic colocated."""
            nonlocal inline_busy
            lost = 0.0
            if tokens <= 0:
                return lost
            for kind in kinds:
                job = c.prefill_job(kind, tokens / lay.tp, ctx_sum / lay.tp, gathered=True)
                if sched.placement == "inline":
                    lost += job.alone
                    inline_busy += job.alone
                else:
                    jobs.append((t + lost, job))
                    if sched.placement == "colocated":
                        lost += job.host + job.memory
            return lost

        if sched.streamed:
            widths = ctx0.astype(float)
            again = (float(widths.sum()), float((widths * (widths + 1) / 2).sum()))
            frozen = [k for k in sched.streamed if k in FROZEN_KINDS]
            # the frozen scorers (on the scorer rank too) hold the deferred rows: new rows only
            new = int((~g.streamed_by_frozen[running]).sum())
            t += submit(frozen, lay.prompt_len * new, lay.prompt_len * (lay.prompt_len + 1) / 2 * new)
            if "critic" in sched.streamed:  # the critic trains: it prefills every running row anew
                t += submit(["critic"], *again)
        points = {int(x) for x in rem if x < n_stop} | {n_stop}
        if sched.streamed:
            points |= set(range(sched.chunk, n_stop, sched.chunk))
        # rows sorted by length: the active ones at step k are a suffix, their contexts a suffix sum
        order = np.argsort(rem, kind="stable")
        rem_sorted = rem[order]
        ctx_suffix = np.concatenate([np.cumsum(ctx0[order][::-1])[::-1], [0]]).tolist()
        n_rows = len(rem)
        last, compute_used, decode_time, actor_end = 0, 0.0, 0.0, 0.0
        for point in sorted(points):
            first = int(np.searchsorted(rem_sorted, last, side="right"))
            active = n_rows - first
            dt, dc = c.decode_interval(active, ctx_suffix[first] + active * last, point - last)
            t += dt
            decode_time += dt
            compute_used += dc
            actor_end = t
            if sched.streamed and (point % sched.chunk == 0 or point == n_stop):
                start = point - ((point - 1) % sched.chunk + 1)
                made = np.clip(np.minimum(rem, point) - start, 0, None)
                ctx_sum = float((made * (ctx0 + start) + made * (made + 1) / 2).sum())
                t += submit(sched.streamed, float(made.sum()), ctx_sum)
            last = point
        # inline: the last chunk's prefill is the scoring tail; lanes: what is still queued
        end, busy = t, inline_busy
        if sched.placement != "inline":
            util = min(1.0, compute_used / decode_time) if decode_time > 0 else 0.0
            slow = 1.0 + util if sched.placement == "colocated" else 1.0
            # stage: one scorer rank serves every rank's (every replica's) chunks, one message
            # at a time as they arrive, and the ranks hand over in lock-step: each job waits
            # for the others' of the same hand-over
            shared = lay.gpus if sched.placement == "stage" else 1
            lane = 0.0
            for ready, job in jobs:
                dur = shared * (job.host + max(job.compute * slow, job.memory))
                lane = max(lane, ready) + dur
                busy += dur
            end = max(t, lane)
        produced = np.minimum(rem, n_stop)
        waste = 1.0 - produced.sum() / (len(rem) * produced.max()) if produced.max() else 0.0
        return end, busy, end - actor_end, float(waste)

    def run(self, sched: Schedule, steps: int = 30, warmup: int = 4, seed: int = 0) -> SimResult:
        lay, c = self.lay, self.costs
        warmup = min(warmup, steps - 1)  # keep at least one step
        rng = np.random.default_rng(seed)
        groups = [_Group() for _ in range(lay.groups)]
        size, need = lay.tp * (lay.batch + sched.delta), lay.tp * lay.batch
        result = SimResult(sched)
        for step in range(steps):
            for g in groups:
                g.top_up(size, self.dist, rng, step, lay.per_prompt)
            n_stop = max(self.stop_token(g, need) for g in groups)  # lock-step stop over ranks
            outs = [self.rollout(g, n_stop, sched) for g in groups]
            ranks = []  # one rank's share of each group's rows, and which need rescoring
            for g in groups:
                taken, rescore = self._advance(g, n_stop, need, sched)
                ranks.append((taken[:lay.batch], rescore[:lay.batch]))
            score = self._score(ranks, sched)
            train = c.train_phase([lengths for lengths, _ in ranks], rng)
            generate = max(o[0] for o in outs)
            phases = {"generate": generate, "score": score, "other": c.dev.step_other_s, "train": train}
            if step >= warmup:
                result.steps.append(StepResult(sum(phases.values()), phases,
                                               float(np.mean([o[3] for o in outs])),
                                               float(np.mean([o[1] for o in outs])),
                                               float(np.mean([o[2] for o in outs]))))
        return result

    def _advance(self, g: _Group, n_stop: int, need: int, sched: Schedule):
        """Write the rollout back and take the first ``need`` finished rows: returns their
        lengths (shuffled rank order is irrelevant) and which of them need the critic scored
        after the rollout (finished in an earlier step: the critic's values went stale)."""
        running = ~g.finished
        rem = g.total - g.done
        ended = running & (rem <= n_stop)
        waiting_before = g.finished.copy()
        g.done = np.where(running, g.done + np.minimum(rem, n_stop), g.done)
        g.finished = g.finished | ended
        if sched.streamed:
            g.streamed_by_frozen = np.ones_like(g.streamed_by_frozen)
        forced = g.defer >= self.lay.max_defer
        # forced first, then rows that were already waiting, then in the order they ended
        key = np.where(g.finished, 0, 1) * 4 + np.where(forced, 0, 2) + np.where(waiting_before, 0, 1)
        if self.lay.per_prompt == 1:
            take = np.lexsort((rem, key))[:need]
        else:  # whole prompts, ranked by their worst row, then by their last row to end
            index, worst = _prompt_max(g.prompt, key)
            chosen = np.lexsort((_prompt_max(g.prompt, rem)[1], worst))[:need // self.lay.per_prompt]
            take = np.flatnonzero(np.isin(index, chosen))
        assert g.finished[take].all(), "the stop rule left fewer than B finished rows"
        lengths = g.total[take].copy()
        rescore = waiting_before[take]
        keep = np.ones(len(g.total), bool)
        keep[take] = False
        g.keep(keep)
        g.defer += 1
        return lengths, rescore

    def _score(self, ranks: list[tuple[np.ndarray, np.ndarray]], sched: Schedule) -> float:
        """The scoring phase on each simulated rank (its rows' lengths, which need rescoring):
        the slowest rank's seconds, collective forwards made as many times on every rank as
        on the simulated rank that makes most."""
        c = self.costs
        scored = []
        for lengths, rescore in ranks:
            # a streaming actor scored its tokens as it decoded them, except rows that
            # finished in an earlier step (the update since then made those log-probs stale)
            kinds = {"actor": lengths[rescore] if sched.actor_streams else lengths}
            for kind in c.scorers:
                if kind not in sched.streamed:
                    kinds[kind] = lengths
                elif kind == "critic" and sched.delta:
                    kinds[kind] = lengths[rescore]
            scored.append(kinds)
        splits = [{kind: c.score_split(rows) for kind, rows in kinds.items()} for kinds in scored]
        calls = {kind: max(len(s[kind].groups) for s in splits)
                 for kind in c.collective_scorers() if kind in scored[0]}
        # the trainer's filler: its batch's first row
        return max(sum(c.scored_forwards(kind, rows, calls.get(kind), filler=int(lengths[0]),
                                         split=split[kind])
                       for kind, rows in kinds.items())
                   for kinds, split, (lengths, _) in zip(scored, splits, ranks))
