"""The training-engine interface that every backend implements.

A PPO step needs four things from an engine that trains a model (actor or critic):
one optimizer update over a mini-batch with a caller-supplied loss, a no-grad forward for
old log-probs / values, a decoding context with a KV cache for the rollout, and checkpoints.
The DeepSpeed engine (``deepspeed_engine.py``) and, later, a Megatron-core engine implement
exactly this, so the trainer never touches a backend's API.

Nothing here imports deepspeed or megatron.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch

ModelCallable = Callable[..., Any]
"""What a loss function calls for the forward: the backend's wrapped model (for DeepSpeed
the engine object, so its ZeRO hooks and autocast run), called with keyword tensors, e.g.
``model(input_ids=..., attention_mask=...)``; it returns what the HF module returns."""

LossFn = Callable[[ModelCallable, Any], "tuple[torch.Tensor, dict]"]
"""``loss_fn(model, micro_batch) -> (loss, stats)``: ``loss`` is the scalar mean over the
micro-batch (the engine divides by the number of micro-batches); ``stats`` is returned to
the caller untouched (tensors may stay on the device: no ``.item()`` is forced here)."""

SCHEDULERS = ("constant", "linear", "cosine")


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, scheduler: str) -> float:
    """Factor on the peak learning rate for the optimizer update number ``step`` (0-based).

    Linear warmup over ``warmup_steps`` updates (update 0 uses ``1 / warmup_steps``, update
    ``warmup_steps - 1`` the full rate, so no update is wasted at rate 0), then
    "constant" keeps 1, "linear" decays to 0 at ``total_steps``, "cosine" follows half a
    cosine to 0 at ``total_steps``. Steps past ``total_steps`` stay at the final value.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if scheduler == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if scheduler == "linear":
        return 1.0 - progress
    if scheduler == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"scheduler must be one of {list(SCHEDULERS)}, got {scheduler!r}")


