"""``Scoring``: the trainer's scoring of finished responses outside the stream: the step's
experience (``make_experience``: what the streaming scorers did not produce),
model.reward_function on decoded text (one answer per model replica), the reward model's
normalization, scorer calls over trimmed micro-batches (as many on every rank where the
forward is collective), and the built-in task's gold score. A mixin of ``PPOTrainer``."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import comm
from . import workload as wl
from .experience import (Experience, response_token_logprobs, response_values, sequence_scores,
                         used_widths)
from .micro_batches import MicroBatches, collective_scorers


def _stack_rows(rows: list, missing: list[int], scored: Optional[torch.Tensor],
                width: int, device) -> torch.Tensor:
    """Per-row results (scalars, or (T_row,) right-padded to ``width``) as one tensor on
    ``device``, rows listed in ``missing`` taken in order from ``scored`` (the others may
    sit elsewhere: a resumed pool's rows come back on the CPU)."""
    fill, missing = iter(scored.unbind(0)) if scored is not None else iter(()), set(missing)
    rows = [next(fill) if i in missing else r for i, r in enumerate(rows)]
    if rows[0].dim() == 0:
        return torch.stack([r.float().to(device) for r in rows])
    out = torch.zeros(len(rows), width, dtype=torch.float32, device=device)
    for i, r in enumerate(rows):
        n = min(r.numel(), width)
        out[i, :n] = r[:n].to(out.device)
    return out


class Scoring:
    @torch.no_grad()
    def make_experience(self, keys: list[str], gen, streamed: Optional[dict] = None) -> Experience:
        """Reference log-probs, critic values, rewards and the actor's own (old) log-probs;
        what the streaming scorers already produced (``streamed``, by kind; ``actor``: the
        log-probs the actor's decode computed) is taken as is."""
        streamed = streamed or {}
        temp, packed = self.cfg.generation.temperature, self.cfg.system.packing_samples
        args = (gen.prompt_ids, gen.prompt_mask, gen.response_ids, gen.response_mask)
        # per row, from the rollout pool: None where nothing valid was streamed (a critic
        # value from before the last update, or a scorer that did not see the row)
        missing = {kind: [i for i, r in enumerate(got) if r is None]
                   for kind, got in streamed.items() if isinstance(got, list)}
        # and, under ppo.score_batch_tokens, the kinds that score every row: the ranks' rows
        # are as many, but split by their lengths they can take a different number of calls
        # (the same kinds on every rank: they follow the config)
        every_row = list(range(gen.prompt_ids.shape[0]))
        whole = [k for k, used in (("actor", True), ("critic", self.critic is not None),
                                   ("reference", self.cfg.ppo.uses_reference))
                 if used and streamed.get(k) is None] if self.cfg.ppo.score_batch_tokens else []
        agreed = self._agreed_calls({**{k: every_row for k in whole}, **missing},
                                    (gen.prompt_mask, gen.response_mask))

        def streamed_or_scored(kind, fn):
            got = streamed.get(kind)
            if got is None:
                return self._micro_batched(fn, args, agreed.get(kind), filler=args)
            if isinstance(got, torch.Tensor):
                return got
            rows = missing[kind]
            scored = self._micro_batched(fn, tuple(a[rows] for a in args), agreed.get(kind),
                                         filler=args) if rows or kind in agreed else None
            return _stack_rows(got, rows, scored, gen.response_ids.shape[1],
                               gen.response_ids.device)

        def actor_logprobs(*a):
            return self.actor.forward_no_grad(
                lambda m: response_token_logprobs(m, *a, temp, packed))

        def critic_values(*a):
            return self.critic.forward_no_grad(lambda m: response_values(m, *a, packed))

        old_logprobs = streamed_or_scored("actor", actor_logprobs)
        old_values = torch.zeros_like(gen.response_mask) if self.critic is None else \
            streamed_or_scored("critic", critic_values)
        # with the KL off there is no reference: its log-probs are the actor's, a KL of exactly 0
        ref_logprobs = old_logprobs if not self.cfg.ppo.uses_reference else streamed_or_scored(
            "reference", lambda *a: response_token_logprobs(self.reference, *a, temp, packed))
        if self.reward_fn is not None:
            scores = self._replica_scores(
                self.function_scores(keys, gen, self.prompt_rows, record=True,
                                     samples=self.cfg.data.samples_per_prompt > 1)
                .to(gen.response_ids.device))
        else:
            scores = self.normalized(streamed_or_scored(
                "reward", lambda *a: sequence_scores(self.reward, *a, packed)))
        gold = None
        if self.builtin_prompts:
            gold = torch.tensor(self._gold(gen), dtype=torch.float32,
                                device=gen.response_ids.device)
        return Experience(prompt_keys=keys, prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask,
                          response_ids=gen.response_ids, response_mask=gen.response_mask,
                          behaviour_logprobs=gen.logprobs, old_logprobs=old_logprobs,
                          ref_logprobs=ref_logprobs, old_values=old_values, scores=scores,
                          gold=gold)

    def function_scores(self, keys: list[str], gen, rows: dict, samples: bool = False,
                        record: bool = False) -> torch.Tensor:
        """model.reward_function's (B,) scores of the generation's responses, decoded to text,
        given each one's prompt row as read (``rows``: by row id). ``samples``: the keys are
        data.samples_per_prompt's rows ``<id>#k``, each its prompt's ``<id>`` (always: a data
        set may also hold a row whose own id is ``<id>#k``, another prompt). ``record``: count
        each function's scores in the step's metrics (training, not evaluation)."""
        info = [rows[k.rsplit("#", 1)[0] if samples else k] for k in keys]
        completions = [self.tokenizer.decode(r[:length], skip_special_tokens=True)
                       for r, length in zip(gen.response_ids.tolist(), gen.lengths.tolist())]
        return self.reward_fn([p for p, _ in info], completions, [f for _, f in info],
                              record=record)

    def _replica_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """The reward function's scores of the replica's first rank, on every rank of it
        (system.backend: megatron). Each rank of a model replica decodes the same responses
        and runs the function; one that draws random numbers, or reads its rank, would give
        the ranks different advantages, which their tensor/pipeline collectives would mix."""
        groups = getattr(self.actor, "groups", None)  # megatron's ParallelGroups
        if groups is None or not comm.active(groups.mp_group):
            return scores
        first = min(dist.get_process_group_ranks(groups.mp_group))
        return comm.broadcast(scores, first, group=groups.mp_group)

    def normalized(self, scores: torch.Tensor) -> torch.Tensor:
        """The reward model's scores under model.reward_normalize: (score - mean) / std."""
        if self.reward_norm is None:
            return scores
        mean, std = self.reward_norm
        return (scores - mean) / std

    def _score_split(self, prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> MicroBatches:
        """The rows of one scoring call each: ppo.micro_batch_size rows in order, or under
        ppo.score_batch_tokens the fewest micro-batches within that many positions, padding
        included (``micro_batches.MicroBatches.by_tokens``, longest rows first), which
        ``_agreed_calls`` splits further where another rank makes more calls."""
        rows, budget = prompt_mask.shape[0], self.cfg.ppo.score_batch_tokens
        if budget is None:
            return MicroBatches.fixed(rows, self.cfg.ppo.micro_batch_size)
        return MicroBatches.by_tokens(prompt_mask.sum(1).tolist(), response_mask.sum(1).tolist(),
                                      budget, self.cfg.system.packing_samples)

    def _micro_batched(self, fn, args, agreed: Optional[tuple[list[list[int]], int]] = None,
                       filler=None):
        """fn over micro-batches of (prompt_ids, prompt_mask, response_ids, response_mask)
        (``_score_split``), each trimmed to its own longest prompt and response; (B,) or
        (B, T) results in the rows' order, padded back to the batch's response width with
        zeros (None for no rows). ``agreed``: the rows' micro-batches and the calls to make in
        all (``_agreed_calls``), the ones past the rows on the first row of ``filler``, their
        results dropped (a collective forward: every rank must call it alike)."""
        width = args[2].shape[1]
        if args[0].shape[0] == 0 and agreed is None:
            raise ValueError("no rows to score")
        groups, calls = agreed if agreed is not None \
            else (self._score_split(args[1], args[3]).groups, 0)
        parts = []

        def call(prompt_ids, prompt_mask, response_ids, response_mask):
            p, t = used_widths(prompt_mask, response_mask)
            return fn(prompt_ids[:, -p:], prompt_mask[:, -p:], response_ids[:, :t], response_mask[:, :t])

        for rows in groups:
            index = torch.tensor(rows, dtype=torch.long, device=args[0].device)
            out = call(*(a[index] for a in args))
            if out.dim() == 2 and out.shape[1] < width:
                out = torch.nn.functional.pad(out, (0, width - out.shape[1]))
            parts.append(out)
        for _ in range(len(parts), calls):
            call(*(a[:1] for a in filler))
        if not parts:
            return None
        scored = torch.cat(parts, dim=0)
        order = [i for rows in groups for i in rows]
        if order == list(range(len(order))):
            return scored
        back = torch.empty_like(scored)
        back[torch.tensor(order, dtype=torch.long, device=scored.device)] = scored
        return back

    def _agreed_calls(self, scored_rows: dict[str, list[int]],
                      masks: tuple[torch.Tensor, torch.Tensor]) -> dict[str, tuple[list, int]]:
        """Each kind's scoring calls on this rank, as many as on every data-parallel rank:
        under ZeRO-3 the actor's and critic's forwards (and a partitioned reference's) are
        collectives, and a rank with fewer calls than the others would wait in the next
        collective while they wait in the forward. The rows a kind scores on a rank differ
        with the rollout pool (a row that finished in an earlier step, one whose critic values
        predate the update) and, under ppo.score_batch_tokens, so does the split of the same
        number of rows. ``scored_rows``: each kind's rows on this rank (the same kinds on every
        rank); ``masks``: the batch's prompt and response masks. By kind: the rows'
        micro-batches (``_score_split``, positions in the kind's rows; under
        ppo.score_batch_tokens split further, to one row a call at most, where another rank
        makes more calls) and the calls to make, the most any rank makes, those past the
        micro-batches filler. {} where no forward is collective."""
        s = self.cfg.system
        kinds = [k for k in collective_scorers(s.zero_stage, self.world_size, s.partition_reference)
                 if k in scored_rows]
        if not kinds:
            return {}
        prompt_mask, response_mask = masks
        mine = {k: (prompt_mask[scored_rows[k]], response_mask[scored_rows[k]]) for k in kinds}
        splits = {k: self._score_split(*mine[k]) for k in kinds}
        counts = comm.all_reduce_ints([len(splits[k].groups) for k in kinds], op=dist.ReduceOp.MAX,
                                      group=self.dp_group)
        return {k: (splits[k].at_least(count), count) for k, count in zip(kinds, counts)}

    def _gold(self, gen) -> list[float]:
        prompts = self.tokenizer.batch_decode(gen.prompt_ids, skip_special_tokens=True)
        responses = [self.tokenizer.decode(r[:n], skip_special_tokens=True)
                     for r, n in zip(gen.response_ids.tolist(), gen.lengths.tolist())]
        out = []
        for p, r in zip(prompts, responses):
            task = wl.parse_prompt(p.split())
            out.append(wl.gold_score(task, r.split()) if task else float("nan"))
        return out
