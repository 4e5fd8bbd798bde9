"""The trainer's side of ``oppo.placement: stage`` (a mixin of ``PPOTrainer``).

The last launched process is the scorer stage: it holds the reward model (and the reference
model, and a copy of the critic that takes the actor ranks' weights after every update, when
they stream) and serves the actor ranks' chunks (``rollout/stage.py``). The actor
ranks form torch.distributed's world by themselves and train as they would without a stage;
the scorer rank is in no world: each streaming actor rank reaches it over a link of its own
(``StageLayout``), so no collective of the actor ranks ever waits for it.
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import comm
from .config import ConfigError
from .models import build_causal_lm, build_device, build_value_model
from .preemption import StopOnSignal, signal_name
from .rollout.scorer import StreamingScorer
from .rollout.stage import Op, ScorerStage, StageWeights, serve_round
from .rollout.stage_stream import Replica, stage_score_ended
from .rollout.stage_layout import StageAborted, StageLayout, link_failure

if TYPE_CHECKING:
    from .sources import Sources

logger = logging.getLogger("oppo_ds.trainer")  # the trainer's log lines, as before


class StagePlacement:
    """Methods of ``PPOTrainer`` for the stage placement; they read the trainer's ``cfg``,
    ``stage``, ``rank``, ``actor`` and ``remote``."""

    def _stage_layout(self) -> StageLayout:
        """Before torch.distributed exists: which process this is, from the launcher's
        variables; an actor rank's WORLD_SIZE becomes the actor ranks' count."""
        s = self.cfg.system
        try:
            stage = StageLayout.from_env(dict(os.environ), s.tensor_parallel,
                                         s.pipeline_parallel)
        except ValueError as err:
            raise ConfigError("oppo.placement", str(err)) from None
        os.environ.update(stage.env_updates(dict(os.environ)))
        # a process that ends before its links open (a bad path on an actor rank) says so in
        # the store, so that the others stop at once rather than wait 30 minutes for it
        atexit.register(stage.abort)
        if stage.rank == 0:
            kinds = self.stage_kinds  # the stage streams: all of them are its
            senders = "" if stage.senders == stage.actor_ranks else \
                f" (streamed by ranks {stage.senders}, one per model replica)"
            critic = ""
            if self.critic_on_stage:
                critic = (f"; the critic's weights go to it from rank {stage.senders[0]} "
                          f"after every update")
                if self.cfg.system.backend == "megatron":
                    critic += " (gathered from its replica's shards in HF layout first)"
            logger.info("oppo.placement=stage: rank %d scores (%s) for actor ranks %s%s%s",
                        stage.scorer_rank, ", ".join(kinds), stage.actor_ranks, senders, critic)
        return stage

    @contextmanager
    def _stage_failures(self):
        """Around the trainer's start-up and run under the stage placement. Once this
        process's links are open, an error of its own that it fails on is said in the store
        (``StageLayout.report_failure``): the scorer rank failing to load a model, say, which
        its actor ranks would otherwise see as a closed connection only. A closed connection
        (``link_failure``) is nobody's failure here: when another process has said why it
        failed it becomes ``StageAborted`` naming that process and its error, chained to the
        connection's, else it passes unchanged and is not reported (a process killed without
        a word, by the OOM killer say, must not be blamed on the first to notice). Errors
        before the links opened (``abort`` covers those) pass unchanged."""
        try:
            yield
        except Exception as err:
            stage = getattr(self, "stage", None)
            if stage is None or not stage.linked or isinstance(err, StageAborted):
                raise
            if not link_failure(err):
                stage.report_failure(err)
                raise
            why = stage.failure()
            if why is None:
                raise
            raise StageAborted(f"{why}; {stage.name} stops too") from err

    @property
    def critic_on_stage(self) -> bool:
        """Whether the critic streams on the scorer rank: a copy there (an HF model, either
        backend) takes the actor ranks' weights before every rollout that follows an update
        (``_send_critic_to_stage``)."""
        return "critic" in self.stage_kinds  # none but under the stage placement

    @property
    def stage_kinds(self) -> list[str]:
        """The scorers the stage holds (``Config.scorer_rank_models``): every streamed one, but
        under ``oppo-train --evaluate`` the reward model alone where the stage holds one (with
        a reward function the actor ranks score the answers and the stage serves no
        evaluation rollout, its models built as for training)."""
        return self.cfg.scorer_rank_models(self.evaluating_only)

    def _send_critic_to_stage(self) -> None:
        """Before a rollout: the critic's weights to the stage's copy, if it trained since
        they were last sent. The copy is shared by every streaming actor rank's rollouts, so
        the first streaming rank (global rank 0) sends them and the others tell the stage
        to await that version before serving them (``RemoteScorers.await_weights``): the
        weights cross to the scorer rank once per update. Under ZeRO-3 the gather is
        collective over the actor ranks; under backend megatron replica 0 first gathers its
        critic's shards on rank 0 in HF layout (``MegatronModel.to_hf``, collective over
        that replica's model-parallel group; host memory for one whole critic there).
        ``critic_send_s``: how long it took (0 when nothing was sent; logged as
        ``stream/critic_weights_s``)."""
        self.critic_send_s = 0.0
        if not self.critic_on_stage or self._critic_sent == self.step_count:
            return
        start = time.perf_counter()
        sends = self.rank == self.stage.senders[0]
        with self.critic.generation_context() as critic:
            if getattr(critic, "collective_save", False):  # Megatron shards
                critic = critic.to_hf()
            if self.remote is not None and not sends:
                self.remote.await_weights(version=self.step_count)
            elif self.remote is not None:
                if critic is None:
                    raise RuntimeError(f"rank {self.rank} sends the critic to the stage but "
                                       f"its model replica gathered it on another rank")
                self.remote.send_weights(critic, version=self.step_count)
        self._critic_sent = self.step_count
        self.critic_send_s = time.perf_counter() - start

    def _score_ended_rows_on_stage(self) -> None:
        """After a resume: the rollout pool's finished rows that lack a result of a scorer on
        the scorer rank (the reward model; the reference when it streams) get it from there,
        since ``make_experience`` on an actor rank has no such model to score them with. A
        checkpoint written with streaming off, or with the reference not streamed, holds
        such rows (finished, not taken yet). Each goes to the stage as a new row with its
        whole response and ends at once (``stage_score_ended``): the scores the inline
        placement's whole-sequence scoring gives them. Collective over the actor ranks: when
        any of them has such rows, every streaming rank sends one rollout (an empty one if
        it has none), as the scorer rank serves one rollout of each a round."""
        kinds = self.cfg.streamed_frozen_scorers
        rows = [e for e in self.pool.waiting() if any(k not in e.results for k in kinds)]
        if not kinds or not comm.all_reduce_ints([len(rows)], group=self.actor_group)[0]:
            return
        self._send_critic_to_stage()  # a stage with a critic copy serves no rollout before
        inputs = self.pool.decode_inputs(rows, self.tokenizer.pad_token_id, self.device) \
            if rows else None
        scored = stage_score_ended(self.remote, inputs, [e.uid for e in rows], self.replica)
        for entry in rows:
            for kind in kinds:
                entry.results.setdefault(kind, scored[kind][entry.uid])
        if rows:
            logger.info("rank %d: %d finished sequence(s) of the resumed rollout pool had no %s "
                        "scores (written without them streamed): scored on the scorer rank",
                        self.rank, len(rows), " / ".join(kinds))

    def _open_stage_links(self) -> None:
        """Open this process's links to the other end(s): on the scorer rank before it reads
        the workload (the actor ranks open theirs after rank 0 has prepared it, so the scorer
        rank then finds it prepared), on a streaming actor rank once its world exists."""
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl" and self.stage.is_scorer:  # a GPU of its own, not a shared one
            comm.check_local_device()
            comm.set_local_cuda_device()
        self.stage_links = self.stage.open_links(
            backend, timedelta(minutes=self.cfg.oppo.stage_timeout_minutes))

    def close(self) -> None:
        """Shut the stage's links down (a no-op without them); ``oppo-train`` calls it after
        a run, before the world's groups are destroyed."""
        links = getattr(self, "stage_links", {})
        for link in links.values():
            link.close()
        self.stage_links = {}
        if links:
            gc.collect()  # a group held in a reference cycle is destroyed now too

    def _init_scorer_rank(self, src: Sources, common: dict) -> None:
        """The scorer rank's models, frozen as the actor ranks would build them, and one
        ScorerStage per streaming actor rank (one per model replica), each with scorers of its
        own over those models (their rollouts are served at the same time)."""
        from .engines import prepare_frozen
        from .engines.factory import prepare_trained
        from .models import disable_dropout

        s = self.cfg.system
        # made where the actor ranks make theirs, so that the same seed gives the same weights
        common = {**common, "device": build_device(s.zero_stage)}
        # HF models on this rank (either backend): one whole copy of each frozen scorer
        dtype, temp = s.dtype, self.cfg.generation.temperature
        # buffers as the actor ranks' engines hold theirs (a bf16-cast rotary inv_freq moved
        # the critic copy's values by up to 4e-3)
        def frozen(model):
            return prepare_frozen(model, dtype, overrides=s.deepspeed_config)

        self.reward = None  # with model.reward_function the actor ranks score finished text
        if "reward" in self.stage_kinds:
            self.reward = frozen(build_value_model(src.reward, require_head=True, **common))
        self.reference = None
        if "reference" in self.stage_kinds:
            self.reference = frozen(build_causal_lm(src.reference, **common))
        weights = None
        if self.critic_on_stage:  # built as the actor ranks build theirs (LoRA included)
            critic = prepare_trained(disable_dropout(build_value_model(src.critic, **common)),
                                     self.cfg, "critic")
            weights = StageWeights(frozen(critic))

        def scorers():  # one set per actor rank: their rollouts are served at the same time
            out = [StreamingScorer(self.reward, "reward")] if self.reward is not None else []
            if self.reference is not None:
                out.append(StreamingScorer(self.reference, "reference", temperature=temp))
            if weights is not None:
                out.append(StreamingScorer(weights.model, "critic"))
            return out

        self.scorer_stages = [ScorerStage(scorers(), self.stage_links[a], carry=True,
                                          weights=weights)
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
        served at once (``serve_round``); it returns when they shut the stage down at the end
        of training."""
        served = 0
        # a stop signal here (srun passes one to every task) only goes out with the replies:
        # the actor ranks stop after the step, checkpoint, and say so when they shut down
        with StopOnSignal(self.cfg.checkpoint.on_signals) as stop:
            for stage in self.scorer_stages:
                stage.stop_signal = lambda: stop.number
            while True:
                served += serve_round(self.scorer_stages)
                stops = {stage.stopped_by for stage in self.scorer_stages}
                if len(stops) > 1:
                    raise RuntimeError(f"the actor ranks are out of step: some shut the stage "
                                       f"down, others ended a rollout ({sorted(map(str, stops))})")
                if stops == {Op.SHUTDOWN}:
                    logger.info("scorer rank %d: served %d rollouts from actor ranks %s", self.rank,
                                served, self.stage.senders)
                    self.preempted = signal_name(max(stage.shutdown_signal
                                                     for stage in self.scorer_stages))
                    return None
