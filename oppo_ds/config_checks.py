"""The rules of a configuration that tie its sections together: a setting of one section that
another makes invalid or unused (the estimator without a critic, the KL off without a
reference, Delta in whole prompts, PPO-ptx without its text, ...). Each section checks its own
fields in its ``__post_init__`` (``oppo_ds.config``); ``Config.__post_init__`` calls
``check_across_sections`` once they have. Errors name the key, as every ``ConfigError`` does."""
from __future__ import annotations

from .config_types import require


def optimizer_updates(cfg) -> int:
    """The run's optimizer updates of each trained model: steps x ppo_epochs x mini-batches."""
    return cfg.steps * cfg.ppo.updates_per_step


def check_across_sections(cfg) -> None:
    """The rules of a ``Config`` that tie its sections together (each section's own rules are
    its ``__post_init__``'s): ``ConfigError`` naming the key; scorers the run builds none of
    leave ``oppo.stream_to``."""
    require(cfg.data.samples_per_prompt >= 1, "data.samples_per_prompt",
            f"must be >= 1, got {cfg.data.samples_per_prompt}")
    require(cfg.ppo.batch_size % cfg.data.samples_per_prompt == 0, "data.samples_per_prompt",
            f"must divide ppo.batch_size ({cfg.ppo.batch_size}), got {cfg.data.samples_per_prompt}")
    # a real shape has no trained weights of ours: only the oracle can time it
    require(cfg.workload.kind == "length_oracle" or cfg.model.builtin_arch.startswith("tiny-"),
            "model.builtin_arch", f"{cfg.model.builtin_arch} is built with random weights and "
            f"needs workload.kind: length_oracle (the built-in task trains tiny-* models)")
    if not cfg.ppo.uses_reference:
        _check_reference_free(cfg)
    if cfg.system.deepspeed_config is not None:
        _check_deepspeed_entries(cfg)
    for key in ("actor_lora_dim", "critic_lora_dim"):
        require(cfg.system.backend == "deepspeed" or not getattr(cfg.model, key), f"model.{key}",
                f"needs system.backend: deepspeed (LoRA is implemented for it only; 0 with "
                f"megatron), got {getattr(cfg.model, key)} with system.backend: megatron")
    if cfg.system.backend == "megatron":
        _check_megatron_placement(cfg)
    require(not (cfg.system.partition_reference and "reference" in cfg.oppo.stream_to
                 and cfg.oppo.streaming), "system.partition_reference",
            "a partitioned reference cannot stream (each forward is collective over the "
            "ranks); remove reference from oppo.stream_to")
    require((cfg.ppo.ptx_coef > 0) == (cfg.data.ptx is not None),
            "ppo.ptx_coef" if cfg.data.ptx is None else "data.ptx",
            "PPO-ptx needs both ppo.ptx_coef > 0 and data.ptx (pretraining text); "
            f"got ppo.ptx_coef={cfg.ppo.ptx_coef}, data.ptx={cfg.data.ptx!r}")
    updates = optimizer_updates(cfg)
    require(cfg.ppo.warmup_steps <= updates, "ppo.warmup_steps", (
        f"must be at most the run's optimizer updates, steps x ppo.ppo_epochs x "
        f"ppo.batch_size / ppo.mini_batch_size = {updates}, got {cfg.ppo.warmup_steps}"))
    if cfg.ppo.micro_batch_tokens is not None:
        _check_micro_batch_tokens(cfg)
    longest = cfg.generation.max_prompt_len + cfg.generation.max_new_tokens
    require(cfg.ppo.score_batch_tokens is None or cfg.ppo.score_batch_tokens >= longest,
            "ppo.score_batch_tokens", f"must hold one sequence of the longest, "
            f"generation.max_prompt_len + max_new_tokens: {longest}, got "
            f"{cfg.ppo.score_batch_tokens}")
    require(cfg.ppo.overlong_buffer_len <= cfg.generation.max_new_tokens,
            "ppo.overlong_buffer_len", f"must be at most generation.max_new_tokens "
            f"({cfg.generation.max_new_tokens}), got {cfg.ppo.overlong_buffer_len}")
    if cfg.generation.static_cache:
        for key, on in (("system.hybrid_engine", cfg.system.hybrid_engine),
                        ("system.backend", cfg.system.backend == "megatron")):
            require(not on, "generation.static_cache", (
                f"needs the actor's own Hugging Face forward, which {key}: "
                f"{getattr(cfg.system, key.split('.')[1])} replaces (its decode keeps a cache "
                f"of its own); set generation.static_cache: false"))
    if not cfg.ppo.uses_critic:
        _check_critic_free(cfg)
    if cfg.oppo.overcommits:
        _check_delta_within_batch(cfg)
    if cfg.ppo.group_baseline and cfg.oppo.overcommits:
        _check_whole_prompt_delta(cfg)
    if not cfg.model.uses_reward_model:
        _check_reward_function(cfg)
    if cfg.ppo.filter_groups:
        _check_filter_groups(cfg)
    if cfg.eval.enabled:
        require(cfg.workload.kind != "length_oracle", "eval.prompts",
                "the length oracle's models have random weights and its responses end at "
                "drawn lengths: there is nothing to evaluate; set eval.prompts: null")


