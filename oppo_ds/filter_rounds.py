"""DAPO's dynamic sampling (``ppo.filter_groups``), a mixin of ``PPOTrainer``: after a step's
first rollout is scored, the prompts whose responses give the actor nothing to learn are
dropped and more prompts are generated and scored in their place, in rounds agreed over the
actor ranks, until the batch is full or the rounds run out. The rule that tells an
informative prompt (``informative_groups``) is a pure function; the rounds are here; the
rollouts they call (with or without the rollout pool) are ``trainer.py``'s.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import comm
from .experience import Experience, concat_experiences
from .rollout.pool import staleness_metrics, staleness_rows
from .telemetry import PhaseTimer


def informative_groups(scores: torch.Tensor, n: int,
                       reward_range: Optional[Sequence[float]] = None) -> list[bool]:
    """Whether each prompt of a batch has something to teach the actor.

    ``scores``: (G * n,) the scores of G prompts' n responses each, a prompt's rows together.
    Without ``reward_range`` (DAPO's and verl's rule) a prompt is informative when its scores
    are not all equal: a group baseline gives equal scores an advantage of 0 each. With
    ``reward_range = (low, high)`` (OpenRLHF's ``--dynamic_filtering_reward_range``) it is
    informative when ``low < mean score < high``, both bounds excluded; for 0/1 scores the
    range (0, 1) is DAPO's rule, and a narrower one also drops the prompts that nearly every
    response gets right or wrong. Returns G booleans.

    A prompt with a NaN or infinite score counts as informative under either rule, so that
    it is trained on and the step's finite check stops the run, rather than the filter
    dropping it unseen."""
    groups = scores.view(-1, n)
    broken = ~torch.isfinite(groups).all(1)
    if reward_range is None:
        return ((groups.max(1).values != groups.min(1).values) | broken).tolist()
    low, high = reward_range
    mean = groups.double().mean(1)
    return ((mean > low) & (mean < high) | broken).tolist()


def _group_entries(entries: Optional[list], groups: list[int], n: int) -> Optional[list]:
    """The rows' pool entries (None without a pool) of whole groups of ``n`` rows."""
    if entries is None:
        return None
    return [e for g in groups for e in entries[g * n:(g + 1) * n]]


def _group_rows(groups: list[int], n: int, device) -> torch.Tensor:
    """Row indices of whole prompts ``groups`` in a batch of ``n`` rows per prompt."""
    return torch.tensor([g * n + k for g in groups for k in range(n)], dtype=torch.long, device=device)


@dataclass
class _Rounds:
    """What a step's filter rounds have gathered on this rank. ``kept`` and ``dropped`` hold
    (experience rows, their pool entries or None) per round, in the order drawn."""
    wanted: int  # prompts the batch holds
    drawn: int  # prompts generated, all rounds
    kept: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    have: int = 0  # prompts kept so far
    uniform: int = 0  # prompts the rule dropped, all rounds
    surplus: int = 0  # informative prompts beyond the batch
    surplus_dropped: int = 0  # of those, dropped: the pool could not carry them (pool only)
    returned: set = field(default_factory=set)  # uids of surplus groups put back this step
    rounds: int = 0
    decoded: float = 0.0  # tokens the later rounds decoded from the pool
    idle: int = 0  # ranks the later rounds found with nothing to decode, summed
    timings: list = field(default_factory=list)  # the later rounds' streaming StreamTiming


class FilterRounds:
    """``_filter_groups`` of ``PPOTrainer`` (``ppo.filter_groups``)."""

    def _filter_groups(self, exp: Experience, chunk: Optional[int], timer: PhaseTimer,
                       taken: Optional[list] = None):
        """Dynamic sampling on a scored first round ``exp``: drop the prompts that
        ``informative_groups`` rejects, generate and score more prompts in their place, and
        return a batch of exactly ``ppo.batch_size`` rows (the kept prompts in the order they
        were drawn, then, if the rounds ran out, dropped ones), the step's filter/ counts
        summed over the actor ranks, and the later rounds' streaming timings (StreamTiming;
        none without streaming). The rounds are agreed over the actor ranks: each runs as
        many as the rank that needs most, so that all run the same collective forwards
        (ZeRO-3); a rank that needs fewer prompts generates the others' number and trains on
        none of its extra ones (its surplus).

        With the rollout pool (``taken``: the pool entries of ``exp``'s rows) a later round is
        one more take from the pool, whose deferred rows are part-decoded already: the pool is
        topped up to the prompts missing + Delta and decoded until that many finish. A rank's
        surplus goes back to the pool, where the next step takes it first; the dropped
        prompts are entered in the pool's ledger as dropped, and the pool defers what it still
        holds once, after the last round. A surplus that would leave more rows due next step
        (deferred ``oppo.max_defer_steps`` times) than the batch holds is dropped instead
        (``_carry_surplus``): the next step could not take them all, and one would be deferred
        past the bound. A surplus group taken again by a later round of the step is drawn and
        counted once."""
        n = self.cfg.data.samples_per_prompt
        state = _Rounds(wanted=len(exp) // n, drawn=len(exp) // n)
        exp = dataclasses.replace(exp, groups=None)
        while True:
            self._sort_round(state, exp, taken)
            need = comm.all_reduce_ints([state.wanted - state.have], op=dist.ReduceOp.MAX,
                                        group=self.actor_group)[0]
            if need == 0 or state.rounds == self.cfg.ppo.filter_groups_max_rounds:
                break
            exp, taken = self._more_round(state, need, chunk, timer, taken)
        return (*self._filtered_batch(state, taken is not None), state.timings)

    def _sort_round(self, state: _Rounds, exp: Experience, taken: Optional[list]) -> None:
        """Split one scored round into the prompts kept, those beyond the batch (the surplus:
        back to the pool, if any) and those dropped."""
        n = self.cfg.data.samples_per_prompt
        state.rounds += 1
        flags = informative_groups(exp.scores, n, self.cfg.ppo.filter_groups_reward_range)
        if taken is not None:  # a surplus group put back in an earlier round, taken again
            again = {taken[g * n].uid for g in range(len(flags))} & state.returned
            state.returned -= again
            state.drawn -= len(again)
            state.surplus -= len(again)
        informative = [g for g, keep in enumerate(flags) if keep]
        uniform = [g for g, keep in enumerate(flags) if not keep]
        take, spare = informative[:state.wanted - state.have], informative[state.wanted - state.have:]
        state.surplus += len(spare)
        state.uniform += len(uniform)
        if take:
            state.kept.append((exp.select(_group_rows(take, n, exp.scores.device)),
                               _group_entries(taken, take, n)))
        if uniform:
            state.dropped.append((exp.select(_group_rows(uniform, n, exp.scores.device)),
                                  _group_entries(taken, uniform, n)))
        if spare and taken is not None:
            self._carry_surplus(state, [_group_entries(taken, [g], n) for g in spare])
        state.have += len(take)

    def _carry_surplus(self, state: _Rounds, groups: list[list]) -> None:
        """Put the surplus ``groups`` (each a prompt's pool entries) back in the pool while the
        rows due next step stay within the batch; drop the rest (ledger: dropped). With Delta
        <= B the pool carries at most B rows (``config_checks``), but a surplus comes on top:
        a later round takes as many prompts as the neediest rank lacks, times
        ``ppo.filter_groups_oversample``, so a rank needing fewer keeps the difference."""
        pool = self.pool

        def due(entries) -> int:  # rows forced next step: this one defers them once more
            return sum(1 for e in entries if e.deadline(pool.max_defer_steps) <= 2)

        held, back = due(pool.entries), []
        for entries in groups:
            rows = due(entries)
            if held + rows <= pool.batch_size:
                held += rows
                back += entries
                state.returned.add(entries[0].uid)
            else:
                pool.ledger.drop([e.key for e in entries])
                state.surplus_dropped += 1
        pool.put_back(back)

    def _more_round(self, state: _Rounds, need: int, chunk: Optional[int], timer: PhaseTimer,
                    taken: Optional[list]):
        """Generate and score the next round for the ``need`` prompts the neediest rank lacks
        (times ``ppo.filter_groups_oversample``): (its experience, its pool entries or None)."""
        n = self.cfg.data.samples_per_prompt
        ask = math.ceil(need * self.cfg.ppo.filter_groups_oversample)
        state.drawn += ask
        with timer.phase("generate"):
            if taken is not None:
                keys, _, gen, streamed, timing, more, _, taken = self.rollout_pool(
                    chunk, batch=ask * n, defer=False)
                state.decoded += more["pool/decoded_tokens"]
                state.idle += more["pool/idle_ranks"]
            else:
                keys, _, gen, streamed, timing, _ = self._rollout(self.stream.take(ask), chunk)
        if timing is not None:  # the step's stream/ metrics and trace cover every round
            state.timings.append(timing)
        with timer.phase("score"):
            return self.make_experience(keys, gen, streamed), taken

    def _filtered_batch(self, state: _Rounds, pooled: bool):
        """The step's batch from what the rounds kept (dropped prompts fill what they could
        not), and the filter/ metrics; with the pool, its ledger and deferral settled."""
        n = self.cfg.data.samples_per_prompt
        fallback = state.wanted - state.have
        kept = list(state.kept)
        dropped_entries = [e for _, rows in state.dropped for e in rows] if pooled else None
        if fallback:  # the rounds ran out: the first dropped prompts fill the batch
            rest = concat_experiences([part for part, _ in state.dropped], self.tokenizer.pad_token_id)
            kept.append((rest.select(torch.arange(fallback * n, device=rest.scores.device)),
                         dropped_entries[:fallback * n] if pooled else None))
        out = concat_experiences([part for part, _ in kept], self.tokenizer.pad_token_id)
        out.groups = torch.arange(len(out), device=out.scores.device) // n
        # summed over the data-parallel ranks: a model replica's ranks (Megatron) hold the same
        # prompts and count them once
        totals = comm.all_reduce_ints([state.uniform - fallback, state.surplus, fallback,
                                       state.drawn, state.surplus_dropped], group=self.dp_group)
        metrics = {"filter/rounds": state.rounds, "filter/dropped_groups": totals[0],
                   "filter/surplus_groups": totals[1], "filter/fallback_groups": totals[2],
                   "filter/prompts_drawn": totals[3]}
        if pooled:
            metrics["filter/surplus_dropped_groups"] = totals[4]
            trained = [e for _, rows in kept for e in rows]
            self.pool.ledger.drop([e.key for e in dropped_entries[fallback * n:]])
            self.pool.end_step()
            self.pool.check()
            metrics.update(staleness_metrics(comm.gather_lists(
                staleness_rows(trained, self.policy_version), self.dp_group)))
            # the later rounds' (pool/: the first round's)
            metrics.update({"filter/decoded_tokens": state.decoded, "filter/idle_ranks": state.idle})
        return out, metrics
