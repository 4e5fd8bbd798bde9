"""oppo-plan for the Megatron backend (``system.backend: megatron``): memory per GPU and the
cost model's parallel layout when the models are split tensor x pipeline parallel.

What one GPU holds is one (tensor, pipeline) shard of each model, exactly as
``oppo_ds.megatron.convert.hf_to_megatron`` cuts it (``shard_params``, checked against the
converter's shards in tests/test_plan.py): every linear of the stage's layers split over the
tensor ranks, the norms whole, the vocabulary (padded to a multiple of tp) split on the first
stage (embedding) and the last (output layer; a tied model gets its own copy there), the
value head whole on the last stage. Training states follow ``MegatronTrainEngine``: weights,
their gradients, and AdamW over this rank's shard (fp32 master weights, the fp32 gradients
the micro-batches are summed into, two moments: 16 bytes per parameter in bf16, 8 in fp32), not
sharded over data parallel (no distributed optimizer). Caches and activations: the KV cache of
the stage's layers with the key/value heads split over tp; a training micro-batch keeps its
stage's layers' activations, the attention and MLP parts split over tp, the norms' and
residual parts whole (no sequence parallelism), and the full-vocabulary fp32 logits, which
every rank of the replica holds (the loss runs on every rank).

Under ``oppo.placement: stage`` the reward model (and the reference when it streams) is a whole
HF copy on the scorer rank, the job's last GPU, with one set of KV caches per replica (it
serves their rollouts at once); its memory is reported as the ``scorer_rank`` entry of the
phases (the fullest GPU of the job decides the verdict).
"""
from __future__ import annotations

import os

from ..config import Config, ConfigError
from .costs import GIB, Device
from .memory import (FRAMEWORK_GIB, TRAIN_LOGIT_BYTES, MemoryPlan, dtype_bytes,
                     generate_transients, model_states, prefill_activations, rollout_caches,
                     score_logits, scorer_rank_memory, score_micro_tokens, train_logit_positions,
                     train_micro_tokens)
from .shapes import ModelShape, Shapes


def model_split(cfg: Config) -> tuple[int, int]:
    return cfg.system.tensor_parallel, cfg.system.pipeline_parallel


def actor_gpus(cfg: Config, gpus: int) -> int:
    """GPUs holding model shards: all of them, less the stage placement's scorer rank; a
    ``ConfigError`` when they are not whole replicas."""
    tp, pp = model_split(cfg)
    scorer = 1 if cfg.oppo.placement == "stage" else 0
    n = gpus - scorer
    if n < tp * pp or n % (tp * pp):
        extra = " plus the stage placement's scorer rank" if scorer else ""
        raise ConfigError("system.tensor_parallel", f"tensor_parallel={tp} x pipeline_parallel="
                          f"{pp} needs k x {tp * pp} GPUs{extra}, got {gpus}")
    return n


def check_shape(shape: ModelShape, tp: int, pp: int, what: str) -> None:
    if shape.family != "llama":
        raise ConfigError("system.backend", f"megatron converts Llama-family models (Llama, "
                          f"Qwen2) only; the {what} is {shape.family} ({shape.name})")
    for n, size, key in ((shape.heads, tp, "attention heads"), (shape.kv_heads, tp, "key/value heads"),
                         (shape.intermediate, tp, "MLP width"), (shape.layers, pp, "layers")):
        if n % size:
            split = "tensor_parallel" if size == tp and key != "layers" else "pipeline_parallel"
            raise ConfigError(f"system.{split}", f"{size} does not divide the {what}'s {n} {key} "
                                                 f"({shape.name})")


def model_source(cfg: Config, what: str) -> str:
    """Where model ``what`` comes from, as the run resolves it: the reference defaults to the
    actor, the critic to the reward model."""
    m = cfg.model
    fallback = {"reference": m.actor, "critic": m.reward}.get(what)
    value = getattr(m, what)
    return fallback if value is None else value


def check_checkpoint(cfg: Config, what: str, tp: int, pp: int) -> None:
    """The run's own check of a model it converts (``convert.shape_of`` and
    ``check_parallel`` on the HF config, refused as ``system.backend`` as the run refuses
    them) where model ``what``'s source is a local directory with a config.json: the
    planner's shape keeps only the sizes, and maps every model type but gpt2 to Llama, so a
    Mistral, or a Llama with a RoPE scaling the conversion does not compute (yarn, ...), would
    plan as a Llama the run then refuses."""
    source = model_source(cfg, what)
    if source is None or not os.path.isfile(os.path.join(source, "config.json")):
        return  # built from config (tiny, builtin) or a placeholder path: sizes only
    from transformers import AutoConfig

    from ..megatron.convert import check_parallel, shape_of

    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True,
                                            trust_remote_code=cfg.model.trust_remote_code)
        check_parallel(shape_of(config), tp, pp)
    except ValueError as err:
        raise ConfigError("system.backend", f"megatron: the {what} ({source}): {err}") from None


