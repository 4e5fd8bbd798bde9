"""The PPO trainer: one step is generate -> score -> advantages -> update, each a named,
timed phase. This is the sequential baseline; the OPPO techniques switch on inside the
same step (streaming replaces generate+score, overcommitment changes which sequences a
step keeps), so every speedup is measured against this code. The advantages and the
update are ``ppo_update.py``'s (a mixin), checkpoints ``resume.py``'s, the held-out evaluation
``evaluation.py``'s, the final export ``export.py``'s, the stage placement's side
``stage_placement.py``'s, DAPO's dynamic sampling rounds ``filter_rounds.py``'s, the rollout
pool's take ``pool_rollout.py``'s, the step's experience (the scoring of finished responses
outside the stream) ``scoring.py``'s.
"""
from __future__ import annotations

import logging
import os
import random
import time
from contextlib import contextmanager, nullcontext
from typing import Optional

import torch
import torch.distributed as dist

from . import comm
from .algo import masked_mean, overlong_penalty
from .checkpoint import CheckpointManager, check_tag, checkpoint_root
from .config import Config, ConfigError, save_config
from .config_checks import check_evaluation_set, optimizer_updates, ptx_block_len
from .config_paths import check_export_targets
from .config_types import require
from .data import PromptStream, check_same_on_every_rank, left_pad, repeat_samples
from .datafiles import DataError, read_prompt_rows
from .experience import Experience
from .ema import ActorEMA
from .evaluation import Evaluating, text_records
from .export import Exporting
from .filter_rounds import FilterRounds
from .finite import NonFiniteError, check_experience, check_update
from .rollout.generate import (Generation, SamplingParams, cudnn_attention, generate,
                               switch_interval, target_lengths)
from .rollout.controllers import ChunkSizeController, DeltaController, Pipeline
from .rollout import static_decode
from .rollout.static_length import run_cache_length
from .rollout.pool import RolloutPool
from .rollout.stage import RemoteScorers
from .rollout.stage_stream import stage_stream_generate
from .rollout.streaming import StreamingScorer, TimelineEvent, chrome_trace, stream_generate
from .rollout.waste import tail_waste
from .scoring import Scoring
from .pool_rollout import PoolRollout
from .ppo_update import PPOUpdate
from .ptx import ptx_blocks
from .preemption import STOPPED_MARK, StopOnSignal, signal_name, signal_number
from .resume import Resumable
from .reward_fn import RewardFunctions
from .shared_dirs import check_shared_dirs
from .sources import (check_paths, check_prompt_format, check_sources, end_ids, load_prompts,
                      prompts_label, resolve_sources, reward_normalization, run_tokenizer,
                      uses_builtin_workload)
from .stage_placement import StagePlacement
from .telemetry import PhaseTimer, Telemetry, check_wandb_installed, profiled

logger = logging.getLogger(__name__)

def streaming_metrics(timings: list, inline: bool = False) -> dict:
    """Per-step telemetry of the streaming scorers over the step's rollouts (more than one
    with ``ppo.filter_groups``' later rounds): busy time, the shares of it done before the
    actor's last token and while the actor was busy, and the scoring tails left after the
    actor's last token, summed. ``inline``: the scorers ran between the actor's chunks, so
    their work before its last token is time the actor waited (``oppo-bench`` takes it out
    of the actor's decode time, as the tail)."""
    busy = sum(t.scoring_busy_s for t in timings)
    between = sum(t.scoring_busy_s * t.scoring_hidden_frac for t in timings) if inline else 0.0

    def share(name: str) -> float:  # weighted by each rollout's busy time
        return sum(getattr(t, name) * t.scoring_busy_s for t in timings) / busy if busy else 0.0

    return {"stream/scorer_busy_s": busy,
            "stream/scoring_tail_s": sum(t.scoring_tail_s for t in timings),
            "stream/scoring_between_chunks_s": between,
            "stream/scoring_hidden_frac": share("scoring_hidden_frac"),
            "stream/scoring_overlap_frac": share("scoring_overlap_frac"),
            "stream/chunks": sum(t.chunks for t in timings)}


def actor_streams(requested: bool, hybrid_engine_path: str) -> bool:
    """Whether PPO's old log-probs come from the actor's decode (``oppo.stream_to`` holding
    ``actor``, with streaming on). They are the training forward's only when decoding runs
    that same forward: where DeepSpeed's hybrid engine decodes with its inference kernels
    (fused kernels whose log-probs differ from the training forward's, the reason
    DeepSpeed-Chat recomputes) they are recomputed after generation, as the critic's values
    are when the critic does not stream; the trainer logs it at start."""
    from .engines.deepspeed_engine import HYBRID_KERNELS

    return requested and hybrid_engine_path != HYBRID_KERNELS


