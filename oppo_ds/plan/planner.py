"""oppo-plan's logic: a config, a cluster and a device in; memory per GPU and the predicted
step time of every schedule out (a pure function of its inputs: no model is built)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from ..config import Config, ConfigError
from ..config_checks import ptx_block_len
from . import megatron
from .costs import Device
from .memory import actor_rank_gpus, dtype_bytes, plan_memory
from .shapes import Shapes, resolve_shapes
from .simulate import MODES, CostModel, Layout, LengthDist, Schedule, SimResult, StepSimulator

MAX_GROUPS = 16  # decode groups simulated; more only move the slowest group's tail a little
BUILTIN_PROMPT_LEN = 11  # <bos> mood, up to 8 context letters, "->" (oppo_ds.workload)
ORACLE_PROMPT_LEN = 32   # the length oracle's prompts: 8-32 random ids, left-padded


def mode_config(cfg: Config, mode: str) -> Config:
    """``cfg`` under one schedule. sequential: no streaming, Delta 0 (the baseline, whatever
    the config says); intra: streaming; inter: overcommitment; oppo: both. A streaming mode
    keeps the config's chunk size when the config streams, else `auto` (oppo-bench's choice);
    an overcommitting mode keeps the config's Delta when it has one, else `auto`."""
    if mode not in MODES:
        raise ConfigError("--modes", f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    o = cfg.oppo
    streams, overcommits = mode in ("intra", "oppo"), mode in ("inter", "oppo")
    chunk = o.chunk_size if o.streaming else "auto"
    stream_to = list(o.stream_to)
    if cfg.system.partition_reference:  # a partitioned reference cannot stream (config.py)
        stream_to = [k for k in stream_to if k != "reference"]
    oppo = dataclasses.replace(o, streaming=streams, chunk_size=chunk, stream_to=stream_to,
                               placement=o.placement if streams else "inline",
                               overcommit=(o.overcommit or "auto") if overcommits else 0)
    return dataclasses.replace(cfg, oppo=oppo)


def prompt_len(cfg: Config) -> int:
    """Tokens of a left-padded prompt batch."""
    if cfg.data.prompts == "builtin":
        return ORACLE_PROMPT_LEN if cfg.workload.kind == "length_oracle" else BUILTIN_PROMPT_LEN
    return cfg.generation.max_prompt_len


def layout(cfg: Config, nodes: int, gpus_per_node: int, max_groups: int = MAX_GROUPS) -> Layout:
    s, p = cfg.system, cfg.ppo
    gpus = nodes * gpus_per_node
    per_prompt = cfg.data.samples_per_prompt if p.group_baseline else 1
    ptx = ptx_block_len(cfg) if cfg.data.ptx is not None else 0  # PPO-ptx: a block a row
    if s.backend == "megatron":  # a decode group is one model replica; gpus: the replicas
        tp, pp = megatron.model_split(cfg)
        replicas = megatron.actor_gpus(cfg, gpus) // (tp * pp)
        return Layout(batch=p.batch_size, micro=p.micro_batch_size, mini=p.mini_batch_size,
                      epochs=p.ppo_epochs, prompt_len=prompt_len(cfg),
                      max_defer=cfg.oppo.max_defer_steps, tp=1,
                      groups=min(replicas, max_groups), gpus=replicas,
                      gpus_per_node=gpus_per_node, nodes=nodes, per_prompt=per_prompt,
                      micro_tokens=p.micro_batch_tokens, score_tokens=p.score_batch_tokens,
                      ptx_block=ptx)
    actors = actor_rank_gpus(cfg, gpus)  # stage: the scorer rank's GPU decodes nothing
    tp = s.inference_tp_size if s.hybrid_engine else 1
    if actors % tp:
        less = ", less the stage placement's scorer rank" if actors < gpus else ""
        raise ConfigError("system.inference_tp_size", f"{tp} does not divide the {actors} GPUs "
                                                      f"({nodes} nodes x {gpus_per_node}{less})")
    gpus = actors
    return Layout(batch=p.batch_size, micro=p.micro_batch_size, mini=p.mini_batch_size,
                  epochs=p.ppo_epochs, prompt_len=prompt_len(cfg), max_defer=cfg.oppo.max_defer_steps,
                  tp=tp, groups=min(gpus // tp, max_groups), gpus=gpus, gpus_per_node=gpus_per_node,
                  nodes=nodes, per_prompt=per_prompt, micro_tokens=p.micro_batch_tokens,
                  score_tokens=p.score_batch_tokens, ptx_block=ptx)


def cost_model(cfg: Config, shapes: Shapes, device: Device, lay: Layout) -> CostModel:
    s, m = cfg.system, cfg.model
    split, whole = (1, 1), frozenset()
    if s.backend == "megatron":
        split = megatron.model_split(cfg)
        whole = frozenset(cfg.scorer_rank_models())  # HF copies on the scorer rank (stage)
    return CostModel(device, shapes, lay, dtype_bytes=dtype_bytes(s.dtype), zero_stage=s.zero_stage,
                     model_split=split, whole_scorers=whole,
                     offload=s.offload, checkpointing=s.gradient_checkpointing,
                     lora_only=m.only_optimize_lora, hybrid_engine=s.hybrid_engine,
                     partition_reference=s.partition_reference, offload_reference=s.offload_reference,
                     lora_dims={"actor": m.actor_lora_dim, "critic": m.critic_lora_dim},
                     critic=cfg.ppo.uses_critic, reference=cfg.ppo.uses_reference,
                     reward=cfg.model.uses_reward_model)


def length_dist(cfg: Config, lengths: Optional[Sequence[int]] = None) -> LengthDist:
    w = cfg.workload
    return LengthDist(cfg.generation.max_new_tokens, float(w.median_len), w.tail_sigma,
                      tuple(int(x) for x in lengths) if lengths else None)


def schedules(cfg: Config, mode: str) -> list[Schedule]:
    """The schedule(s) a mode runs: one per chunk-size candidate under `chunk_size: auto`
    (the planner keeps the fastest, as the online controller would)."""
    mode_cfg = mode_config(cfg, mode)
    o = mode_cfg.oppo
    streamed = tuple(mode_cfg.streamed_scorers)
    delta = (o.delta_max if o.overcommit == "auto" else o.overcommit)
    chunks = list(o.chunk_candidates) if o.chunk_size == "auto" else [o.chunk_size]
    if not streamed:
        chunks = chunks[:1]
    # the hybrid engine's inference kernels (its point on GPUs) make the trainer recompute the
    # actor's log-probs (trainer.actor_streams)
    own = o.streams_actor and not cfg.system.hybrid_engine
    return [Schedule(mode, streamed, o.placement, c, delta, actor_streams=own) for c in chunks]


def simulate_modes(cfg: Config, sim: StepSimulator, modes: Sequence[str] = MODES, steps: int = 30,
                   seed: int = 0) -> dict[str, SimResult]:
    out = {}
    for mode in modes:
        runs = [sim.run(s, steps=steps, seed=seed) for s in schedules(cfg, mode)]
        out[mode] = min(runs, key=lambda r: r.mean("step_s"))
    return out


def plan(cfg: Config, nodes: int, gpus_per_node: int, device: Device, *,
         shape_overrides: Optional[dict[str, str]] = None, headroom: float = 0.1,
         lengths: Optional[Sequence[int]] = None, steps: int = 30, seed: int = 0,
         modes: Sequence[str] = MODES) -> dict:
    """The planner's answer as a JSON-ready dict."""
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError("--nodes" if nodes < 1 else "--gpus-per-node", "must be >= 1")
    if not 0 <= headroom < 1:
        raise ConfigError("--headroom", f"must be in [0, 1), got {headroom}")
    shapes = resolve_shapes(cfg, shape_overrides)
    if cfg.system.backend == "megatron":
        memory = megatron.plan_memory_megatron(cfg, shapes, nodes, gpus_per_node, device, headroom)
    else:
        memory = plan_memory(cfg, shapes, nodes, gpus_per_node, device, headroom)
    lay = layout(cfg, nodes, gpus_per_node)
    sim = StepSimulator(cost_model(cfg, shapes, device, lay), length_dist(cfg, lengths))
    results = simulate_modes(cfg, sim, modes, steps, seed)
    base = results.get("sequential")
    out = {
        "device": device.name, "nodes": nodes, "gpus_per_node": gpus_per_node,
        "models": {k: {"shape": getattr(shapes, k).name,
                       "params": getattr(shapes, k).params(value_head=k in ("reward", "critic"))}
                   for k in ("actor", "reference", "reward", "critic")
                   # a critic-free estimator has no critic, the KL off no reference, a reward
                   # function no reward model
                   if (k != "critic" or cfg.ppo.uses_critic)
                   and (k != "reference" or cfg.ppo.uses_reference)
                   and (k != "reward" or cfg.model.uses_reward_model)},
        "rows_per_rank": {"batch_size": cfg.ppo.batch_size, "delta": cfg.oppo.largest_delta,
                          "widest_rollout": cfg.widest_rollout},
        **memory.to_json(),
        "predicted_step_s": {m: round(r.mean("step_s"), 6) for m, r in results.items()},
        "predicted_speedup": ({m: round(base.mean("step_s") / r.mean("step_s"), 4)
                               for m, r in results.items()} if base else {}),
        "modes": {m: r.to_json() for m, r in results.items()},
        "simulation": {"steps": steps, "seed": seed, "decode_groups": lay.groups, "tp": lay.tp,
                       "costs": device.measured or "assumed",
                       "backend": cfg.system.backend,
                       "model_split": {"tensor_parallel": cfg.system.tensor_parallel,
                                       "pipeline_parallel": cfg.system.pipeline_parallel},
                       "prompt_len": lay.prompt_len,
                       "lengths": "given list" if lengths else
                       f"log-normal median {cfg.workload.median_len}, sigma {cfg.workload.tail_sigma}, "
                       f"capped at {cfg.generation.max_new_tokens}"},
    }
    return out