def shard_params(shape: ModelShape, tp: int, pp: int, pp_rank: int, *, lm_head: bool = True,
                 value_head: bool = False) -> int:
    """Parameters of one (tensor, pipeline) shard at pipeline rank ``pp_rank``."""
    h = shape.hidden
    layer = sum(i * o // tp + (o // tp if bias else 0) for i, o, bias in shape.linears()) + 2 * h
    n = shape.layers // pp * layer
    vocab_rows = -(-shape.vocab // tp)  # this rank's rows of the padded vocabulary
    if pp_rank == 0:
        n += vocab_rows * h
    if pp_rank == pp - 1:
        n += h + (vocab_rows * h if lm_head else 0) + (h if value_head else 0)
    return n


def largest_shard(shape: ModelShape, tp: int, pp: int, **heads) -> int:
    """The fullest pipeline stage's shard (the first holds the embedding, the last the head)."""
    return max(shard_params(shape, tp, pp, r, **heads) for r in range(pp))


def _activation_bytes_per_token(shape: ModelShape, w: int, tp: int) -> int:
    """One layer's training activations per token on one tensor rank: norms and residual
    stream whole (4h + h), queries/keys/values, attention output and MLP split over tp."""
    h, q, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    return (5 * h + (2 * q + 2 * kv + 4 * i) // tp) * w


def plan_memory_megatron(cfg: Config, shapes: Shapes, nodes: int, gpus_per_node: int,
                         device: Device, headroom: float = 0.1) -> MemoryPlan:
    s, gen = cfg.system, cfg.generation
    tp, pp = model_split(cfg)
    replicas = actor_gpus(cfg, nodes * gpus_per_node) // (tp * pp)
    held = cfg.actor_rank_models()  # split over tp x pp; the scorer rank's are whole copies
    for what in ("actor", "critic", "reference", "reward"):
        if what in held:
            check_shape(getattr(shapes, what), tp, pp, what)
            check_checkpoint(cfg, what, tp, pp)
    w = dtype_bytes(s.dtype)
    rows = cfg.widest_rollout
    seq = gen.max_prompt_len + gen.max_new_tokens
    on_stage = cfg.scorer_rank_models()
    plan = MemoryPlan(capacity=device.mem_gib * GIB, headroom=headroom)
    items = plan.items

    for name, value_head in (("actor", False), ("critic", True)):
        if name not in held:  # a critic-free estimator
            items.update(critic_params=0.0, critic_grads=0.0, critic_optimizer=0.0)
            continue
        shard = largest_shard(getattr(shapes, name), tp, pp, lm_head=not value_head,
                              value_head=value_head)
        st = model_states(shard, shard, 0, zero_stage=0, offload=False, gpus=1,
                          gpus_per_node=gpus_per_node, dtype=s.dtype)
        items[f"{name}_params"], items[f"{name}_grads"] = st.params, st.grads
        items[f"{name}_optimizer"] = st.optimizer
    for name, value_head in (("reference", False), ("reward", True)):
        # none with the KL off, beside model.reward_function, or on the scorer rank
        items[name] = w * largest_shard(getattr(shapes, name), tp, pp, lm_head=not value_head,
                                        value_head=value_head) if name in held else 0.0

    # the stage's layers, heads split over tp
    items.update(rollout_caches(cfg, shapes, split=tp * pp))

    # (the last stage's logits are gathered over tp: every rank of the replica holds them whole)
    items["prefill_activations"] = prefill_activations(cfg, shapes.actor, tp)

    def activations(shape: ModelShape, logit_positions: int, tokens: int) -> float:
        layer = _activation_bytes_per_token(shape, w, tp) * tokens
        if s.gradient_checkpointing:  # each layer's input (whole on every rank), one layer whole
            out = shape.layers // pp * shape.hidden * w * tokens + layer
        else:
            out = shape.layers // pp * layer
        return out + TRAIN_LOGIT_BYTES * logit_positions * shape.vocab

    actor_tokens = train_micro_tokens(cfg, seq, actor=True)
    items["activations_train"] = max(
        activations(shapes.actor, train_logit_positions(cfg, actor_tokens), actor_tokens),
        activations(shapes.critic, 0, train_micro_tokens(cfg, seq))
        if cfg.ppo.uses_critic else 0.0)
    score_tokens = score_micro_tokens(cfg, rows, seq)
    items["activations_score"] = max(activations(shapes.actor, 0, score_tokens)
                                     / (shapes.actor.layers // pp),
                                     score_logits(cfg, shapes.actor, score_tokens, rows))
    items["framework"] = FRAMEWORK_GIB * GIB

    resident = sum(items[k] for k in ("actor_params", "actor_grads", "actor_optimizer",
                                      "critic_params", "critic_grads", "critic_optimizer",
                                      "reference", "reward", "framework"))
    plan.phases = {
        "generate": resident + items["actor_kv"] + items["scorer_kv"]
                    + generate_transients(items),
        "score": resident + items["activations_score"] + items["carried_scorer_kv"],
        "train": resident + items["activations_train"] + items["carried_scorer_kv"],
    }
    if on_stage:  # whole HF copies on the last GPU, one set of caches per replica's sender
        scorer_rank_memory(plan, cfg, shapes, replicas)
    return plan
