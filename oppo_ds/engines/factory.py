"""The four models of a PPO run, built by the configured backend (``system.backend``).

The trainer asks for them here and sees only the engine interface (``base.TrainEngine``)
for the two trained models and plain ``nn.Module`` scorers for the two frozen ones, so a
backend is added by one more branch below, not by edits across the trainer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import Config, ConfigError
from .base import TrainEngine

logger = logging.getLogger(__name__)


@dataclass
class Models:
    actor: TrainEngine
    critic: Optional[TrainEngine]  # None critic-free (ppo.advantage_estimator), or evaluating
    reference: Optional[torch.nn.Module]  # None on the scorer rank (stage), with the KL off,
    # or evaluating
    reward: Optional[torch.nn.Module]  # None on the scorer rank, or with model.reward_function


def build_models(cfg: Config, sources, common: dict, engine_args: dict, *,
                 evaluating: bool = False) -> Models:
    """Actor and critic as training engines, reference and reward as frozen scorers: those
    of ``cfg.actor_rank_models`` (no critic for a critic-free ``ppo.advantage_estimator``, no
    reference with the KL off, no reward model beside ``model.reward_function``, none of the
    models the stage placement's scorer rank holds), None for the others.

    Args:
        sources: ``sources.Sources`` (resolved model directories or tiny architectures).
        common: keyword arguments of ``models.build_causal_lm`` / ``build_value_model``.
        engine_args: the optimizer / schedule / batch arguments shared by actor and critic.
        evaluating: for ``oppo-train --evaluate``, which answers with the actor and scores
            with the reward model: no critic and no reference are built, and the actor's
            engine holds its weights alone (no optimizer: ``weights_only``).
    """
    if cfg.system.backend == "deepspeed":
        return _deepspeed_models(cfg, sources, common, engine_args, evaluating)
    if cfg.system.backend == "megatron":
        from .megatron_engine import build_megatron_models

        return build_megatron_models(cfg, sources, common, engine_args, evaluating=evaluating)
    raise ValueError(f"unknown system.backend {cfg.system.backend!r}")


def prepare_trained(model: torch.nn.Module, cfg: Config, kind: str) -> torch.nn.Module:
    """LoRA (``model.<kind>_lora_dim``, ``only_optimize_lora``) and gradient checkpointing
    (``system.gradient_checkpointing``) on a trained HF model (actor) or ValueHeadModel
    (critic), in place, before its engine is built. Returns ``model``."""
    from ..lora import add_lora, only_optimize_lora

    m = cfg.model
    rank = m.actor_lora_dim if kind == "actor" else m.critic_lora_dim
    if rank:
        add_lora(model, rank, m.lora_module_name, alpha=m.lora_alpha, seed=cfg.seed)
        if m.only_optimize_lora:
            only_optimize_lora(model, keep=("value_head",) if kind == "critic" else ())
    if cfg.system.gradient_checkpointing:
        body = getattr(model, "body", model)  # the critic's LM body
        # transformers 5 renamed it (the old name warns); non-reentrant: works when the
        # inputs of a block need no gradient (frozen embeddings under only_optimize_lora)
        kwargs = {"use_reentrant": False}
        if hasattr(body, "activation_checkpointing_enable"):
            body.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            body.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def _deepspeed_models(cfg: Config, src, common: dict, engine_args: dict,
                      evaluating: bool) -> Models:
    from ..models import build_causal_lm, build_device, build_value_model, disable_dropout
    from .deepspeed_engine import DeepSpeedTrainEngine
    from .ds_frozen import prepare_frozen, prepare_partitioned
    from .ds_config import engine_entries, hybrid_max_out_tokens

    p, s = cfg.ppo, cfg.system
    held = cfg.actor_rank_models(evaluating)
    if s.dtype == "fp16" and not torch.cuda.is_available():
        # DeepSpeed refuses it in its own sanity check, after the models are loaded
        raise ConfigError("system.dtype", "fp16 needs a GPU: on a CPU DeepSpeed trains in fp32 or "
                                          "bf16 (bf16 keeps fp32's range)")
    on = build_device(s.zero_stage)  # where a model built from config is made
    actor_model = prepare_trained(
        disable_dropout(build_causal_lm(src.actor, device=on, **common)), cfg, "actor")
    # system.deepspeed_config less what other keys set: the check took those only where they
    # restate the actor's settings, and the critic (no hybrid engine), an evaluation's actor
    # and the partitioned reference have their own
    entries = {} if not s.deepspeed_config else engine_entries(
        s.deepspeed_config, (3 if s.zero_stage == 3 else 0) if evaluating else s.zero_stage)
    engine_args = dict(engine_args, grad_accum_dtype=s.grad_accum_dtype,
                       ds_config_overrides=entries)
    actor = DeepSpeedTrainEngine(actor_model, lr=p.actor_lr, hybrid_engine=s.hybrid_engine,
                                 inference_tp_size=s.inference_tp_size, weights_only=evaluating,
                                 max_out_tokens=hybrid_max_out_tokens(cfg.generation,
                                                                      cfg.oppo.overcommits),
                                 lora_lr=cfg.model.lora_learning_rate, **engine_args)
    critic = None
    if "critic" in held:
        critic_model = prepare_trained(
            disable_dropout(build_value_model(src.critic, device=on, **common)), cfg,
            "critic")
        critic = DeepSpeedTrainEngine(critic_model, lr=p.critic_lr,
                                      lora_lr=cfg.model.lora_learning_rate, **engine_args)
    if actor.optimizer_wrapper == "FP16_UnfusedOptimizer" and s.dtype == "bf16" and \
            actor.rank == 0:
        logger.info("bf16 under ZeRO-0: DeepSpeed updates actor and critic parameter by "
                    "parameter (FP16_UnfusedOptimizer, several small ops and a host wait "
                    "each); system.zero_stage: 1 gets its flat BF16 optimizer, a few ops an "
                    "update, for fp32 gradients (docs/config.md, system.grad_accum_dtype)")
    device = actor.device
    if "reference" not in held:
        reference = None  # on the scorer rank, or the KL is off, or an evaluation
    elif s.partition_reference:  # ZeRO-3 shards over the actor's data-parallel ranks
        reference = prepare_partitioned(build_causal_lm(src.reference, **common), s.dtype,
                                        offload=s.offload_reference,
                                        overrides=engine_entries(s.deepspeed_config or {}, 3))
    else:
        reference = prepare_frozen(build_causal_lm(src.reference, device=on, **common), s.dtype,
                                   device, s.deepspeed_config)
    # none on the scorer rank's side of a stage, or in place of a reward function
    reward = None if "reward" not in held else \
        prepare_frozen(build_value_model(src.reward, require_head=True, device=on, **common),
                       s.dtype, device, s.deepspeed_config)
    return Models(actor=actor, critic=critic, reference=reference, reward=reward)