def _check_micro_batch_tokens(cfg) -> None:
    """ppo.micro_batch_tokens holds one sequence of the longest, and under PPO-ptx the
    pretraining block that goes with it into the same backward."""
    longest = cfg.generation.max_prompt_len + cfg.generation.max_new_tokens
    what = f"generation.max_prompt_len + max_new_tokens = {longest}"
    if cfg.ppo.ptx_coef > 0:
        longest += ptx_block_len(cfg)
        what += f", plus a PPO-ptx block of {ptx_block_len(cfg)} (data.ptx_block_len)"
    require(cfg.ppo.micro_batch_tokens >= longest, "ppo.micro_batch_tokens",
            f"must hold one sequence of the longest, {what}: {longest}, got "
            f"{cfg.ppo.micro_batch_tokens}")


def _check_megatron_placement(cfg) -> None:
    """The colocated placement runs the scorers' forwards in a thread beside the decode's; a
    Megatron model split over ranks makes each forward collective (tensor-parallel
    all-reduces, pipeline sends and receives), and the two threads' collectives would reach
    the ranks' process groups in a different order on each rank (gloo fails with a collective
    mismatch; NCCL hangs or adds up the wrong tensors)."""
    s = cfg.system
    split = s.tensor_parallel * s.pipeline_parallel
    require(cfg.oppo.placement != "colocated" or split == 1, "oppo.placement", (
        f"colocated cannot run with system.backend: megatron over {split} ranks "
        f"(tensor_parallel {s.tensor_parallel} x pipeline_parallel {s.pipeline_parallel}): "
        f"the scorer thread's forwards are collective over the model's ranks, as the decode's "
        f"are, and the two threads' collectives would interleave differently on each rank; "
        f"use inline or stage (colocated needs tensor_parallel and pipeline_parallel 1)"))


def _check_critic_free(cfg) -> None:
    """Settings that need a critic, refused naming them; the critic leaves oppo.stream_to."""
    estimator = cfg.ppo.advantage_estimator
    none = f"ppo.advantage_estimator {estimator} has no critic"
    require(estimator == "reinforce" or cfg.data.samples_per_prompt >= 2,
            "data.samples_per_prompt", f"must be >= 2 with ppo.advantage_estimator "
            f"{estimator}: its baseline compares the responses to one prompt")
    require(cfg.model.critic is None, "model.critic", f"must be null: {none}")
    require(not cfg.model.critic_lora_dim, "model.critic_lora_dim", f"must be 0: {none}")
    cfg.oppo.stream_to = [k for k in cfg.oppo.stream_to if k != "critic"]


