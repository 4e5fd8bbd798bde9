"""``Scoring``: the trainer's helpers that score finished responses outside the stream:
model.reward_function on decoded text (one answer per model replica), the reward model's
normalization, scorer calls over trimmed micro-batches (as many on every rank where the
forward is collective), and the built-in task's gold score. A mixin of ``PPOTrainer``."""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from . import comm
from . import workload as wl
from .experience import used_widths
from .micro_batches import split_by_tokens


class Scoring:
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

    def _score_groups(self, prompt_mask: torch.Tensor, response_mask: torch.Tensor,
                      count: Optional[int] = None) -> list[list[int]]:
        """The rows of one scoring call each: ppo.micro_batch_size rows in order, or under
        ppo.score_batch_tokens the fewest micro-batches within that many positions, padding
        included (``micro_batches.split_by_tokens``, longest rows first). ``count``: with the
        budget, split further to that many calls (at most one a row; the calls past the rows
        are the caller's filler)."""
        rows, budget = prompt_mask.shape[0], self.cfg.ppo.score_batch_tokens
        if budget is None:
            n = self.cfg.ppo.micro_batch_size
            return [list(range(i, min(i + n, rows))) for i in range(0, rows, n)]
        if rows == 0:
            return []
        split = partial(split_by_tokens, prompt_mask.sum(1).tolist(),
                        response_mask.sum(1).tolist(), budget, self.cfg.system.packing_samples)
        groups = split()
        return groups if count is None or count <= len(groups) else split(min(count, rows))

    def _micro_batched(self, fn, args, calls: Optional[int] = None, filler=None):
        """fn over micro-batches of (prompt_ids, prompt_mask, response_ids, response_mask)
        (``_score_groups``), each trimmed to its own longest prompt and response; (B,) or
        (B, T) results in the rows' order, padded back to the batch's response width with
        zeros (None for no rows). ``calls``: make that many calls in all, the ones past the
        rows on the first row of ``filler``, their results dropped (a collective forward:
        every rank must call it alike)."""
        width = args[2].shape[1]
        if args[0].shape[0] == 0 and calls is None:
            raise ValueError("no rows to score")
        groups = self._score_groups(args[1], args[3], calls)
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
        for _ in range(len(parts), calls or 0):
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

    def _equal_forward_calls(self, scored_rows: dict[str, list[int]],
                             masks: tuple[torch.Tensor, torch.Tensor]) -> dict[str, int]:
        """How many scoring calls each kind must make on this rank so that every data-parallel
        rank makes the same number: under ZeRO-3 the actor's and critic's forwards (and a
        partitioned reference's) are collectives, and a rank with fewer calls than the others
        would wait in the next collective while they wait in the forward. The rows a kind
        scores on a rank differ with the rollout pool (a row that finished in an earlier step,
        one whose critic values predate the update) and, under ppo.score_batch_tokens, so
        does the split of the same number of rows. ``scored_rows``: each kind's rows on this
        rank (the same kinds on every rank); ``masks``: the batch's prompt and response masks.
        {} where no forward is collective."""
        collective = ("actor", "critic") + (("reference",) if self.cfg.system.partition_reference
                                            else ())
        kinds = [k for k in collective if k in scored_rows]
        if not kinds or self.cfg.system.zero_stage != 3 or self.world_size < 2:
            return {}
        prompt_mask, response_mask = masks
        counts = comm.all_reduce_ints(
            [len(self._score_groups(prompt_mask[scored_rows[k]], response_mask[scored_rows[k]]))
             for k in kinds], op=dist.ReduceOp.MAX, group=self.dp_group)
        return dict(zip(kinds, counts))

    def _gold(self, gen) -> list[float]:
        prompts = self.tokenizer.batch_decode(gen.prompt_ids, skip_special_tokens=True)
        responses = [self.tokenizer.decode(r[:n], skip_special_tokens=True)
                     for r, n in zip(gen.response_ids.tolist(), gen.lengths.tolist())]
        out = []
        for p, r in zip(prompts, responses):
            task = wl.parse_prompt(p.split())
            out.append(wl.gold_score(task, r.split()) if task else float("nan"))
        return out
