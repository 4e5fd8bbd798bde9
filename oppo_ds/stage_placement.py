"""The trainer's side of ``oppo.placement: stage`` (a mixin of ``PPOTrainer``).

The last rank of the world is the scorer stage: it holds the reward model (and the reference
model when it streams) and serves the actor ranks' chunks (``rollout/stage.py``). The actor
ranks train over their own group; the world-wide barriers that remain (checkpoints, the
export) are announced to the scorer rank, which joins them.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch.distributed as dist

from .config import ConfigError
from .models import build_causal_lm, build_value_model
from .rollout.scorer import StreamingScorer
from .rollout.stage import Op, Replica, ScorerStage, StageRanks, serve_round

if TYPE_CHECKING:
    from .trainer import Sources

logger = logging.getLogger("oppo_ds.trainer")  # the trainer's log lines, as before


class StagePlacement:
    """Methods of ``PPOTrainer`` for the stage placement; they read the trainer's ``cfg``,
    ``stage``, ``rank``, ``actor`` and ``remote``."""


    def _split_for_stage(self) -> StageRanks:
        """Collective over the world: the actor ranks' group and one link per actor rank."""
        # DeepSpeed 0.19.8 issues world collectives there that the scorer rank would have to
        # join: ZeRO-3 while it builds an engine and in every forward (runtime/zero/utils.py
        # assert_ints_same_as_other_ranks), the hybrid engine when it is built (RNG broadcast)
        s = self.cfg.system
        if s.zero_stage == 3 or s.hybrid_engine:
            what = "system.zero_stage 3" if s.zero_stage == 3 else "system.hybrid_engine"
            raise ConfigError("oppo.placement", f"stage placement with {what} is not supported "
                              f"yet (DeepSpeed then issues collectives over the whole world, "
                              f"which holds the scorer rank)")
        world = dist.get_world_size()
        if world < 2:
            raise ConfigError("oppo.placement", f"stage needs a rank of its own for the scorers "
                              f"besides the actor ranks: launch N + 1 ranks (deepspeed "
                              f"--num_gpus N+1 --module oppo_ds.train ...), got a world of {world}")
        model_ranks = s.tensor_parallel * s.pipeline_parallel
        if (world - 1) % model_ranks:
            raise ConfigError("oppo.placement", f"stage with tensor_parallel x pipeline_parallel "
                              f"= {model_ranks} needs k x {model_ranks} actor ranks plus the "
                              f"scorer rank, got a world of {world}")
        stage = StageRanks.split_world(s.tensor_parallel, s.pipeline_parallel)
        if dist.get_rank() == 0:
            stream_to = self.cfg.oppo.stream_to
            kinds = ["reward"] + [k for k in stream_to if k == "reference"]
            senders = "" if stage.senders == stage.actor_ranks else \
                f" (streamed by ranks {stage.senders}, one per model replica)"
            logger.info("oppo.placement=stage: rank %d scores (%s) for actor ranks %s%s%s",
                        stage.scorer_rank, ", ".join(kinds), stage.actor_ranks, senders,
                        "; the critic trains, so it does not stream: its values are computed on "
                        "the actor ranks after generation" if "critic" in stream_to else "")
        return stage

    def _init_scorer_rank(self, src: Sources, common: dict) -> None:
        """The scorer rank's models, frozen as the actor ranks would build them, and one
        ScorerStage per streaming actor rank (one per model replica), each with scorers of its
        own over those models (their rollouts are served at the same time)."""
        from .engines import prepare_frozen

        s = self.cfg.system
        if s.backend == "megatron":  # the actor ranks create megatron-core's groups now
            from .megatron.parallel import join_model_parallel_init

            join_model_parallel_init(s.tensor_parallel, s.pipeline_parallel,
                                     len(self.stage.actor_ranks))
        # HF models on this rank (either backend): one whole copy of each frozen scorer
        dtype, temp = s.dtype, self.cfg.generation.temperature
        self.reward = prepare_frozen(build_value_model(src.reward, require_head=True, **common), dtype)
        self.reference = None
        if "reference" in self.cfg.oppo.stream_to:
            self.reference = prepare_frozen(build_causal_lm(src.reference, **common), dtype)

        def scorers():  # one set per actor rank: their rollouts are served at the same time
            out = [StreamingScorer(self.reward, "reward")]
            if self.reference is not None:
                out.append(StreamingScorer(self.reference, "reference", temperature=temp))
            return out

        self.scorer_stages = [ScorerStage(scorers(), actor_rank=a, group=self.stage.links[a])
                              for a in self.stage.senders]

    def _stage_replica(self) -> Replica:
        """This rank's model replica and the rank of it that streams; checks that megatron-core
        laid the replicas out as ``replica_senders`` expects."""
        group = self.actor.groups.mp_group
        ranks = sorted(dist.get_process_group_ranks(group))
        streaming = [r for r in ranks if r in self.stage.senders]
        if streaming != ranks[:1]:
            raise RuntimeError(f"rank {self.rank}: its model replica is ranks {ranks}, of which "
                               f"{streaming} stream; expected exactly its first rank (megatron-"
                               f"core's tp-cp-ep-dp-pp order)")
        return Replica(group, ranks[0])

    def _serve_as_scorer_rank(self) -> None:
        """The scorer rank's run: each step one rollout of every streaming actor rank, all
        served at once (``serve_round``); between steps the actor ranks may ask it to join
        world barriers; it returns when they shut the stage down at the end of training."""
        served = 0
        while True:
            served += serve_round(self.scorer_stages)
            stops = {(stage.stopped_by, stage.pause_code) for stage in self.scorer_stages}
            if len(stops) > 1:
                raise RuntimeError(f"the actor ranks are out of step: {sorted(stops, key=str)}")
            (stop, barriers), = stops
            if stop == Op.SHUTDOWN:
                logger.info("scorer rank %d: served %d rollouts from actor ranks %s", self.rank,
                            served, self.stage.senders)
                return None
            if stop == Op.PAUSE:
                for _ in range(barriers):
                    dist.barrier()

    def _scorer_rank_joins(self, barriers: int) -> None:
        """Before a section with ``barriers`` world barriers: under the stage placement every
        actor rank asks the scorer rank to join them (it is in the world, not in their group)."""
        if self.remote is not None:
            self.remote.pause(barriers)
