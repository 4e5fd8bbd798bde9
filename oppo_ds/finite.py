"""Stopping a run at the first NaN or inf, before anything is trained on it or saved.

A model that overflows (a reward model in fp16, an actor after too large an update) makes
NaN or inf that PPO spreads everywhere: one non-finite score whitens every advantage to NaN,
one NaN gradient makes every weight NaN, and the next checkpoint saves them. The trainer
checks each step's experience before the update (so the weights stay as they were) and the
update's losses and gradient norms after it (so no checkpoint holds what it did), and stops
on every rank alike with :class:`NonFiniteError` naming the quantity, the model it came from
and how many values. Megatron-LM stops the same way on a NaN loss or gradient; DeepSpeed's
ZeRO optimizers skip such an update in fp32 (and in fp16, where loss scaling expects it) and
go on, which would leave a run training on nothing, silently.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from . import comm


# the likely causes, as the messages name them
LARGE_UPDATE = ("when earlier steps were finite, an update too large (lower ppo.actor_lr / "
                "ppo.critic_lr, keep ppo.grad_clip on)")
FP16_RANGE = "system.dtype=bf16 keeps fp32's range"


class NonFiniteError(RuntimeError):
    """A model or an update produced NaN or inf; raised on every rank alike."""


def nonfinite_counts(x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(NaN count, inf count, count) of ``x`` where ``mask`` is set (everywhere without one),
    an int64 tensor on ``x``'s device (no host sync)."""
    keep = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
    return torch.stack([(torch.isnan(x) & keep).sum(), (torch.isinf(x) & keep).sum(), keep.sum()])


def largest_magnitude(x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> float:
    """The largest finite |value| of ``x`` where ``mask`` is set (0.0 for none)."""
    values = x[mask.bool()] if mask is not None else x.flatten()
    values = values[torch.isfinite(values)]
    return float(values.abs().max()) if values.numel() else 0.0


# what each checked field of a step's experience is, and the model (``model.`` key) it came from
EXPERIENCE_FIELDS = {
    "scores": ("reward", "scores"),
    "old_logprobs": ("actor", "log-probs"),
    "behaviour_logprobs": ("actor", "sampling log-probs"),
    "ref_logprobs": ("reference", "log-probs"),
    "old_values": ("critic", "values"),
}
DERIVED_FIELDS = ("rewards", "advantages", "returns")  # made from the fields above
MODEL_NAMES = {"actor": "the actor", "reference": "the reference model", "reward": "the reward model",
               "critic": "the critic"}


def _count_line(nan: int, inf: int, total: int, what: str, unit: str) -> str:
    """'nan scores for 3 of 8 responses'."""
    kinds = " and ".join(k for k, n in (("nan", nan), ("inf", inf)) if n)
    return f"{kinds} {what} for {nan + inf} of {total} {unit}"


def check_experience(exp, models: dict[str, str], dtype: str, group=None) -> None:
    """Raise :class:`NonFiniteError` on every rank of ``group`` when any rank's experience
    holds a NaN or inf: in a model's output (scores per sequence; log-probs and values per
    response token) or in the advantages and returns made from them. ``models``: each model's
    source under its ``model.`` key, for the message. One all-reduce of a few counts."""
    mask = exp.response_mask
    fields = list(EXPERIENCE_FIELDS) + [f for f in DERIVED_FIELDS if getattr(exp, f) is not None]
    counts = torch.stack([nonfinite_counts(v, None if v.dim() == 1 else mask)
                          for v in (getattr(exp, name) for name in fields)])
    counts = comm.all_reduce(counts.cpu(), group=group).tolist()
    bad = {name: c for name, c in zip(fields, counts) if c[0] or c[1]}
    if not bad:
        return
    lines = []
    for name, (nan, inf, total) in bad.items():
        if name in EXPERIENCE_FIELDS:
            key, what = EXPERIENCE_FIELDS[name]
            unit = "responses" if name == "scores" else "response tokens"
            lines.append(f"{MODEL_NAMES[key]} (model.{key}: {models[key]}) gave "
                         + _count_line(nan, inf, total, what, unit))
    if lines:
        hint = {"fp16": f"fp16 overflows easily ({FP16_RANGE}); else", "bf16": "bf16 keeps fp32's "
                "range, so look at the weights", "fp32": "fp32 rarely overflows, so look at the weights"}[dtype]
        raise NonFiniteError("; ".join(lines) + f". Nothing of this step was trained on. {hint}: a "
                             f"checkpoint that holds NaN or inf, or, {LARGE_UPDATE}")
    # the models' outputs are finite, their arithmetic in GAE and whitening is not
    largest = comm.all_reduce(torch.tensor([largest_magnitude(exp.scores),
                                            largest_magnitude(exp.old_values, mask)], dtype=torch.float64),
                              op=dist.ReduceOp.MAX, group=group).tolist()
    made = " and ".join(_count_line(*bad[name], name, "response tokens") for name in bad)
    kl = ("; the rewards add ppo.kl_coef times the per-token KL estimate, which ppo.kl_estimator "
          "k3 makes from exp(log-ratio) of reference and actor" if "rewards" in bad else "")
    raise NonFiniteError(
        f"{made}: every score, log-prob and value is finite, but the largest |score| is "
        f"{largest[0]:.3g} and the largest |value| {largest[1]:.3g}, beyond what fp32 holds "
        f"through GAE and whitening{kl}. Nothing of this step was trained on. A model whose "
        "outputs are that large needs its head rescaled (ppo.reward_clip bounds the scores, not "
        "the values)")


def check_update(metrics: dict, dtype: str) -> None:
    """Raise :class:`NonFiniteError` when the step's update gave a NaN or inf loss or gradient
    norm (``metrics``: the step's, already the same on every rank). In fp16 an inf gradient
    norm is loss scaling's business: DeepSpeed skips that update and lowers the scale."""
    keys = ["loss/policy", "loss/value"] + ([] if dtype == "fp16" else ["grad_norm/actor", "grad_norm/critic"])
    bad = [k for k in keys if metrics.get(k) is not None and not math.isfinite(metrics[k])]
    if bad:
        raise NonFiniteError(
            "the update gave " + ", ".join(f"{k}={metrics[k]}" for k in bad) + " from finite "
            "experience: no checkpoint holds the weights it made. Lower ppo.actor_lr / "
            "ppo.critic_lr or keep ppo.grad_clip on" + (f"; in fp16 a model's forward can "
            f"overflow: {FP16_RANGE}" if dtype == "fp16" else ""))