class PPOTrainer(PPOUpdate, PoolRollout, FilterRounds, StagePlacement, Resumable, Evaluating, Exporting,
                 Scoring):
    def __init__(self, cfg: Config, *, evaluate_only: bool = False):
        """``evaluate_only``: for ``evaluate_only()`` alone (``oppo-train --evaluate``): the run's
        logs and configuration in ``logging.output_dir`` are neither opened nor rewritten."""
        self.cfg = cfg
        self.evaluating_only = evaluate_only
        if not evaluate_only:  # before anything is built (an evaluation exports nothing)
            check_export_targets(cfg)
        else:
            check_evaluation_set(cfg)
        self.preempted: Optional[str] = None  # the signal that stopped training early
        self.kl_coef = cfg.ppo.kl_coef  # adapted after every step with ppo.kl_target
        if cfg.system.torch_threads:
            torch.set_num_threads(cfg.system.torch_threads)
        # the stage placement: an error once this process's links are open is said to the
        # other processes of the stage, which would otherwise see a closed connection only
        with self._stage_failures():
            self._set_up()

    def _set_up(self) -> None:
        cfg = self.cfg
        scorer_rank = self._join_world()
        src, eos = self._read_inputs(scorer_rank)
        s = cfg.system
        common = dict(vocab_size=len(self.tokenizer), dtype=s.dtype,
                      trust_remote_code=cfg.model.trust_remote_code, seed=cfg.seed)
        if scorer_rank:
            self._init_scorer_rank(src, common)
            return
        self._build_engines(src, common)
        g = cfg.generation
        self.sampling = SamplingParams(max_new_tokens=g.max_new_tokens, eos_token_ids=eos,
                                       pad_token_id=self.tokenizer.pad_token_id,
                                       temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                                       sync_every=g.sync_every, static_cache=g.static_cache,
                                       cuda_graph=g.cuda_graph, static_length=(
                                           run_cache_length(g.max_prompt_len, g.max_new_tokens,
                                                            g.sync_every, cfg.oppo.overcommits)
                                           if g.static_cache else 0),
                                       static_rows=cfg.widest_rollout)
        self._build_rollout_state()
        self._resume_and_announce(src)

    # ------------------------------------------------------------------ setup phases

    def _join_world(self) -> bool:
        """Join torch.distributed (or, on the stage's scorer process, link to the actor ranks)
        and seed; whether this process is the stage's scorer rank."""
        from .engines import init_distributed_if_needed

        cfg = self.cfg
        # oppo.placement=stage: the last process scores, outside torch.distributed's world;
        # the others, the actor ranks, form the world by themselves (stage_placement.py)
        self.stage = self._stage_layout() if cfg.oppo.placement == "stage" else None
        scorer_rank = self.stage is not None and self.stage.is_scorer
        self.stage_links = {}
        if scorer_rank:
            self._open_stage_links()  # waits for the actor ranks to have prepared the workload
        else:
            init_distributed_if_needed()
        self.dp_group = None  # the world: every actor rank
        self.rank = self.stage.rank if scorer_rank else dist.get_rank()
        self.world_size = len(self.stage.actor_ranks) if scorer_rank else dist.get_world_size()
        self.is_main = self.rank == 0
        if not scorer_rank:  # before the workload is prepared: whole model replicas or nothing
            try:
                cfg.system.check_world(self.world_size)
            except ConfigError as err:
                raise err.under("system") from None
            # an evaluation too: it reads the checkpoint `latest` names, on every rank
            check_shared_dirs(self._shared_dirs())
        random.seed(cfg.seed + self.rank)
        torch.manual_seed(cfg.seed)
        return scorer_rank

    def _shared_dirs(self) -> dict[str, str]:
        """The directories every actor rank must see as one, by config key."""
        dirs = {"logging.output_dir": self.cfg.logging.output_dir}
        if uses_builtin_workload(self.cfg):
            dirs["workload.cache_dir"] = self.cfg.workload.cache_dir
        return dirs

    def _read_inputs(self, scorer_rank: bool):
        """Everything read before any engine loads, so that a bad path, prompt row, token id or
        evaluation set stops the run at once: (the sources, the ids that end a response)."""
        cfg = self.cfg
        require(not cfg.generation.cuda_graph or torch.cuda.is_available(), "generation.cuda_graph",
                "needs a CUDA GPU, and this process sees none: set generation.cuda_graph: false")
        src = self.sources = resolve_sources(cfg, self.rank)
        check_paths(cfg, src)
        self.tokenizer = run_tokenizer(cfg, src)
        check_prompt_format(cfg, src, self.tokenizer)
        self.builtin_prompts = src.builtin_prompts
        if self.stage is not None and not scorer_rank:
            self._open_stage_links()  # after rank 0 prepared the workload (resolve_sources)
        # a reward function in place of the reward model: loaded before any prompt or engine,
        # and given each response's prompt row as read (by row id)
        self.reward_fn = RewardFunctions(cfg.model.reward_functions, cfg.model.reward_weights) \
            if not cfg.model.uses_reward_model else None
        self.prompt_rows: dict[str, tuple] = {}
        self.eval_rows: dict[str, tuple] = {}
        self.prompts = None if scorer_rank else self._load_prompts(src)
        # read before any engine loads, so that a bad evaluation set stops the run at once
        self.eval_prompts = self._load_eval_prompts() if cfg.eval.enabled and not scorer_rank else []
        self.ptx_blocks = self._load_ptx() if cfg.data.ptx is not None and not scorer_rank else None
        check_sources(cfg, src, self.tokenizer, log=self.is_main)  # every rank: all stop alike
        if not self.evaluating_only:  # an evaluation logs to no wandb run
            check_wandb_installed(cfg.logging.wandb_project)
        # before any engine, so that a bad id stops the run at once; under the length oracle
        # only the targets end a response: a random model's EOS is noise
        eos = end_ids(cfg, src, self.tokenizer, log=self.is_main)
        self.reward_norm = reward_normalization(cfg, src)
        if cfg.checkpoint.resume not in ("auto", "never") and not scorer_rank:  # a tag
            # before any engine is built; an evaluation loads the actor alone
            check_tag(checkpoint_root(cfg), cfg.checkpoint.resume,
                      ("actor",) if self.evaluating_only else None)
        return src, eos

    def _build_engines(self, src, common: dict) -> None:
        """The actor rank's engines (actor, critic, reference, reward, as configured), the
        groups every actor rank decides over, and the stage's senders."""
        from .engines.factory import build_models

        cfg = self.cfg
        p, s = cfg.ppo, cfg.system
        engine_args = dict(total_steps=optimizer_updates(cfg), weight_decay=p.weight_decay,
                           betas=tuple(p.adam_betas), eps=p.adam_eps, warmup_steps=p.warmup_steps,
                           scheduler=p.lr_schedule, micro_batch_size=p.micro_batch_size,
                           gradient_accumulation_steps=p.mini_batch_size // p.micro_batch_size,
                           zero_stage=s.zero_stage, offload=s.offload, dtype=s.dtype,
                           grad_clip=p.grad_clip, seed=cfg.seed)
        # an evaluation answers with the actor and scores with the reward model: no critic,
        # reference or average of the actor's weights is built for it (nor memory spent)
        models = build_models(cfg, src, common, engine_args, evaluating=self.evaluating_only)
        self.actor, self.critic = models.actor, models.critic
        self.reference, self.reward = models.reference, models.reward
        self.device = self.actor.device
        self.ema = ActorEMA(self.actor.module, cfg.model.actor_ema_beta) \
            if cfg.model.actor_ema and not self.evaluating_only else None
        self.actor_streams = actor_streams(cfg.oppo.streams_actor, self.actor.hybrid_engine_path)
        if cfg.oppo.streams_actor and not self.actor_streams and self.is_main:
            logger.info("oppo.stream_to holds actor, but the hybrid engine decodes with DeepSpeed's "
                        "inference kernels, whose log-probs differ from the training forward's: "
                        "the actor's old log-probs are recomputed after generation")
        # a model-parallel backend (megatron) has fewer data-parallel ranks than processes: the
        # ranks of one model replica must draw the same prompts and sample the same tokens
        model_parallel_dp = getattr(self.actor, "data_parallel_group", None)
        self.world_size = self.actor.world_size
        self.dp_group = model_parallel_dp
        # What every actor rank must decide alike (the chunk size, Delta, stopping on a signal)
        # is agreed over all of them: under Megatron the data-parallel group holds one rank of
        # each model replica only, and the other ranks of a replica must stop, stream and
        # overcommit exactly as it does (their collectives pair up token by token)
        self.actor_group = None  # the world
        self.actor_ranks = dist.get_world_size()
        # stage: one rank per model replica streams (Megatron: its first), and shares the scores
        self.remote = self.replica = None
        if self.stage is not None:
            if self.rank in self.stage.senders:
                # the stage keeps deferred rows in its frozen scorers from step to step; its
                # critic copy is rebuilt every rollout from every row, with this step's weights
                self.remote = RemoteScorers(self.stage_links[self.rank], carry=True,
                                            refresh=self.critic_on_stage)
            self._critic_sent = None  # the critic version the stage holds (step count)
            self.critic_send_s = 0.0
            if model_parallel_dp is not None and len(self.stage.senders) < self.actor_ranks:
                self.replica = self._stage_replica()
        if cfg.system.packing_samples:
            self._check_packing()

    def _check_packing(self) -> None:
        """system.packing_samples: every model this rank runs over whole sequences takes
        packed ones (``packing_problem``), or the run stops naming it. Every rank checks
        alike, before the first step: the forwards of a ZeRO-3 or Megatron model are
        collective, and what one rank finds stops every rank."""
        from .experience import PACKING_PROBLEMS, packing_problem

        def logits(model):
            return lambda inputs: model(**inputs).logits

        def values(model):
            return lambda inputs: model(**inputs).values

        def engine(wrapped, output):
            return lambda inputs: wrapped.forward_no_grad(lambda m: output(m)(inputs))

        models = {}
        if not self.evaluating_only:
            models["model.actor"] = engine(self.actor, logits)
            if self.critic is not None:
                models["model.critic"] = engine(self.critic, values)
            if self.reference is not None:
                models["model.reference"] = logits(self.reference)
        if self.reward is not None:
            models["model.reward"] = values(self.reward)
        half = self.cfg.system.dtype != "fp32"
        found = []  # per model: 0, or 1 + the index of its problem in PACKING_PROBLEMS
        for forward in models.values():
            with torch.no_grad():
                problem = packing_problem(forward, len(self.tokenizer), self.device, half)
            found.append(0 if problem is None else 1 + PACKING_PROBLEMS.index(problem))
        # agreed over every actor rank: a rank that stopped alone would leave the others
        # waiting in the next collective
        found = comm.all_reduce_ints(found, op=dist.ReduceOp.MAX)
        for key, code in zip(models, found):
            require(code == 0, "system.packing_samples",
                    f"{key}: {PACKING_PROBLEMS[code - 1]}; set system.packing_samples: false "
                    "for this model")

    def _build_rollout_state(self) -> None:
        """The sampling generators, the prompt streams, the chunk-size controller, the rollout
        pool and Delta's controller."""
        cfg = self.cfg
        p = cfg.ppo
        data_rank = self.actor.rank
        # Separate generators, so that e.g. a different number of PPO epochs does not
        # change which responses are sampled.
        self.sample_gen = torch.Generator().manual_seed(cfg.seed * 1000 + data_rank)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed * 1000 + 500 + data_rank)
        # whole prompts: data.samples_per_prompt rows each
        self.stream = PromptStream(self.prompts, p.batch_size // cfg.data.samples_per_prompt, cfg.seed,
                                   data_rank, self.world_size, shuffle=cfg.data.shuffle)
        # PPO-ptx: blocks of pretraining text, a micro-batch of them beside each of experience
        self.ptx_stream = None if self.ptx_blocks is None else PromptStream(
            self.ptx_blocks, p.micro_batch_size, cfg.seed + 1, data_rank, self.world_size, shuffle=True)
        o = cfg.oppo
        self.chunk_ctl = ChunkSizeController(
            candidates=tuple(o.chunk_candidates), explore_every=o.chunk_explore_every,
            overlapped=o.placement != "inline") if o.streaming and o.chunk_size == "auto" else None
        # inter-step overlap: the pool of B + Delta sequences, carried from step to step
        # a group baseline compares a prompt's responses: the pool takes them together
        group = cfg.data.samples_per_prompt if p.group_baseline else 1
        self.pool = RolloutPool(p.batch_size, o.max_defer_steps, group_size=group) \
            if o.overcommits else None
        self.delta_ctl = DeltaController(o.delta_min, o.delta_max, o.delta_window, step_size=group) \
            if o.overcommit == "auto" else None
        self.carried_scorers: dict[str, StreamingScorer] = {}  # frozen scorers' caches, by kind
        self.step_count = 0

    def _resume_and_announce(self, src) -> None:
        """Resume from the latest checkpoint (checkpoint.resume), then open the telemetry and
        save and log the run's configuration (not for an evaluation alone)."""
        cfg, p = self.cfg, self.cfg.ppo
        self.ckpt = CheckpointManager(checkpoint_root(cfg), rank=self.rank,
                                      world_size=self.actor_ranks,  # a file each
                                      keep_last=cfg.checkpoint.keep_last,
                                      evaluating=self.evaluating_only)
        self._maybe_resume()
        if self.evaluating_only:  # a run's history is its own: nothing truncated or rewritten
            self.telemetry = None
            return
        lg = cfg.logging
        wandb = None if lg.wandb_project is None else dict(
            project=lg.wandb_project, name=lg.wandb_run_name, config=cfg.to_dict())
        self.telemetry = Telemetry(lg.output_dir, enabled=self.is_main, tensorboard=lg.tensorboard,
                                   progress=lg.progress, total_steps=cfg.steps,
                                   start_step=self.step_count, log_every=lg.log_every,
                                   wandb=wandb)
        if self.is_main:
            save_config(cfg, os.path.join(cfg.logging.output_dir, "config.yaml"))
            reward = src.reward if self.reward_fn is None else f"the function {self.reward_fn.spec}"
            logger.info("actor %s | critic %s | reward %s | reference %s | %d prompts | %d rank(s)"
                        " | hybrid engine: %s", src.actor,
                        src.critic if self.critic is not None else f"none ({p.advantage_estimator})",
                        reward, src.reference if p.uses_reference else "none (ppo.kl_coef 0)",
                        len(self.prompts), self.world_size, self.actor.hybrid_engine_path)
            if cfg.oppo.placement != "inline" and not cfg.oppo.streaming:
                # (stage without streaming is refused; colocated is accepted so that one set of
                # overrides serves every oppo-bench mode and the TRL peer)
                logger.warning("oppo.placement=%s has no effect with oppo.streaming=false: "
                               "nothing streams, the scorers run after the decode; set "
                               "oppo.streaming=true to overlap them", cfg.oppo.placement)

    # ------------------------------------------------------------------ setup helpers

    def _load_prompts(self, src):
        prompts, rows = load_prompts(self.cfg, src, self.tokenizer, log=self.is_main)
        # each rank read its own copy: one list, or the epochs' shares overlap and miss prompts
        check_same_on_every_rank(prompts, prompts_label(src.prompts))
        if rows is not None and self.reward_fn is not None:
            self.prompt_rows = {r.id: (r.text_or_messages, r.fields) for r in rows}
        if len(prompts) < self.world_size:
            raise DataError(f"{prompts_label(src.prompts)}: {len(prompts)} usable prompts for "
                            f"{self.world_size} ranks; every rank needs at least one")
        return prompts

    def _load_ptx(self):
        d = self.cfg.data
        # wikitext's empty rows are skipped (DeepSpeed-Chat tokenises them without complaint)
        rows = read_prompt_rows(d.ptx, prompt_key=d.ptx_key, split=d.split,
                                key_name="data.ptx_key", skip_blank=True)
        blocks = ptx_blocks(rows, self.tokenizer, ptx_block_len(self.cfg), prompts_label(d.ptx))
        check_same_on_every_rank(blocks, prompts_label(d.ptx))
        if len(blocks) < self.world_size:
            raise DataError(f"{prompts_label(d.ptx)}: {len(blocks)} pretraining blocks for "
                            f"{self.world_size} ranks; every rank needs at least one")
        if self.is_main:
            logger.info("PPO-ptx: %d blocks of %d tokens from %s, weight %g", len(blocks),
                        len(blocks[0].input_ids), prompts_label(d.ptx), self.cfg.ppo.ptx_coef)
        return blocks

    # ------------------------------------------------------------------ the PPO step

    def step(self) -> dict:
        """One PPO step (rollout, experience, update); its metrics."""
        system = self.cfg.system
        with cudnn_attention(system.cudnn_attention), switch_interval(system.switch_interval_ms):
            return self._step()

    def _step(self) -> dict:
        timer = PhaseTimer()
        start = time.perf_counter()
        o = self.cfg.oppo
        chunk = timing = None
        streamed, extra = {}, {}
        if o.streaming:
            chunk = self.chunk_ctl.next_chunk_size() if self.chunk_ctl else o.chunk_size
        captured = static_decode.captures()
        with timer.phase("generate"):
            if self.pool is not None:
                # a filtered step may take more rounds from the pool: it defers once, at its end
                keys, groups, gen, streamed, timing, extra, produced, taken = self.rollout_pool(
                    chunk, defer=not self.cfg.ppo.filter_groups)
            else:
                keys, groups, gen, streamed, timing, produced = self._rollout(
                    self.stream.next_batch(), chunk)
        if self.sampling.cuda_graph:  # a capture costs two warm-up forwards and itself
            extra["rollout/graph_captures"] = static_decode.captures() - captured
        timings = [timing] if timing is not None else []  # the step's streaming rollouts
        if timing is not None and self.critic_on_stage:
            # inside generate: the critic's weights to the stage
            extra["stream/critic_weights_s"] = self.critic_send_s
        with timer.phase("score"):
            exp = self.make_experience(keys, gen, streamed)
            exp.groups = None if groups is None else groups.to(self.device)
        if self.chunk_ctl is not None:  # on the first round's cost (ppo.filter_groups adds rounds)
            self._control_chunk_size(chunk, timer.times, timing, produced)
        if self.cfg.ppo.filter_groups:
            exp, filtered, later = self._filter_groups(exp, chunk, timer,
                                                       taken if self.pool is not None else None)
            extra.update(filtered)
            timings += later
        if timings:  # with the later filter rounds' rollouts (the first may have decoded nothing)
            extra["oppo/chunk_size"] = chunk
            extra.update(streaming_metrics(timings, self.cfg.oppo.placement == "inline"))
        with timer.phase("advantages"):
            self.compute_advantages(exp)
            check_experience(exp, self.sources.models, self.cfg.system.dtype, group=self.dp_group)
        with timer.phase("train"):
            train_stats = self.update(exp)
            if self.ema is not None:
                self.ema.update(self.actor.module)
        self.step_count += 1
        metrics = self.step_metrics(exp, train_stats)
        check_update(metrics, self.cfg.system.dtype)
        metrics.update(extra)
        metrics["samples"] = len(exp) * self.world_size
        self._adapt_kl_coef(metrics)
        if self.delta_ctl is not None:
            decision = self.delta_ctl.observe(self.agreed_mean(metrics["reward/mean"]))
            if decision and self.is_main:
                logger.info("step %d: %s", self.step_count, decision)
        metrics.update({f"time/phase/{k}": v for k, v in timer.times.items()})
        metrics["time/step_s"] = time.perf_counter() - start  # writing the trace is not the step's
        every = self.cfg.logging.trace_every
        if every and self.step_count % every == 0 and self.is_main:
            self._write_trace(timer, timings)
        period = self.cfg.logging.sample_period
        self.step_samples = (self.sample_records(exp) if period and self.step_count % period == 0
                             and self.telemetry.enabled else [])
        return metrics

    def _rollout(self, prompts: list, chunk: Optional[int]):
        """Generate (streaming the scorers when configured) ``data.samples_per_prompt``
        responses to each of ``prompts``, without the rollout pool: (row keys, group labels,
        generation, streamed results, streaming timing, tokens generated)."""
        n = self.cfg.data.samples_per_prompt
        batch = repeat_samples(prompts, n)
        keys = [x.id for x in batch]
        groups = torch.arange(len(batch)) // n if n > 1 else None
        targets = target_lengths([p.target_len for p in batch])
        streamed, timing = {}, None
        if self.cfg.oppo.streaming:
            gen, streamed, timing = self.generate_streaming([x.input_ids for x in batch], chunk, targets)
            if self.actor_streams:  # every token was sampled by the current weights
                streamed["actor"] = gen.logprobs
        else:
            gen = self.generate([x.input_ids for x in batch], targets)
        return keys, groups, gen, streamed, timing, float(gen.lengths.sum())

    def agreed_mean(self, value: float) -> float:
        """``value``'s mean over all actor ranks, the same number on each: what every rank must
        decide alike from (Delta, the KL coefficient) is decided from it, not over the
        data-parallel group only (a Megatron replica's ranks must decide as one)."""
        total = comm.all_reduce(torch.tensor([value], dtype=torch.float64), group=self.actor_group)
        return (total / self.actor_ranks).item()

    def sample_records(self, exp: Experience) -> list[dict]:
        """The first ``logging.samples`` rows of ``exp`` as text, with their scores."""
        gen = Generation(prompt_ids=exp.prompt_ids, prompt_mask=exp.prompt_mask,
                         response_ids=exp.response_ids, response_mask=exp.response_mask,
                         logprobs=exp.behaviour_logprobs, lengths=exp.response_mask.sum(1).long())
        return text_records(self.tokenizer, exp.prompt_keys, gen, exp.scores, exp.gold,
                            self.sampling.eos_token_ids, self.sampling.max_new_tokens,
                            limit=self.cfg.logging.samples)

    @contextmanager
    def _decoding_contexts(self):
        """(actor, critic or None) in the contexts a rollout decodes in on this rank: the
        actor's generation context, and the critic's when it streams here (not on the stage)."""
        critic = "critic" in self.cfg.actor_rank_streamed
        with self.actor.generation_context() as actor, \
                (self.critic.generation_context() if critic else nullcontext()) as critic_model:
            yield actor, critic_model

    def _streamed_kinds(self) -> list[str]:
        """What streams: the scorers (``Config.streamed_scorers``) and the actor's own
        log-probs when it streams them (``actor_streams``: not where the hybrid engine's
        kernels decode)."""
        return self.cfg.streamed_scorers + ["actor"] * self.actor_streams

    def generate(self, prompt_id_lists, targets: Optional[torch.Tensor] = None):
        ids, mask = left_pad(prompt_id_lists, self.tokenizer.pad_token_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        with self.actor.generation_context() as model:
            return generate(model, ids, mask, self.sampling, self.sample_gen, targets=targets)

    def _write_trace(self, timer: PhaseTimer, timings: list) -> None:
        """Chrome/Perfetto trace of this step: the phases, and with streaming the actor's
        decode chunks and every scorer's prefills of each rollout, on one clock (a rollout
        begins inside its generate phase, after the pool's top-up, the critic's weights
        sent to the stage, ...)."""
        events = list(timer.events)
        for timing in timings:
            offset = timing.start - timer.origin
            events += [(e.lane, e.name, offset + e.start_s, offset + e.end_s)
                       for e in timing.events]
        path = os.path.join(self.cfg.logging.output_dir, "traces", f"step{self.step_count}.json")
        chrome_trace([TimelineEvent(*e) for e in events], path, step=self.step_count)

    def _control_chunk_size(self, chunk: int, phase_s: dict, timing, tokens: float) -> None:
        """Feed the chunk-size controller this step's rollout cost, averaged over all actor
        ranks so that every rank takes the same decision (not over the data-parallel group
        only: the ranks of a Megatron replica measure different times, and a replica whose
        ranks chose different sizes would call its tensor-parallel scorers a different
        number of times and hang)."""
        tokens = max(tokens, 1.0)
        scorers = len(timing.scorers) if timing is not None else 0
        chunks, busy = (timing.chunks, timing.scoring_busy_s) if timing is not None else (0, 0.0)
        pipe = Pipeline.from_timing(timing) if timing is not None else None
        local = torch.tensor([(phase_s["generate"] + phase_s["score"]) / tokens,
                              chunks * scorers, tokens * scorers, busy, scorers,
                              float(pipe is not None),
                              *(pipe.as_list() if pipe is not None else [0.0] * Pipeline.SIZE)],
                             dtype=torch.float64)
        total = comm.all_reduce(local, group=self.actor_group)
        per_token, calls, scored, busy, scorers = (total[:5] / self.actor_ranks).tolist()
        piped = total[5].item()  # ranks that decoded: the pipeline is their mean
        pipe = Pipeline.from_list((total[6:] / piped).tolist()) if piped else None
        decision = self.chunk_ctl.observe(chunk, per_token, calls, scored, busy,
                                          scorers=round(scorers), pipeline=pipe)
        if decision and self.is_main:
            logger.info("step %d: %s", self.step_count + 1, decision)

    def generate_streaming(self, prompt_id_lists, chunk_size: int,
                           targets: Optional[torch.Tensor] = None):
        """Chunked decoding with the reward model (and the scorers in oppo.stream_to)
        prefilling each chunk as it is decoded: returns (generation, streamed results, timing)."""
        o = self.cfg.oppo
        ids, mask = left_pad(prompt_id_lists, self.tokenizer.pad_token_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        if self.stage is not None:  # the scorers are on the scorer rank
            self._send_critic_to_stage()
            with self.actor.generation_context() as actor:
                return stage_stream_generate(actor, self.remote, ids, mask, self.sampling,
                                             self.sample_gen, chunk_size, targets=targets,
                                             replica=self.replica)
        temp, here = self.cfg.generation.temperature, self.cfg.actor_rank_streamed
        with self._decoding_contexts() as (actor, critic):
            scorers = [StreamingScorer(self.reward, "reward")] if "reward" in here else []
            if "reference" in here:
                scorers.append(StreamingScorer(self.reference, "reference", temperature=temp))
            if critic is not None:
                scorers.append(StreamingScorer(critic, "critic"))
            return stream_generate(actor, scorers, ids, mask, self.sampling, self.sample_gen,
                                   chunk_size, placement=o.placement, targets=targets)

    def step_metrics(self, exp: Experience, train_stats: dict) -> dict:
        """The step's metrics over all ranks: one gather of per-sequence values and one
        all-reduce of the scalar means (not one collective per metric)."""
        columns = [exp.response_mask.sum(1), exp.scores, self._truncated(exp)] + \
            ([exp.gold] if exp.gold is not None else [])
        rows = comm.gather_lists(torch.stack([c.float() for c in columns], 1).tolist(), self.dp_group)
        lengths, scores = [r[0] for r in rows], [r[1] for r in rows]
        metrics = {
            "reward/mean": sum(scores) / len(scores),
            "response/truncated_frac": sum(r[2] for r in rows) / len(rows),
            "response/len_mean": sum(lengths) / len(lengths),
            "response/len_max": max(lengths),
            "response/len_p50": sorted(lengths)[len(lengths) // 2],
            "response/lengths": [int(x) for x in lengths],  # for run-wide quantiles
            # decode slots spent waiting for the longest response when every row decodes to
            # the end of the batch (what overcommitment recovers)
            "rollout/tail_waste_frac": tail_waste(lengths),
            "lr/actor": self.actor.lr(),
        }
        if self.cfg.ppo.overlong_buffer_len:
            metrics["reward/overlong_penalty"] = overlong_penalty(
                torch.tensor(lengths), self.sampling.max_new_tokens, self.cfg.ppo.overlong_buffer_len,
                self.cfg.ppo.overlong_penalty_factor).mean().item()
        if self.critic is not None:
            metrics["lr/critic"] = self.critic.lr()
        if exp.gold is not None:
            metrics["gold/mean"] = sum(r[3] for r in rows) / len(rows)
        names = {"pg_loss": "loss/policy", "vf_loss": "loss/value", "clip_frac": "policy/clip_frac",
                 "entropy": "policy/entropy", "approx_kl": "policy/approx_kl",
                 "value_clip_frac": "value/clip_frac", "actor_grad_norm": "grad_norm/actor",
                 "critic_grad_norm": "grad_norm/critic", "ptx_loss": "loss/ptx",
                 "dual_clip_frac": "policy/dual_clip_frac", "kl_loss": "loss/kl"}
        # with the floats below; with the KL off there is no reference to measure it against
        scalars = {"kl/mean": self._kl_stats["kl"].detach().double().cpu()} \
            if self.cfg.ppo.uses_reference else {}
        scalars.update({names.get(k, f"train/{k}"): torch.tensor(v, dtype=torch.float64)
                        for k, v in train_stats.items()})
        if self.critic is not None:  # every rank's, like kl/mean
            value = masked_mean(exp.old_values, exp.response_mask)
            scalars["value/mean"] = value.detach().double().cpu()
        # and each reward function's (sum, count) of the scores it gave this step, in the same
        # all-reduce (several functions only)
        several = self.reward_fn is not None and len(self.reward_fn.terms) > 1
        totals = self.reward_fn.take_totals() if several else torch.zeros(0, 2, dtype=torch.float64)
        reduced = comm.all_reduce(
            torch.cat([torch.stack(list(scalars.values())), totals.flatten()]), group=self.dp_group)
        metrics.update(zip(scalars, (reduced[:len(scalars)] / self.world_size).tolist()))
        metrics.update({f"reward_fn/{name}/mean": total / count for name, (total, count) in
                        zip(self.reward_fn.names, reduced[len(scalars):].view(-1, 2).tolist())
                        if count} if several else {})
        return metrics

    def close(self) -> None:
        """End of the trainer: the stage's links, then its trained engines and partitioned
        scorers (DeepSpeed would keep their buffers, optimizer state and hooks for the rest
        of the process). Idempotent; the trainer cannot train after."""
        super().close()
        from .engines import release_frozen

        for engine in (getattr(self, "actor", None), getattr(self, "critic", None)):
            if engine is not None:
                engine.close()
        for scorer in (getattr(self, "reference", None), getattr(self, "reward", None)):
            release_frozen(scorer)

    # ------------------------------------------------------------------ the loop

    def train(self) -> Optional[dict]:
        """The run: steps, evaluations, checkpoints (on the stage's scorer rank: serving the
        actor ranks); the summary. Attention off torch's cuDNN backend throughout unless
        ``system.cudnn_attention``."""
        with cudnn_attention(self.cfg.system.cudnn_attention), self._stage_failures():
            return self._train()

    def _profile_stem(self, number: int) -> Optional[str]:
        """Where step ``number``'s profile goes (``logging.profile_step``), on rank 0."""
        if number != self.cfg.logging.profile_step or not self.is_main:
            return None
        return os.path.join(self.cfg.logging.output_dir, "profile", f"step_{number}")

    def _train(self) -> Optional[dict]:
        if self.stage is not None and self.stage.is_scorer:
            return self._serve_as_scorer_rank()
        cfg = self.cfg
        t0 = time.time()
        stop = StopOnSignal(cfg.checkpoint.on_signals)
        stopped = os.path.join(cfg.logging.output_dir, STOPPED_MARK)
        if self.is_main and os.path.exists(stopped):
            os.remove(stopped)
        try:
            with stop:
                start = self.step_count
                # a signal held while the run started (hold_early_signals): stop before step 1
                self.preempted = stop.agreed(self.actor_group)
                if self.preempted:
                    logger.warning("rank %d: stopped by SIG%s before its first step, nothing "
                                   "trained or saved; the same command starts at step %d",
                                   self.rank, self.preempted, self.step_count)
                elif start == 0 and self._eval_due():  # the starting actor: the figures' baseline
                    self._evaluate_and_log()
                while not self.preempted and self.step_count < cfg.steps:
                    number = self.step_count + 1
                    try:
                        with profiled(self._profile_stem(number)):
                            metrics = self.step()
                    except NonFiniteError as err:
                        if self.remote is not None:  # the scorer rank ends too, not in a broken link
                            self.remote.close()
                        raise NonFiniteError(self._nonfinite_message(err, number)) from None
                    self.telemetry.log_step(self.step_count, metrics)
                    self.telemetry.log_samples(self.step_count, self.step_samples,
                                               cfg.logging.print_samples)
                    if self._eval_due():  # before the checkpoint: a resume does not repeat it
                        self._evaluate_and_log()
                    saved = bool(cfg.checkpoint.every) and self.step_count % cfg.checkpoint.every == 0
                    if saved:
                        self.save_checkpoint()
                    if self.remote is not None and self.remote.scorer_signal:  # srun signals every task
                        stop.record(signal_name(self.remote.scorer_signal),
                                    f"the scorer rank ({self.remote.scorer_rank})")
                    self.preempted = stop.agreed(self.actor_group)
                    if self.preempted:
                        if not saved:
                            self.save_checkpoint()
                        logger.warning("rank %d: stopped by SIG%s after step %d with a checkpoint; "
                                       "%s", self.rank, self.preempted, self.step_count,
                                       self._resume_hint("it"))
                        break
                if self.preempted:
                    if self.is_main:  # for a job script: requeue, whatever the exit codes say
                        with open(stopped, "w") as f:
                            f.write(f"SIG{self.preempted} step{self.step_count}\n")
                else:
                    if self._final_eval_due(start):
                        self._evaluate_and_log()
                    # not when a finished run is started again either: re-saving the tag it
                    # loaded clears it first, and a kill then would leave no checkpoint
                    if cfg.checkpoint.final and self.step_count > start and (
                            not cfg.checkpoint.every or self.step_count % cfg.checkpoint.every):
                        self.save_checkpoint()
                    if cfg.checkpoint.export_hf:
                        self.export(cfg.logging.output_dir)
            if self.remote is not None:
                # the scorer rank's train() returns, and knows whether training stopped early
                self.remote.close(signal_number(self.preempted))
        finally:
            extra = {"stopped_by_signal": "SIG" + self.preempted} if self.preempted else {}
            summary = self.telemetry.close({"wall_total_s": time.time() - t0, "world_size": self.world_size,
                                            "hybrid_engine": self.actor.hybrid_engine_path, **extra})
        return summary

    def _nonfinite_message(self, err: NonFiniteError, step: int) -> str:
        """``err`` with the step it stopped at and the checkpoints to go back to (the latest
        holds the weights of the step before, which may be what went wrong)."""
        tags = self.ckpt.tags()
        where = (f"checkpoints under {self.ckpt.root}: {', '.join(tags)} "
                 f"({self._resume_hint('the latest')}; checkpoint.resume=TAG from another)"
                 if tags else "no checkpoint was written")
        return f"step {step}: {err}; {where}"