def _check_deepspeed_entries(cfg) -> None:
    """system.deepspeed_config against the DeepSpeed configs the run builds, for one rank
    with the run's settings (``ds_config.deepspeed_overrides_problem``)."""
    from .engines.ds_config import (build_ds_config, build_inference_ds_config,
                                    deepspeed_overrides_problem, hybrid_max_out_tokens)

    p, s = cfg.ppo, cfg.system
    # built for one rank, which inference_tp_size need not divide: its value is set after
    hybrid = dict(hybrid_engine=s.hybrid_engine, inference_tp_size=1,
                  max_out_tokens=hybrid_max_out_tokens(cfg.generation, cfg.oppo.overcommits))
    trained = build_ds_config(
        train_micro_batch_size_per_gpu=p.micro_batch_size,
        gradient_accumulation_steps=max(1, p.mini_batch_size // p.micro_batch_size),
        world_size=1, zero_stage=s.zero_stage, offload=s.offload, dtype=s.dtype,
        grad_clip=p.grad_clip, grad_accum_dtype=s.grad_accum_dtype, **hybrid)
    evaluating = build_inference_ds_config(  # an evaluation's actor (oppo-train --evaluate)
        zero_stage=3 if s.zero_stage == 3 else 0, offload=s.offload and s.zero_stage == 3,
        dtype=s.dtype, **hybrid)
    for config in (trained, evaluating) if s.hybrid_engine else ():
        config["hybrid_engine"]["inference_tp_size"] = s.inference_tp_size
    others = [(evaluating, 3 if s.zero_stage == 3 else 0)]
    if s.partition_reference:
        others.append((build_inference_ds_config(zero_stage=3, offload=s.offload_reference,
                                                 dtype=s.dtype), 3))
    problem = deepspeed_overrides_problem(s.deepspeed_config, trained, others)
    require(problem is None, "system.deepspeed_config", str(problem))


def _check_reward_function(cfg) -> None:
    """With a reward function no reward model is built: what configures, places or streams
    one is refused, naming the key (after the critic and reference left oppo.stream_to)."""
    none = "with model.reward_function no reward model is built"
    require(not cfg.model.reward_normalize, "model.reward_normalize",
            f"must be false: it normalises a reward model's scores, and {none}")
    require(cfg.workload.kind != "length_oracle", "model.reward_function",
            "the length oracle's responses are random tokens that end at drawn lengths: there "
            "is no text to score; set it to null")
    require(cfg.oppo.placement != "stage" or {"reference", "critic"} & set(cfg.oppo.stream_to),
            "oppo.stream_to", (f"{cfg.oppo.stream_to} leaves the stage's scorer rank nothing to "
                               f"score ({none}): add reference or critic, or use oppo.placement "
                               f"inline or colocated"))
    require(not cfg.oppo.streaming or cfg.oppo.stream_to, "oppo.stream_to", (
        f"nothing would stream ({none}): add reference or critic, or set oppo.streaming: false "
        "(the rollout pool, oppo.overcommit, works without it)"))
    require(not cfg.ppo.uses_critic or cfg.model.critic is not None or cfg.model.reward != "builtin"
            or cfg.data.prompts == "builtin", "model.critic", (
        "set it (a checkpoint with a value head, or the actor's directory for a new head): with "
        "model.reward_function the critic starts from model.reward, here the built-in task's "
        "reward model, which does not read your prompts' tokens; or use a critic-free "
        "ppo.advantage_estimator"))


def _check_filter_groups(cfg) -> None:
    """Dynamic sampling drops prompts by their group's scores: it needs a group baseline, and
    runs its extra rounds in the actor processes (one rollout or one take from the pool per
    round; under the stage placement each is one rollout of every actor rank, an empty one
    from a rank with nothing to decode)."""
    require(cfg.ppo.group_baseline, "ppo.filter_groups", (
        f"needs a group baseline (ppo.advantage_estimator rloo, reinforce_baseline or "
        f"group_norm), got {cfg.ppo.advantage_estimator}: it drops the prompts whose responses "
        f"would all get an advantage of 0 from their group"))


def _check_reference_free(cfg) -> None:
    """With the KL off no reference model is built: the keys that configure one are
    refused, naming them, and the reference leaves oppo.stream_to."""
    none = "ppo.kl_coef is 0, so no reference model is built"
    require(cfg.model.reference is None, "model.reference", f"must be null: {none}")
    for key in ("partition_reference", "offload_reference"):
        require(not getattr(cfg.system, key), f"system.{key}", f"must be false: {none}")
    cfg.oppo.stream_to = [k for k in cfg.oppo.stream_to if k != "reference"]


def _check_delta_within_batch(cfg) -> None:
    """A step takes B rows and carries Delta into the next: with Delta above B more than B
    carried rows can reach oppo.max_defer_steps together, the step can take only B of them,
    and the others are deferred again, past the bound (a run at B 16, Delta 40,
    max_defer_steps 1 trained rows deferred 4 times). With Delta <= B the rows due are
    among the carried ones, at most B: each is taken in the step it is due."""
    o, b = cfg.oppo, cfg.ppo.batch_size
    key = "delta_max" if o.overcommit == "auto" else "overcommit"
    require(o.largest_delta <= b, f"oppo.{key}", (
        f"must be at most ppo.batch_size ({b}): a step takes {b} rows and carries Delta, so "
        f"with Delta above {b} more carried rows than a step takes can reach "
        f"oppo.max_defer_steps ({o.max_defer_steps}) together and the bound would not hold; "
        f"got {o.largest_delta}"
        + (f"; delta_max is {type(o).delta_max} unless set" if key == "delta_max" else "")))


def _check_whole_prompt_delta(cfg) -> None:
    """Under a group baseline the pool draws and takes whole prompts, so Delta is a number
    of rows that whole prompts make up, as ppo.batch_size is: any other would start the
    next multiple's pool while the logs and the Delta controller named a smaller one."""
    n, o = cfg.data.samples_per_prompt, cfg.oppo
    keys = ["overcommit"] if o.overcommit != "auto" else ["delta_min", "delta_max"]
    for key in keys:
        value = getattr(o, key)
        require(value % n == 0, f"oppo.{key}",
                f"must be a multiple of data.samples_per_prompt ({n}) with "
                f"ppo.advantage_estimator {cfg.ppo.advantage_estimator}: the rollout pool "
                f"draws whole prompts of {n} responses; got {value} (e.g. {value - value % n} "
                f"or {value - value % n + n})")


def flat_bf16(dtype: str, zero_stage: int, offload: bool) -> bool:
    """Whether DeepSpeed gives this model its flat BF16 optimizer when the gradients
    accumulate in fp32 (bf16 under ZeRO-1 without offload)."""
    return dtype == "bf16" and zero_stage == 1 and not offload


def ptx_block_len(cfg) -> int:
    """Tokens of a PPO-ptx block: ``data.ptx_block_len``, or a prompt and a response at their
    longest."""
    g = cfg.generation
    return cfg.data.ptx_block_len or g.max_prompt_len + g.max_new_tokens


def resolved_grad_accum_dtype(grad_accum_dtype: str, *, dtype: str, zero_stage: int,
                              offload: bool) -> str:
    """The dtype ``grad_accum_dtype`` stands for: ``auto`` is fp32 where that gets DeepSpeed's
    flat BF16 optimizer (:func:`flat_bf16`), else the model's."""
    if grad_accum_dtype != "auto":
        return grad_accum_dtype
    return "fp32" if flat_bf16(dtype, zero_stage, offload) else dtype


def uses_bf16_optimizer(accumulate: str, dtype: str, zero_stage: int, offload: bool) -> bool:
    """Whether gradients accumulated in ``accumulate`` (a resolved dtype) get DeepSpeed's
    flat BF16 optimizer."""
    return accumulate == "fp32" and flat_bf16(dtype, zero_stage, offload)


BF16_OPTIMIZER_STATES = "fp32 (DeepSpeed's BF16 optimizer)"


def optimizer_states_kind(grad_accum_dtype: str, *, dtype: str, zero_stage: int,
                          offload: bool) -> str:
    """What a checkpoint's optimizer files hold, as the gradients' dtype decides it: the BF16
    optimizer's (fp32 gradients for bf16 under ZeRO-1 without offload) or, for any other
    gradient dtype, the optimizer of the model's dtype and stage (ZeRO-2/3 and offload save
    the same states whichever dtype they accumulate in)."""
    resolved = resolved_grad_accum_dtype(grad_accum_dtype, dtype=dtype, zero_stage=zero_stage,
                                         offload=offload)
    return BF16_OPTIMIZER_STATES if uses_bf16_optimizer(resolved, dtype, zero_stage, offload) \
        else dtype


def grad_accum_dtype_problem(grad_accum_dtype: str, *, dtype: str, zero_stage: int,
                             offload: bool) -> str | None:
    """Why the gradients cannot accumulate in ``grad_accum_dtype`` here, in words that start
    with the value, or ``None`` when they can: fp32 for a bf16 model under ZeRO stages 1-3
    without offload (DeepSpeed refuses the mix under ZeRO-0; with offload it is untested
    here); nothing narrower than the model; fp32 for fp16 untested here."""
    fp32_allowed = dtype == "bf16" and zero_stage >= 1 and not offload
    if grad_accum_dtype in ("auto", dtype) or (grad_accum_dtype == "fp32" and fp32_allowed):
        return None
    allowed = ["auto", dtype] + (["fp32"] if fp32_allowed else [])
    return (f"{grad_accum_dtype} with dtype {dtype} and zero_stage {zero_stage}"
            f"{' with offload' if offload else ''}: the gradients accumulate in the model's "
            f"dtype, or a bf16 model's in fp32 under zero_stage 1, 2 or 3 without offload "
            f"(DeepSpeed refuses that mix under ZeRO-0; with offload it is untested here); "
            f"allowed here: {', '.join(allowed)}")


def check_evaluation_set(cfg) -> None:
    """``ConfigError`` for an evaluation alone (``oppo-train --evaluate``) with no prompts to
    evaluate on (``eval.prompts`` null)."""
    require(cfg.eval.enabled, "eval.prompts", "null, and --evaluate evaluates on it: name a prompt "
            "file or directory, or builtin (the built-in task's held-out set)")
