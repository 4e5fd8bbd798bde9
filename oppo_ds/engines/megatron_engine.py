"""Megatron-core implementation of :class:`~oppo_ds.engines.base.TrainEngine`
(``system.backend: megatron``): tensor- and pipeline-parallel GPTModels for actor, critic,
reference and reward.

Design (docs/megatron.md has the long version):

* **Models.** Each model is a megatron-core ``GPTModel`` (TransformerEngine or local layer
  spec, ``system.megatron_layers``) converted from HF Llama / Qwen2 weights by
  ``megatron.convert`` (read rank by rank from safetensors files by ``megatron.loading``,
  without building the HF model), wrapped in ``megatron.model.MegatronModel``, which presents
  it HF-style (``.logits`` / ``.values``, a ``DynamicCache`` KV cache) to the decode loop, the
  streaming scorers and the loss functions, so the trainer and the PPO math are the same for
  both backends. Critic and reward: a GPTModel without ``output_layer`` plus a scalar value
  head.
* **Process groups** come from ``megatron.parallel.init_model_parallel`` once and are passed
  to every model and engine (``ParallelGroups``). ``rank`` / ``world_size`` of an engine are
  its *data-parallel* rank and size: ranks of one model replica (its tensor-parallel and
  pipeline ranks) must see the same prompts and sample the same tokens.
* **Training.** ``train_step`` runs the trainer's loss function on every rank for each
  micro-batch and backpropagates through the model's own forward: tensor-parallel layers
  communicate in their autograd functions, pipeline stages pass activations forward and
  gradients back point-to-point (a stage waits while another works: no interleaving of
  micro-batches, the simple schedule); a bf16 model's gradients are summed over the
  micro-batches in fp32, in its master copy's. Then the gradients are averaged over the
  data-parallel group, the global norm (shards counted once over tensor x pipeline ranks) is
  clipped, and a plain ``torch.optim.AdamW`` steps over this rank's shards (fp32 master
  copies when the model is bf16/fp16). megatron-core's DistributedOptimizer is not used: it
  needs its DDP wrapper and contiguous CUDA grad buffers; with AdamW over local shards every
  data-parallel rank keeps full optimizer state of its shards (ZeRO-1 style sharding over
  data parallel is left to a later version).
* **Checkpoints**: one file per (tensor, pipeline) rank, written by data-parallel rank 0:
  weights, optimizer, LR scheduler, client state; the HF ``config.json`` beside them, so that
  ``python -m oppo_ds.megatron.export`` can turn a tag into HF weights.
* **Stage placement**: the world is the actor ranks alone (the scorer process joins none,
  ``oppo_ds/stage_placement.py``), so the groups span it as without a stage; the scorer
  process holds the models of ``Config.scorer_rank_models``, which are None here.

Everything megatron-specific lives here and in ``oppo_ds/megatron/``.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..config import Config, ConfigError
from ..durable import write_durably
from .base import (CheckpointMismatch, LossFn, ModelCallable, TrainEngine, check_schedule,
                   eval_mode, lr_multiplier, reapply_hyperparameters)

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class MegatronTrainEngine(TrainEngine):
    """A ``megatron.model.MegatronModel`` trained with AdamW over its local shards.

    Args:
        model: this rank's part of the model (on its device, in its dtype).
        groups: ``megatron.parallel.ParallelGroups`` of this process.
        lr, weight_decay, betas, eps, warmup_steps, total_steps, scheduler: AdamW and the
            LR schedule (:func:`~oppo_ds.engines.base.lr_multiplier`), as for DeepSpeed.
        gradient_accumulation_steps: micro-batches per update.
        grad_clip: clip the global gradient norm to this (None: no clipping).
        weights_only: the weights alone, for an evaluation (``oppo-train --evaluate``): no
            fp32 master copy of a bf16 / fp16 model (built here otherwise), no optimizer, no
            schedule; it decodes, scores and loads weights, and cannot train or save.
    """

    hybrid_engine_path = "off"

    def __init__(self, model, groups, *, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 warmup_steps: int = 0, total_steps: int, scheduler: str = "constant",
                 gradient_accumulation_steps: int = 1, grad_clip: float | None = 1.0,
                 weights_only: bool = False):
        check_schedule(warmup_steps=warmup_steps, total_steps=total_steps, scheduler=scheduler)
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        self.module, self.groups = model, groups
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.world_size, self.rank = groups.dp, groups.dp_rank
        self.data_parallel_group = groups.dp_group
        self.device = model.device
        self.grad_clip = grad_clip
        self.weights_only = weights_only
        self._peak_lr, self._adam = lr, (tuple(betas), eps)
        self._grad_norm: float | None = None
        if weights_only:
            return
        self._params = [p for p in model.parameters() if p.requires_grad]
        # fp32 master copies for bf16 / fp16 weights, so small updates are not rounded away
        self._master = None
        if model.dtype != torch.float32:
            self._master = [p.detach().float().clone().requires_grad_(True) for p in self._params]
        trained = self._master if self._master is not None else self._params
        decay = [m for m, p in zip(trained, self._params) if p.ndim >= 2]
        no_decay = [m for m, p in zip(trained, self._params) if p.ndim < 2]
        groups_ = [g for g in ({"params": decay, "weight_decay": weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        self.optimizer = torch.optim.AdamW(groups_, lr=lr, betas=betas, eps=eps)
        self._group_decay = [g["weight_decay"] for g in groups_]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, functools.partial(lr_multiplier, warmup_steps=warmup_steps,
                                              total_steps=total_steps, scheduler=scheduler))

    # -- TrainEngine ---------------------------------------------------------------------

    def train_step(self, micro_batches: list, loss_fn: LossFn) -> list[dict]:
        self._refuse_without_optimizer("train")
        self._check_micro_batches(micro_batches)
        self.module.train()
        all_stats = []
        for micro_batch in micro_batches:
            loss, stats = loss_fn(self.module, micro_batch)
            (loss / self.gradient_accumulation_steps).backward()
            self._accumulate()
            all_stats.append(stats)
        self._reduce_gradients()
        self._grad_norm = self._clip()
        self._step()
        return all_stats

    def _accumulate(self) -> None:
        """A bf16 / fp16 model's micro-batch gradients summed in fp32, into its master copy's
        ``.grad`` (Megatron-core's DDP sums into an fp32 ``main_grad`` likewise): left in the
        model's ``.grad``, each addition would round the sum to the model's 8 or 11 bits (a
        bf16 sum of 64 micro-batches was 1% off the big batch's gradient, one was 0.55%)."""
        if self._master is None:
            return
        for master, p in zip(self._master, self._params):
            if p.grad is None:
                continue
            if master.grad is None:
                master.grad = p.grad.float()
            else:
                master.grad.add_(p.grad)
            p.grad = None

    def _grads(self) -> list[torch.Tensor]:
        """The gradients the update takes, one per trained parameter (zeros where none came):
        the fp32 master copy's, or the fp32 model's own."""
        trained = self._master if self._master is not None else self._params
        for t in trained:
            if t.grad is None:
                t.grad = torch.zeros_like(t)
        return [t.grad for t in trained]

    def _reduce_gradients(self) -> None:
        """Average over data-parallel replicas (one flat all-reduce)."""
        grads = self._grads()
        if self.groups.dp == 1:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, group=self.groups.dp_group)
        flat /= self.groups.dp
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def _clip(self) -> float:
        """Global L2 norm over the whole model: a tensor-parallel shard counts on its rank,
        a replicated parameter (norm weights, the value head) once, on tensor rank 0."""
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = self._grads()
        for p, grad in zip(self._params, grads):
            if getattr(p, "tensor_model_parallel", False) or self.groups.tp_rank == 0:
                local += grad.double().pow(2).sum()
        if self.groups.tp * self.groups.pp > 1:
            dist.all_reduce(local, group=self.groups.mp_group)
        norm = float(local.sqrt())
        if self.grad_clip and norm > self.grad_clip:  # None or 0: no clipping, as DeepSpeed
            for grad in grads:
                grad.mul_(self.grad_clip / (norm + 1e-6))
        return norm

    def _step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        for p in self._params:
            p.grad = None
        if self._master is not None:
            with torch.no_grad():
                for master, p in zip(self._master, self._params):
                    p.copy_(master)

    def forward_no_grad(self, fn: Callable[[ModelCallable], Any]) -> Any:
        with eval_mode(self.module), torch.no_grad():
            return fn(self.module)

    @contextlib.contextmanager
    def generation_context(self) -> Iterator[torch.nn.Module]:
        with eval_mode(self.module), torch.no_grad():
            yield self.module

    def _shard_path(self, ckpt_dir: str, tag: str) -> str:
        g = self.groups
        return os.path.join(ckpt_dir, tag, f"mp_rank_{g.tp_rank:02d}_{g.pp_rank:03d}.pt")

    def save(self, ckpt_dir: str, tag: str, client_state: dict | None = None) -> None:
        self._refuse_without_optimizer("save a checkpoint")
        if self.groups.dp_rank != 0:  # the replicas hold the same state
            return
        path = self._shard_path(ckpt_dir, tag)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "client_state": client_state or {},
                 "master": None if self._master is None else [m.detach() for m in self._master],
                 "parallel": (self.groups.tp, self.groups.pp)}
        write_durably(path, lambda f: torch.save(state, f))  # whole and on disk, or the old
        config = getattr(self.module, "config", None)
        if self.groups.tp_rank == 0 and self.groups.pp_rank == 0 and config is not None:
            # what `python -m oppo_ds.megatron.export` needs to write HF weights from the shards
            config.to_json_file(os.path.join(os.path.dirname(path), "config.json"))

    def load(self, ckpt_dir: str, tag: str | None = None, *, weights_only: bool = False) -> dict:
        """``weights_only`` (see :meth:`TrainEngine.load`): the shard file is mapped, not read,
        and only the module's weights are taken from it (the bf16 module's own: a
        mixed-precision run's fp32 master copy and the optimizer's moments stay on disk). An
        engine built ``weights_only`` loads so whatever it is asked."""
        weights_only = weights_only or self.weights_only
        if tag is None:  # the newest: highest step number (step10 after step9)
            tags = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
            numbered = [(int(m.group(1)), t) for t in tags if (m := re.fullmatch(r"\D*(\d+)", t))]
            tag = max(numbered)[1] if numbered else None
        path = self._shard_path(ckpt_dir, tag) if tag is not None else None
        if path is None or not os.path.isfile(path):
            raise FileNotFoundError(f"no Megatron checkpoint shard in {ckpt_dir!r} (tag={tag!r})")
        # mapped: the pages of what is not taken (the optimizer's moments) are never read
        state = torch.load(path, map_location="cpu" if weights_only else self.device,
                           weights_only=False, mmap=weights_only)
        if tuple(state["parallel"]) != (self.groups.tp, self.groups.pp):
            raise CheckpointMismatch(f"{path} was saved with (tensor, pipeline) parallel "
                                     f"{tuple(state['parallel'])}, this run uses "
                                     f"{(self.groups.tp, self.groups.pp)}")
        try:
            self.module.load_state_dict(state["model"])
        except RuntimeError as err:  # missing or unexpected keys, other shapes
            raise CheckpointMismatch(f"{path} holds the weights of another model: {err}") from None
        if weights_only:
            return state["client_state"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.resumed_changes = reapply_hyperparameters(self.optimizer.param_groups, self.scheduler,
                                                       self._peak_lr, self._group_decay,
                                                       *self._adam)
        if self._master is not None:
            with torch.no_grad():
                for master, saved in zip(self._master, state["master"]):
                    master.copy_(saved)
        return state["client_state"]

    def lr(self) -> float:
        self._refuse_without_optimizer("report a learning rate")
        return float(self.scheduler.get_last_lr()[0])

    def grad_norm(self) -> float | None:
        return self._grad_norm


# --------------------------------------------------------------------------------------
# The four models
# --------------------------------------------------------------------------------------

def check_megatron_config(cfg: Config) -> None:
    """``ConfigError`` for what only this machine can refuse: TransformerEngine's layers asked
    for where they cannot run. (The settings this backend does not have are the config's own
    rules: ``SystemConfig`` and ``config_checks``.)"""
    s = cfg.system
    if s.megatron_layers == "transformer_engine":
        from ..megatron.model import transformer_engine_usable

        usable, why = transformer_engine_usable()
        if not usable:
            raise ConfigError("system.megatron_layers", f"transformer_engine: {why}; use local "
                              f"or auto")


def build_megatron_models(cfg: Config, sources, common: dict, engine_args: dict, *,
                          evaluating: bool = False):
    """Actor and critic as ``MegatronTrainEngine``s, reference and reward as frozen
    ``MegatronModel``s, all with ``system.tensor_parallel`` x ``system.pipeline_parallel``;
    those of ``cfg.actor_rank_models``, None for the others (the critic and reference when
    ``evaluating``, ``oppo-train --evaluate``, whose actor is built for its weights alone: no
    master copy, no optimizer; the models the stage placement's scorer rank holds).

    A safetensors checkpoint directory is read without building the HF model: every rank
    reads only its own blocks of the tensors of its pipeline stage (``megatron.loading``).
    Other sources are built as the DeepSpeed backend builds them (architectures from config
    with the same seeds; ``.bin`` checkpoints whole, in host memory on every rank) and
    converted; every rank keeps only its own shard."""
    from ..megatron.loading import CheckpointError, is_safetensors_checkpoint, load_megatron_model
    from ..megatron.model import build_model, resolve_layer_spec
    from ..comm import set_local_cuda_device
    from ..megatron.parallel import init_model_parallel
    from ..models import FROM_CONFIG_ARCHS, build_causal_lm, build_value_model, disable_dropout
    from .factory import Models

    check_megatron_config(cfg)
    p, s = cfg.ppo, cfg.system
    groups = init_model_parallel(s.tensor_parallel, s.pipeline_parallel, seed=cfg.seed)
    dtype, where = _DTYPES[s.dtype], set_local_cuda_device()
    spec = resolve_layer_spec(s.megatron_layers)
    hf_args = dict(common, dtype="fp32")  # converted in fp32, cast after sharding
    first_rank = dist.get_rank() == 0

    def load(source: str, kind: str, *, require_head: bool = False):
        if is_safetensors_checkpoint(source):
            if first_rank:
                logger.info("%s: each rank reads its own shard from the safetensors files "
                            "(no whole model in host memory)", source)
            with _conversion_errors(CheckpointError):
                return load_megatron_model(source, groups, kind, dtype=dtype, device=where,
                                           require_head=require_head,
                                           trust_remote_code=common.get("trust_remote_code",
                                                                        False), spec=spec)
        if first_rank and source not in FROM_CONFIG_ARCHS:
            logger.info("%s: no safetensors weights; every rank loads the whole HF model into "
                        "host memory and keeps its shard (a safetensors checkpoint is read "
                        "shard by shard)", source)
        if kind == "lm":
            hf_model = build_causal_lm(source, **hf_args)
        else:
            hf_model = build_value_model(source, require_head=require_head, **hf_args)
        with _conversion_errors(CheckpointError):
            return build_model(disable_dropout(hf_model), groups, kind, dtype=dtype, device=where,
                               spec=spec)

    train = dict(total_steps=engine_args["total_steps"], weight_decay=engine_args["weight_decay"],
                 warmup_steps=engine_args["warmup_steps"], scheduler=engine_args["scheduler"],
                 gradient_accumulation_steps=engine_args["gradient_accumulation_steps"],
                 grad_clip=engine_args["grad_clip"])
    # Adam's betas and epsilon where given (the trainer gives ppo.adam_betas and adam_eps); the
    # engine's defaults otherwise, as DeepSpeedTrainEngine takes them
    train.update({k: engine_args[k] for k in ("betas", "eps") if k in engine_args})
    def trained(source: str, kind: str, lr: float, weights_only: bool = False
                ) -> MegatronTrainEngine:
        model = load(source, kind)
        model.recompute = s.gradient_checkpointing
        return MegatronTrainEngine(model, groups, lr=lr, weights_only=weights_only, **train)

    actor = trained(sources.actor, "lm", p.actor_lr, weights_only=evaluating)
    held = cfg.actor_rank_models(evaluating)
    critic = trained(sources.critic, "value", p.critic_lr) if "critic" in held else None
    reference = _frozen(load(sources.reference, "lm")) if "reference" in held else None
    reward = None if "reward" not in held else \
        _frozen(load(sources.reward, "value", require_head=True))
    if first_rank:
        logger.info("Megatron-core backend: tensor_parallel=%d pipeline_parallel=%d "
                    "data_parallel=%d, %s on %s, %s layers", groups.tp, groups.pp, groups.dp,
                    s.dtype, where, spec)
    return Models(actor=actor, critic=critic, reference=reference, reward=reward)


@contextlib.contextmanager
def _conversion_errors(passed: type):
    """A ``ValueError`` of the conversion (an architecture or a size it cannot take) as a
    ``ConfigError`` on ``system.backend``; ``passed`` errors (the checkpoint's) unchanged."""
    try:
        yield
    except passed:
        raise
    except ValueError as err:
        raise ConfigError("system.backend", f"megatron: {err}") from None


def _frozen(model):
    model.eval()
    model.requires_grad_(False)
    return model
