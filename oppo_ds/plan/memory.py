"""Per-GPU memory of a PPO step: what each model and cache takes, phase by phase.

Accounting (bytes per parameter, mixed precision as DeepSpeed does it):
  * trained models (actor, critic): weights 2 (bf16/fp16; 4 in fp32), gradients 2, and the
    optimizer's 16: fp32 master weights 4, fp32 gradients 4, Adam's two moments 8 (fp32
    training at stage 0 or 3: moments only, 8; ZeRO-1/2 clone an fp32 master anyway); at
    stage 3 the 16-bit gradients turn into the fp32 ones at the step (gradients 4, optimizer
    12: 18 in all, as at stages 1-2). ZeRO partitions the optimizer states over the
    data-parallel ranks at stage >= 1, the gradients at stage >= 2 and the weights at stage
    3; stage 3 also holds the gathered weights and gradients of the module being computed
    (2 x the largest module). `system.offload` moves the optimizer (and the gradients, stage
    >= 2) to CPU memory, at stage 3 the weights too. With LoRA the decoder layers' linear
    weights are frozen (no gradients or optimizer states), and with `only_optimize_lora`
    everything but the LoRA matrices (and the critic's value head).
  * frozen models: weights only; the reward model is a full copy on every GPU, the reference
    too unless `system.partition_reference` (ZeRO-3 partitioned, gathered one module at a
    time; with `offload_reference` the partition sits in CPU memory). Only the models an
    actor rank builds count (`Config.actor_rank_models`): no reference with the KL off, no
    reward model beside `model.reward_function`, and under the stage placement neither
    model that streams (the scorer rank's own entry holds them whole).
  * caches: the actor's KV cache for the widest rollout's rows (B + Delta, or a later round
    of `ppo.filter_groups` with `filter_groups_oversample` when wider: `Config.widest_rollout`)
    at prompt + response length, and the streaming scorers' caches for the same rows; the
    frozen scorers of the rollout pool keep the caches of the deferred rows through the
    update. With `generation.static_cache` the actor's cache is at its static length
    (rounded up to 64); with `generation.cuda_graph` it and the graph's logits stay allocated
    through scoring and training as well.
  * ZeRO-3's rollout: the actor gathered whole on every GPU for the rollout (and the critic
    when it streams on the actor ranks), with or without the hybrid engine, whose inference
    containers add a copy split over `inference_tp_size` GPUs when that is above 1.
  * the rollout's passing tensors, the larger of the prefill's (one layer's no-grad
    activations over its widest context; with deferred rows their prefixes' logits) and the
    decode's (a token's logits; a streamed reference's chunk of logits).
  * activations of one training micro-batch (flash attention, no seq x seq scores), with
    gradient checkpointing only each layer's input plus one layer recomputed; the actor's
    logits at 16 bytes each (fp32 log-softmax, entropy, their gradients) for the responses'
    positions (every position when packed); a scoring forward's logits in the model's dtype
    and one block of rows' fp32 copies.
The model-state part is checked against DeepSpeed's own estimators (tests/test_plan.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..algo.logprobs import BLOCK_ELEMENTS
from ..config import Config, ConfigError
from ..config_checks import ptx_block_len, resolved_grad_accum_dtype, uses_bf16_optimizer
from ..rollout.static_length import cache_length, widest_context
from .costs import GIB, Device
from .shapes import ModelShape, Shapes

FRAMEWORK_GIB = 2.0  # CUDA context, NCCL and DeepSpeed's communication buckets (assumed)
# bytes per logit (position x vocabulary entry) of the actor's update: the fp32 upcast divided
# by the temperature, its log-softmax kept for the backward, the entropy's softmax, then their
# gradients (16.4 measured for a bf16 Llama's micro-batch, the model's own bf16 logits included)
TRAIN_LOGIT_BYTES = 16
# the fp32 copies (upcast, divided, log-softmax) of one block of rows of a no-grad forward's
# logits: policy_token_logprobs takes BLOCK_ELEMENTS at a time
LOGPROB_BLOCK_BYTES = 12 * BLOCK_ELEMENTS


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def optimizer_bytes_per_param(dtype: str, zero_stage: int = 0) -> int:
    """Adam's moments (8) plus fp32 master weights and gradients (8): in mixed precision, and
    in fp32 under ZeRO-1/2 too, whose optimizer clones an fp32 partition of the weights it
    updates whatever their dtype (DeepSpeed's ``stage_1_and_2``; at stage 3 an fp32 partition
    is used as it is, and at stage 0 torch's Adam updates the weights themselves)."""
    return 8 if dtype == "fp32" and zero_stage not in (1, 2) else 16


@dataclass
class ModelStates:
    """Bytes one GPU holds for a trained model, and what its node's CPU memory holds."""
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    gathered: float = 0.0      # ZeRO-3: the module being computed, gathered (weights + grads)
    cpu_per_node: float = 0.0

    @property
    def gpu(self) -> float:
        return self.params + self.grads + self.optimizer + self.gathered


def model_states(total_params: int, trainable: int, largest_module: int, *, zero_stage: int,
                 offload: bool, gpus: int, gpus_per_node: int, dtype: str = "bf16",
                 grad_accum_dtype: str | None = None) -> ModelStates:
    """Weights, gradients and optimizer states of one trained model on one GPU.
    ``grad_accum_dtype``: the gradients' dtype. fp32 for bf16 under ZeRO-1 without offload is
    DeepSpeed's BF16 optimizer, which keeps the whole model's gradients in one fp32 buffer on
    every rank (each bf16 gradient freed once added) and no other fp32 gradient partition;
    under ZeRO-2 fp32 gradients accumulate in the fp32 partition already counted in the
    optimizer's bytes, under ZeRO-3 in a persistent fp32 partition beside the one the step
    makes."""
    w, opt, g = dtype_bytes(dtype), optimizer_bytes_per_param(dtype, zero_stage), dtype_bytes(dtype)
    if uses_bf16_optimizer(grad_accum_dtype, dtype, zero_stage, offload):
        g, opt = 4, opt - 4
    if zero_stage == 3 and dtype != "fp32":
        # stage 3 keeps no separate fp32 gradient partition: at the step each sub-group's
        # 16-bit gradients become fp32 ones (and are freed), so gradients peak at 4 bytes;
        # accumulated in fp32, its gradient partition is fp32 already: 8 at the step
        g, opt = 8 if grad_accum_dtype == "fp32" else 4, opt - 4
    s = ModelStates()
    s.params = w * total_params / (gpus if zero_stage == 3 else 1)
    s.grads = g * trainable / (gpus if zero_stage >= 2 else 1)
    s.optimizer = opt * trainable / (gpus if zero_stage >= 1 else 1)
    if zero_stage == 3:
        s.gathered = 2 * w * largest_module
    if offload:
        s.cpu_per_node = s.optimizer * gpus_per_node
        s.optimizer = 0.0
        if zero_stage >= 2:  # reduced into buckets and copied out, never kept on the GPU
            s.cpu_per_node += s.grads * gpus_per_node
            s.grads = 0.0
        if zero_stage == 3:
            s.cpu_per_node += s.params * gpus_per_node
            s.params = 0.0
    return s


@dataclass
class MemoryPlan:
    """Per-GPU bytes by item, the three phases' totals and the verdict."""
    items: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    cpu_per_node: float = 0.0
    capacity: float = 0.0
    headroom: float = 0.1

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity * (1.0 - self.headroom)

    def to_json(self) -> dict:
        gib = lambda b: round(b / GIB, 3)  # noqa: E731
        return {"fits": self.fits, "peak_mem_gib": gib(self.peak), "peak_phase": self.peak_phase,
                "capacity_gib": gib(self.capacity), "headroom": self.headroom,
                "usable_gib": gib(self.capacity * (1.0 - self.headroom)),
                "phases_gib": {k: gib(v) for k, v in self.phases.items()},
                "breakdown_gib": {k: gib(v) for k, v in self.items.items()},
                "cpu_per_node_gib": gib(self.cpu_per_node)}


def rollout_width(cfg: Config) -> int:
    """Positions of the rollout's widest row: a rollout of the pool packs its deferred rows'
    partial responses after their prompts, and a streaming scorer's rows are as wide as the
    actor's (deferred rows' partial responses padded to the longest, then every chunk on top,
    compacted at the next rollout only)."""
    gen = cfg.generation
    return widest_context(gen.max_prompt_len, gen.max_new_tokens,
                          cfg.oppo.overcommits) + gen.max_new_tokens


def rollout_caches(cfg: Config, shapes: Shapes, split: int = 1) -> dict[str, float]:
    """The rollout's caches on one actor GPU, each model's layers and heads split ``split``
    ways (Megatron's tensor x pipeline ranks; 1 for whole models, the hybrid engine's
    inference TP included: its group decodes tp x the rows with 1/tp of the heads each):
    the actor's KV cache for the widest rollout (``Config.widest_rollout`` rows of
    ``rollout_width``; with ``generation.static_cache`` its static length), the streamed
    scorers' caches for the same rows (none here under the stage placement: the scorer rank
    holds them), the frozen scorers' caches of the deferred rows, which the pool keeps
    through the update (``Config.carried_scorer_kinds``), and the decode's fp32 logits (gathered
    over tp: full width)."""
    gen, w = cfg.generation, dtype_bytes(cfg.system.dtype)
    rows, width = cfg.widest_rollout, rollout_width(cfg)
    actor_width = cache_length(
        widest_context(gen.max_prompt_len, gen.max_new_tokens, cfg.oppo.overcommits),
        gen.max_new_tokens, gen.sync_every) if gen.static_cache else width
    here = cfg.actor_rank_streamed
    carried = cfg.carried_scorer_kinds if cfg.oppo.overcommits else []

    def kv(model: ModelShape, n_rows: int, positions: int) -> float:
        return n_rows * positions * model.kv_bytes_per_token(w) / split

    vocab = shapes.actor.vocab
    # a rollout that carries deferred rows scores each one's partial response (up to
    # max_new_tokens - 1 tokens) under the actor: from the prefill's logits, or where those
    # would pass a block, a block of rows at a time (one row at least) in forwards apart
    prefill = min(rows * gen.max_new_tokens * vocab,
                  max(BLOCK_ELEMENTS, gen.max_new_tokens * vocab)) if cfg.oppo.overcommits else 0
    # a streamed reference's chunk: the forward's logits and the rows' copy of them
    chunk = max(cfg.oppo.chunk_candidates) if cfg.oppo.chunk_size == "auto" \
        else cfg.oppo.chunk_size
    streamed = rows * chunk * vocab if "reference" in here else 0
    return {"actor_kv": kv(shapes.actor, rows, actor_width),
            "scorer_kv": sum(kv(getattr(shapes, k), rows, width) for k in here),
            "carried_scorer_kv": sum(kv(getattr(shapes, k), cfg.oppo.largest_delta, width)
                                     for k in carried),
            "decode_logits": 4 * rows * vocab * 2,
            "prefill_logits": (w + 12) * prefill,
            "stream_logits": 2 * w * streamed + min(12 * streamed, LOGPROB_BLOCK_BYTES)}


def prefill_activations(cfg: Config, shape: ModelShape, tp: int = 1) -> float:
    """One layer's no-grad forward over the rollout's widest prefill: its rows of a prompt
    and, when the pool carries deferred rows, a partial response (``widest_context``)."""
    gen = cfg.generation
    tokens = cfg.widest_rollout * widest_context(gen.max_prompt_len, gen.max_new_tokens,
                                                 cfg.oppo.overcommits)
    return tokens * shape.forward_bytes_per_token(dtype_bytes(cfg.system.dtype), tp)


def generate_transients(items: dict) -> float:
    """The generate phase's largest passing tensors: the prefill's (its activations and a
    carried prefix's logits), or the decode's (a token's logits, a streamed chunk's)."""
    return max(items["prefill_activations"] + items["prefill_logits"],
               items["decode_logits"] + items["stream_logits"])


def scorer_rank_memory(plan: MemoryPlan, cfg: Config, shapes: Shapes, senders: int) -> None:
    """The stage placement's scorer rank as a phase of its own (``scorer_rank``): its whole
    models and, since it serves every sender's rollout at once with scorers of its own, one
    set of KV caches of the widest rollout's rows per sender (``rollout_caches``'s)."""
    w = dtype_bytes(cfg.system.dtype)
    whole = {"reward": w * shapes.reward.params(value_head=True),
             "reference": w * shapes.reference.params(),
             "critic": w * shapes.critic.params(value_head=True)}
    kinds = cfg.scorer_rank_models()
    plan.items["scorer_rank_models"] = sum(whole[k] for k in kinds)
    rows, seq = cfg.widest_rollout, rollout_width(cfg)
    plan.items["scorer_rank_kv"] = sum(
        senders * rows * seq * getattr(shapes, k).kv_bytes_per_token(w) for k in kinds)
    plan.phases["scorer_rank"] = (plan.items["scorer_rank_models"] + plan.items["scorer_rank_kv"]
                                  + FRAMEWORK_GIB * GIB)


def actor_rank_gpus(cfg: Config, gpus: int) -> int:
    """The GPUs of the actor ranks (ZeRO's data-parallel world): all, less the stage
    placement's scorer rank."""
    if not cfg.scorer_rank_models():
        return gpus
    if gpus < 2:
        raise ConfigError("oppo.placement", f"stage needs a GPU for the scorer rank besides the "
                                            f"actor ranks: at least 2, got {gpus}")
    return gpus - 1


def _trained(shape: ModelShape, value_head: bool, lora_dim: int, cfg: Config, gpus: int,
             gpus_per_node: int) -> ModelStates:
    lora = shape.lora_params(lora_dim)
    total = shape.params(value_head) + lora
    trainable = total
    if lora_dim:  # the weights of the layers given LoRA are frozen (oppo_ds.lora.add_lora)
        trainable = total - shape.linear_weights()
    if cfg.model.only_optimize_lora and lora_dim:
        trainable = lora + (shape.hidden if value_head else 0)
    s = cfg.system
    accumulate = resolved_grad_accum_dtype(s.grad_accum_dtype, dtype=s.dtype,
                                           zero_stage=s.zero_stage, offload=s.offload) \
        if s.backend == "deepspeed" else None
    return model_states(total, trainable, shape.largest_module_params(), zero_stage=s.zero_stage,
                        offload=s.offload, gpus=gpus, gpus_per_node=gpus_per_node, dtype=s.dtype,
                        grad_accum_dtype=accumulate)


def _activations(shape: ModelShape, tokens: int, w: int, checkpointing: bool,
                 logit_positions: int) -> float:
    per_layer = shape.activation_bytes_per_token(w, checkpointing) * tokens
    out = shape.layers * per_layer
    if checkpointing:  # the layer being recomputed holds everything once
        out += shape.activation_bytes_per_token(w, False) * tokens
    return out + TRAIN_LOGIT_BYTES * logit_positions * shape.vocab


def logit_positions(cfg: Config, tokens: int, rows: int, actor: bool = False) -> int:
    """Positions whose logits a forward of ``tokens`` positions in ``rows`` rows at most makes:
    a row's responses and the position before them (the forwards keep those alone), and under
    PPO-ptx (``actor``) its pretraining block; every position when the rows are packed
    (``system.packing_samples``: one forward of the packed rows)."""
    if cfg.system.packing_samples:
        return tokens
    per_row = cfg.generation.max_new_tokens + 1 + (
        ptx_block_len(cfg) if actor and cfg.data.ptx is not None else 0)
    return min(tokens, rows * per_row)


def train_logit_positions(cfg: Config, tokens: int) -> int:
    """``logit_positions`` of the actor's largest training micro-batch of ``tokens``: of
    ppo.micro_batch_size rows, or under ppo.micro_batch_tokens of a mini-batch's at most."""
    p = cfg.ppo
    rows = p.micro_batch_size if p.micro_batch_tokens is None else p.mini_batch_size
    return logit_positions(cfg, tokens, rows, actor=True)


def score_logits(cfg: Config, shape: ModelShape, tokens: int, rows: int) -> float:
    """A no-grad scoring forward's logits (old log-probs, the reference's) for ``tokens``
    positions of a rollout of ``rows``: the model's logits, and the fp32 copies of one block
    of rows at a time (``policy_token_logprobs``)."""
    p = cfg.ppo
    held = p.micro_batch_size if p.score_batch_tokens is None else rows
    logits = logit_positions(cfg, tokens, held) * shape.vocab
    return dtype_bytes(cfg.system.dtype) * logits + min(12 * logits, LOGPROB_BLOCK_BYTES)


def train_micro_tokens(cfg: Config, seq: int, actor: bool = False) -> int:
    """Token positions of the update's largest micro-batch, sequences of ``seq`` at most:
    ppo.micro_batch_size of them, or ppo.micro_batch_tokens when it is set (never more than a
    mini-batch's). ``actor``: the actor's, where under PPO-ptx each sequence brings a
    pretraining block into the same backward (the budget counts it too)."""
    p = cfg.ppo
    row = seq + (ptx_block_len(cfg) if actor and cfg.data.ptx is not None else 0)
    if p.micro_batch_tokens is None:
        return p.micro_batch_size * row
    return min(p.micro_batch_tokens, p.mini_batch_size * row)


def score_micro_tokens(cfg: Config, rows: int, seq: int) -> int:
    """Token positions of the largest no-grad forward that scores the experience, ``rows``
    sequences of ``seq`` at most in the rollout: ppo.micro_batch_size of them, or
    ppo.score_batch_tokens when it is set (never more than the rollout's)."""
    p = cfg.ppo
    if p.score_batch_tokens is None:
        return p.micro_batch_size * seq
    return min(p.score_batch_tokens, rows * seq)


def plan_memory(cfg: Config, shapes: Shapes, nodes: int, gpus_per_node: int, device: Device,
                headroom: float = 0.1) -> MemoryPlan:
    s, gen = cfg.system, cfg.generation
    gpus = actor_rank_gpus(cfg, nodes * gpus_per_node)  # ZeRO partitions over these
    on_stage = cfg.scorer_rank_models()
    held = cfg.actor_rank_models()
    w = dtype_bytes(s.dtype)
    rows = cfg.widest_rollout
    seq = gen.max_prompt_len + gen.max_new_tokens
    plan = MemoryPlan(capacity=device.mem_gib * GIB, headroom=headroom)
    items = plan.items

    actor = _trained(shapes.actor, False, cfg.model.actor_lora_dim, cfg, gpus, gpus_per_node)
    critic = _trained(shapes.critic, True, cfg.model.critic_lora_dim, cfg, gpus, gpus_per_node) \
        if "critic" in held else ModelStates()  # a critic-free estimator trains none
    for name, st in (("actor", actor), ("critic", critic)):
        items[f"{name}_params"] = st.params
        items[f"{name}_grads"] = st.grads
        items[f"{name}_optimizer"] = st.optimizer
    items["zero3_gathered"] = max(actor.gathered, critic.gathered)
    plan.cpu_per_node = actor.cpu_per_node + critic.cpu_per_node

    ref = shapes.reference
    if "reference" not in held:  # on the stage, or the KL is off
        items["reference"] = items["reference_gathered"] = 0.0
    elif s.partition_reference:
        part = w * ref.params() / gpus
        items["reference"] = 0.0 if s.offload_reference else part
        items["reference_gathered"] = w * ref.largest_module_params()  # frozen: no gradients
        plan.cpu_per_node += part * gpus_per_node if s.offload_reference else 0.0
    else:
        items["reference"] = w * ref.params()
        items["reference_gathered"] = 0.0
    items["reward"] = w * shapes.reward.params(value_head=True) if "reward" in held else 0.0

    # under the stage placement nothing streams on the actor ranks (the critic trains there)
    streamed = cfg.actor_rank_streamed
    # ZeRO-3: the rollout runs on models gathered whole on every rank, the actor and the
    # critic when it streams here (DeepSpeedTrainEngine._gathered_for_generation: with or
    # without the hybrid engine), so that the ranks' forwards need no collective
    items["generation_gathered"] = (w * shapes.actor.params() + (
        w * shapes.critic.params(value_head=True) if "critic" in streamed else 0.0)) \
        if s.zero_stage == 3 else 0.0
    # the hybrid engine's inference containers split over inference_tp_size GPUs (a copy;
    # at one GPU they run on the weights as they are)
    items["hybrid_engine_copy"] = (w * shapes.actor.params() / s.inference_tp_size
                                   if s.hybrid_engine and s.inference_tp_size > 1 else 0.0)
    items.update(rollout_caches(cfg, shapes))
    # a CUDA graph reads its buffers where they are: the static cache and its logits outlive
    # the rollout, through scoring and training
    items["kept_decode_graph"] = (items["actor_kv"] + w * rows * shapes.actor.vocab
                                  if gen.cuda_graph else 0.0)

    items["prefill_activations"] = prefill_activations(cfg, shapes.actor)

    ckpt = s.gradient_checkpointing
    actor_tokens = train_micro_tokens(cfg, seq, actor=True)
    items["activations_train"] = max(
        _activations(shapes.actor, actor_tokens, w, ckpt,
                     train_logit_positions(cfg, actor_tokens)),
        _activations(shapes.critic, train_micro_tokens(cfg, seq), w, ckpt, 0)
        if cfg.ppo.uses_critic else 0.0)
    # no-grad scoring forwards keep one layer's activations, then the logits
    score_tokens = score_micro_tokens(cfg, rows, seq)
    items["activations_score"] = max(
        _activations(shapes.actor, score_tokens, w, False, 0) / shapes.actor.layers,
        score_logits(cfg, shapes.actor, score_tokens, rows))
    items["framework"] = FRAMEWORK_GIB * GIB

    resident = (actor.params + actor.grads + actor.optimizer + critic.params + critic.grads
                + critic.optimizer + items["reference"] + items["reward"] + items["framework"])
    plan.phases = {
        "generate": resident + items["generation_gathered"] + items["hybrid_engine_copy"]
                    + items["actor_kv"] + items["scorer_kv"] + generate_transients(items),
        "score": resident + items["activations_score"] + items["carried_scorer_kv"]
                 + max(items["zero3_gathered"], items["reference_gathered"])
                 + items["kept_decode_graph"],
        "train": resident + items["activations_train"] + items["carried_scorer_kv"]
                 + items["zero3_gathered"] + items["kept_decode_graph"],
    }
    if on_stage:
        scorer_rank_memory(plan, cfg, shapes, gpus)
    return plan
