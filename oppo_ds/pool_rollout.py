"""Inter-step overlap's rollout (a mixin of ``PPOTrainer``): a step's take from the rollout pool
of B + Delta sequences, decoded (streaming the scorers when configured) until every rank has
its B finished, with the deferred sequences continued where they stopped and the frozen
scorers' caches of them carried from step to step. The pool itself (ledger, deferral, stop
rule) is ``rollout/pool.py``'s; the step that calls this is ``trainer.py``'s.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import comm
from .data import repeat_samples
from .rollout.generate import decode_steps, start_decode
from .rollout.pool import (BatchStop, entries_to_generation, pool_stream_setup, staleness_metrics,
                           staleness_rows)
from .rollout.stage_stream import stage_stream_continue
from .rollout.streaming import StreamingScorer, stream_continue
from .rollout.waste import idle_slots_frac


def _tail_waste(tokens, rows, longest) -> float:
    """Decode slots left idle over the ranks (per rank: tokens decoded, rows, the longest
    row's new tokens): rows that had ended while others went on, every rank's rows counted to
    the longest anywhere, since the ranks decode in lock-step (as the sequential rollout's
    figure, over the ranks' lengths)."""
    return idle_slots_frac(sum(tokens), sum(rows) * max(longest, default=0))


class PoolRollout:
    """``rollout_pool`` of ``PPOTrainer`` (``oppo.overcommit``)."""

    def rollout_pool(self, chunk: Optional[int], batch: Optional[int] = None, defer: bool = True):
        """One step of the rollout pool: top it up to B + Delta, decode every unfinished
        sequence (continuing the deferred ones) until this rank, and under data parallelism
        every rank, has B finished, and take those B. ``batch``: rows to take in place of B
        (a later round of ``ppo.filter_groups``); ``defer``: defer what is left behind
        (``RolloutPool.take``). Returns (prompt keys, group labels, generation of the B,
        streamed results, stream timing or None, metrics, tokens decoded, the entries
        taken)."""
        o, pool = self.cfg.oppo, self.pool
        delta = self.delta_ctl.delta if self.delta_ctl is not None else o.overcommit
        size = (batch or self.cfg.ppo.batch_size) + delta
        # whole prompts, each data.samples_per_prompt rows: at least size rows
        n = self.cfg.data.samples_per_prompt
        drawn = repeat_samples(self.stream.take(-(-pool.needed(size) // n)), n)
        pool.top_up(drawn, len(pool) + len(drawn))
        running = pool.running()
        stop = pool.batch_stop(running, sync=self.world_size > 1, group=self.actor_group,
                               blocks=self.sampling.sync_every > 1, batch=batch)
        before = [len(e.tokens) for e in running]
        timing, results = None, {}
        ready = stop(None)
        idle = not ready and not running
        if idle:
            # nothing of its own to decode while another rank decodes: it enters the same
            # contexts, whose ZeRO-3 gathers are collectives, and joins the stop checks there
            # (a filtered step's later round can find a rank's pool all finished); the stage
            # serves one rollout of every rank a round: this rank's is empty
            if self.stage is not None:
                self._send_critic_to_stage()
            with self._decoding_contexts():
                if self.remote is not None:
                    self.remote.empty_rollout()
                stop.wait(None)
        elif not ready:
            inputs = pool.decode_inputs(running, self.tokenizer.pad_token_id, self.device)
            if o.streaming:
                state, results, timing = self._stream_pool(running, inputs, chunk, stop)
            else:
                with self.actor.generation_context() as model:
                    state = start_decode(model, params=self.sampling, **inputs)
                    decode_steps(model, state, self.sampling, self.sample_gen, stop=stop)
            stop.wait(state)
            pool.absorb(running, state, version=self.policy_version, step=self.step_count)
            if self.actor_streams:
                # the current weights' log-probs of a row that finished now: its carried tokens
                # from the prefill that rebuilt its cache, the rest as sampled
                for row in state.finish_order:
                    results.setdefault("actor", {})[running[row].uid] = \
                        state.actor_logprobs[row, :int(state.lengths[row])]
            for entry in running:
                entry.results.update({kind: per_row[entry.uid] for kind, per_row in results.items()
                                      if entry.uid in per_row})
        new_tokens = [len(e.tokens) - n for e, n in zip(running, before)]
        produced = float(sum(new_tokens))
        taken = pool.take(batch, defer=defer)
        pool.check()
        gen = entries_to_generation(taken, self.tokenizer.pad_token_id, self.device)
        streamed = {kind: [e.results.get(kind) for e in taken] for kind in self._streamed_kinds()}
        metrics = staleness_metrics(comm.gather_lists(staleness_rows(taken, self.policy_version),
                                                  self.dp_group))
        calls, idle_ranks, tokens, rows, longest = zip(*comm.gather_lists(
            [(stop.calls, int(idle), produced, len(running), max(new_tokens, default=0))],
            self.dp_group))
        if len(set(calls)) > 1:  # lock-step broken: the ranks' collectives no longer pair up
            raise RuntimeError(f"ranks stopped decoding after different numbers of stop "
                               f"checks: {list(calls)}")
        metrics.update({"pool/delta": delta, "pool/size": size, "pool/carried": len(pool),
                        "pool/decoded_tokens": produced, "pool/sync_calls": calls[0],
                        "pool/idle_ranks": sum(idle_ranks),
                        "rollout/tail_waste_frac": _tail_waste(tokens, rows, longest)})
        groups = torch.tensor([e.group for e in taken]) if pool.group_size > 1 else None
        return [e.key for e in taken], groups, gen, streamed, timing, metrics, produced, taken

    def _stream_pool(self, running, inputs: dict, chunk: int, stop: BatchStop):
        """The pool's rollout with streaming scorers. The reward and reference scorers keep
        their caches from step to step (frozen models: a deferred row's prefix stays valid),
        so only rows they do not hold yet are added, with whatever response those rows
        already have; the critic trains, so its scorer is new each step and prefills every
        row's prompt + partial response. Under the stage placement the scorer rank does the
        same with its copies (the critic's sent to it when it trained)."""
        o = self.cfg.oppo
        if self.stage is not None:
            uids = torch.tensor([e.uid for e in running], dtype=torch.long)
            self._send_critic_to_stage()
            with self.actor.generation_context() as actor:
                return stage_stream_continue(actor, self.remote, inputs, uids, self.sampling,
                                             self.sample_gen, chunk, stop=stop,
                                             replica=self.replica)
        frozen = self.cfg.carried_scorer_kinds
        with self._decoding_contexts() as (actor, critic):
            uids, scorers, setup = pool_stream_setup(
                running, inputs, self._carried_scorer, frozen, device=self.device,
                critic=StreamingScorer(critic, "critic") if critic is not None else None)
            return stream_continue(actor, scorers, setup, inputs, uids, self.sampling,
                                   self.sample_gen, chunk, placement=o.placement, stop=stop)

    def _carried_scorer(self, kind: str) -> StreamingScorer:
        """The reward / reference streaming scorer whose cache lives across steps."""
        if kind not in self.carried_scorers:
            model = self.reward if kind == "reward" else self.reference
            self.carried_scorers[kind] = StreamingScorer(
                model, kind, temperature=self.cfg.generation.temperature)
        return self.carried_scorers[kind]