def check_schedule(*, warmup_steps: int, total_steps: int, scheduler: str) -> None:
    """Raise ``ValueError`` for a schedule :func:`lr_multiplier` cannot follow."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {list(SCHEDULERS)}, got {scheduler!r}")
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be an integer >= 1, got {total_steps!r}")
    if (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int)
            or not 0 <= warmup_steps <= total_steps):
        raise ValueError(f"warmup_steps must be an integer in [0, total_steps={total_steps}], "
                         f"got {warmup_steps!r}")


def reapply_hyperparameters(param_groups: list[dict], scheduler, lr: float,
                            group_decay: list[float], betas: tuple[float, float], eps: float,
                            group_lrs: Optional[list[float]] = None) -> dict[str, tuple]:
    """After loading an optimizer and its LambdaLR from a checkpoint, put back the peak
    learning rate ``lr`` (``group_lrs``: each group's, where they differ, as a LoRA group's
    does), each group's weight decay, and Adam's ``betas`` and ``eps`` this run
    was configured with: the saved state dicts carry the values the checkpoint was written
    with, which would win silently (a resume told to lower the learning rate kept the old one).
    The schedule goes on from the loaded step; the moments go on as saved. Returns
    ``{name: (saved, now)}`` for each value that differed (``lr``: the first group's;
    ``lora_lr``: the last group's, where the groups' peaks differ, the LoRA matrices')."""
    peaks = list(group_lrs) if group_lrs is not None else [lr] * len(param_groups)
    own_group = len(set(peaks)) > 1 or len(set(scheduler.base_lrs)) > 1
    saved = {"lr": scheduler.base_lrs[0], "lora_lr": scheduler.base_lrs[-1],
             "weight_decay": max(g.get("weight_decay", 0.0) for g in param_groups),
             "betas": tuple(param_groups[0]["betas"]), "eps": param_groups[0]["eps"]}
    scheduler.base_lrs = list(peaks)
    for group, peak, decay, factor in zip(param_groups, peaks, group_decay,
                                          scheduler.lr_lambdas):
        group["initial_lr"] = peak
        group["weight_decay"] = decay
        group["lr"] = peak * factor(scheduler.last_epoch)
        group["betas"], group["eps"] = tuple(betas), eps
    scheduler._last_lr = [g["lr"] for g in param_groups]  # what get_last_lr() reports
    now = {"lr": peaks[0], "weight_decay": max(group_decay), "betas": tuple(betas), "eps": eps}
    if own_group:
        now["lora_lr"] = peaks[-1]
    return {k: (saved[k], now[k]) for k in now if saved[k] != now[k]}


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``module`` in eval mode (dropout off) inside, its previous mode restored after."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


class CheckpointMismatch(ValueError):
    """An engine's checkpoint files are not of this model or of a layout it reads (another
    architecture, shapes, a ZeRO-3 layout of another DeepSpeed, missing ranks' files, another
    Megatron parallel layout): the run stops with it on ``checkpoint.resume``, while any other
    error of a load keeps its traceback."""


class TrainEngine(ABC):
    """A model being trained by one backend, seen by the PPO trainer.

    Attributes every implementation sets:
        module: the unwrapped ``nn.Module`` (for decoding and for reading weights).
        gradient_accumulation_steps: micro-batches per optimizer update.
        world_size: data-parallel ranks.
        rank: this process's data-parallel rank.
        device: where inputs must be placed.

    An engine built for its weights alone (``weights_only``, for ``oppo-train --evaluate``)
    holds no optimizer and no schedule: it decodes and scores, :meth:`load` takes the
    weights alone, and :meth:`train_step` and :meth:`save` raise ``RuntimeError``.
    """

    weights_only: bool = False
    module: torch.nn.Module
    gradient_accumulation_steps: int
    world_size: int
    rank: int
    device: torch.device

    @abstractmethod
    def train_step(self, micro_batches: list, loss_fn: LossFn) -> list[dict]:
        """One optimizer update over a mini-batch.

        For each micro-batch: ``loss, stats = loss_fn(model, micro_batch)``, backward of
        ``loss / gradient_accumulation_steps``. The update (clipping, optimizer, LR scheduler)
        happens after the last micro-batch, so one call is always exactly one update. Usually
        there are ``gradient_accumulation_steps`` micro-batches; any number of at least one is
        taken (micro-batches sized by tokens, ``ppo.micro_batch_tokens``), each loss still
        divided by ``gradient_accumulation_steps``: ``algo.loss_normalizer`` accounts for that
        divisor, not for the count. No micro-batch is a ``ValueError``.

        Returns:
            the ``stats`` dicts, one per micro-batch, in order.
        """

    @abstractmethod
    def forward_no_grad(self, fn: Callable[[ModelCallable], Any]) -> Any:
        """``fn(model)`` under ``torch.no_grad`` with dropout off (old log-probs, values).

        Uses the same forward as training, so that PPO's ratio is exactly 1 before the
        first update. The previous train/eval mode is restored afterwards.
        """

    @abstractmethod
    def generation_context(self) -> ContextManager[torch.nn.Module]:
        """A context for step-by-step decoding with a KV cache.

        Inside it the yielded module is in eval mode, under ``torch.no_grad``, with its
        parameters usable by plain forward calls (under ZeRO-3: gathered). Weights must
        not change inside it. The previous mode is restored on exit.
        """

    @abstractmethod
    def save(self, ckpt_dir: str, tag: str, client_state: dict | None = None) -> None:
        """Save weights, optimizer, LR scheduler and ``client_state`` under ``ckpt_dir/tag``.

        Collective: every rank must call it.
        """

    @abstractmethod
    def load(self, ckpt_dir: str, tag: str | None = None, *, weights_only: bool = False) -> dict:
        """Restore what :meth:`save` wrote (``tag=None``: the latest) and return its
        ``client_state``. Raises ``FileNotFoundError`` if there is no such checkpoint.

        ``weights_only``: the model's weights, for an evaluation (``oppo-train --evaluate``):
        the optimizer and scheduler states are left as built and, where the backend keeps them
        apart from the weights, not read (with Adam the weights are a quarter of an fp32
        checkpoint's bytes, a seventh of a bf16 one's). The engine must not train after it.

        Raises ``CheckpointMismatch`` where the files are of another model or a layout the
        engine does not read (the run then stops with a ``checkpoint.resume`` error)."""

    @abstractmethod
    def lr(self) -> float:
        """Learning rate the next update will use."""

    def grad_norm(self) -> float | None:
        """Global gradient norm of the last update (before clipping), if known."""
        return None

    def close(self) -> None:
        """Give back what the backend holds for this model beyond the model itself (buffers,
        optimizer state, hooks); the engine cannot train after. Idempotent. Default: nothing
        to give back."""

    resumed_changes: dict[str, tuple[float, float]] = {}
    """After :meth:`load`: the optimizer settings (``lr``: the peak learning rate,
    ``weight_decay``, ``betas``, ``eps``) this run's configuration changed from the
    checkpoint's, as (saved, now)."""

    def _refuse_without_optimizer(self, what: str) -> None:
        """``RuntimeError`` for ``what`` (training, a save) on a weights-only engine."""
        if self.weights_only:
            raise RuntimeError(f"{type(self).__name__} was built with weights_only=True (an "
                               f"evaluation): it has no optimizer, so it cannot {what}")

    def _check_micro_batches(self, micro_batches: list) -> None:
        """The rule of :meth:`train_step`: one call is one update, of one micro-batch or more."""
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch, got none")
