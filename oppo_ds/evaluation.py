"""Held-out evaluation (``eval:``): the actor answers a fixed set of prompts it does not train
on, sampled as training samples (or greedily) from a generator that repeats its draws at
every evaluation, and the reward model (or ``model.reward_function``) scores the answers
(the built-in task's gold rule too). Before the first step, every ``eval.every`` steps and
after the last, so that a reward that rises on the training batches can be checked against
prompts the policy has not been optimised on, with figures whose change from one evaluation
to the next comes from the policy rather than from the draw.

Evaluation uses none of training's random state (it has its own generator), so a run with
it trains exactly as one without. Under ``oppo.placement: stage`` the reward model is on the
scorer rank: the answers stream to it as a training rollout's do (``_stage_scores``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import time
from typing import Optional

import torch

from . import comm
from . import workload as wl
from .algo import truncated_rows
from .data import Prompt, left_pad
from .datafiles import DataError, PromptRow, read_prompt_rows
from .experience import sequence_scores
from .rollout.generate import Generation, generate
from .rollout.stage_stream import stage_stream_generate
from .sources import encode_rows, prompts_label
from .telemetry import read_history

logger = logging.getLogger(__name__)

# the built-in training prompts are drawn with seed + 1 (prepare.py); the held-out set apart
BUILTIN_EVAL_SEED_OFFSET = 2
# the evaluation's generator: seed * 1000 + this + data rank (training's use + 0 and + 500)
EVAL_SEED_OFFSET = 700


def text_records(tokenizer, keys: list[str], gen: Generation, scores: torch.Tensor,
                 gold: Optional[torch.Tensor], end_ids, max_new_tokens: int,
                 limit: Optional[int] = None) -> list[dict]:
    """Rows of a generation as text with their scores (the first ``limit``; None: all):
    prompt id, prompt, response, reward, gold score (None where there is none), length in
    tokens and whether the response ended (at an end id, or before the length limit: not
    ``truncated_rows``, the penalty's and response/truncated_frac's test)."""
    lengths = gen.lengths.tolist()
    truncated = truncated_rows(gen.response_ids, gen.response_mask, end_ids, max_new_tokens).tolist()
    out = []
    for i in range(len(keys) if limit is None else min(limit, len(keys))):
        prompt = gen.prompt_ids[i][gen.prompt_mask[i].bool()].tolist()
        response = gen.response_ids[i, :lengths[i]].tolist()
        out.append({
            "prompt_id": keys[i],
            "prompt": tokenizer.decode(prompt, skip_special_tokens=True),
            "response": tokenizer.decode(response, skip_special_tokens=True),
            "reward": float(scores[i]),
            "gold": None if gold is None or gold[i].isnan() else float(gold[i]),
            "length": lengths[i],
            "ended": not truncated[i],
        })
    return out


def eval_metrics(records: list[dict], seconds: float) -> dict:
    """An evaluation's figures from every rank's records."""
    rewards = [r["reward"] for r in records]
    gold = [r["gold"] for r in records if r["gold"] is not None]
    out = {"eval/prompts": len(records),
           "eval/reward_mean": statistics.fmean(rewards),
           "eval/reward_std": statistics.pstdev(rewards),
           "eval/response_len_mean": statistics.fmean(r["length"] for r in records),
           "eval/ended_frac": sum(r["ended"] for r in records) / len(records),
           "eval/time_s": seconds}
    if gold:
        out["eval/gold_mean"] = statistics.fmean(gold)
    return out


class Evaluating:
    """The held-out prompts (``_load_eval_prompts``) and ``evaluate`` of ``PPOTrainer``."""

    def _load_eval_prompts(self) -> list[Prompt]:
        """The evaluation set, encoded as the training prompts are; every rank reads it whole
        and evaluates its share. Warns about prompts that are training prompts too."""
        e, d, g = self.cfg.eval, self.cfg.data, self.cfg.generation
        if e.prompts == "builtin":
            # apart from the prepared training prompts, whichever prompts this run trains on
            exclude = set()
            if self.builtin_prompts:
                exclude = {r.text_or_messages for r in read_prompt_rows(self.sources.prompts)}
            rows = [PromptRow(text_or_messages=x["prompt"], source="builtin-eval", line=i + 1,
                              id=x["id"]) for i, x in enumerate(
                        wl.held_out_prompts(e.num_prompts, self.cfg.seed + BUILTIN_EVAL_SEED_OFFSET,
                                            exclude))]
            label = "eval.prompts: builtin"
        else:
            rows = read_prompt_rows(e.prompts, prompt_key=d.prompt_key, split=e.split)
            label = prompts_label(e.prompts)
        if e.num_prompts:
            rows = rows[:e.num_prompts]
        if self.reward_fn is not None:
            self.eval_rows = {r.id: (r.text_or_messages, r.fields) for r in rows}
        encoded = encode_rows(self.cfg, rows, self.tokenizer, label, log=self.is_main)
        if not encoded.prompts:
            raise DataError(f"{label}: no usable prompt (all over generation.max_prompt_len "
                            f"= {g.max_prompt_len} tokens, data.overlong: skip)")
        if self.is_main:
            train = {tuple(p.input_ids) for p in self.prompts}
            shared = sum(tuple(p.input_ids) in train for p in encoded.prompts)
            if shared:
                logger.warning("%s: %d of %d evaluation prompts are training prompts too: their "
                               "figures are not held out", label, shared, len(encoded.prompts))
        return encoded.prompts

    def _eval_due(self, after_last: bool = False) -> bool:
        """Whether to evaluate now, at ``self.step_count``: before the first step (at_start),
        every ``eval.every`` steps, and after the last step once."""
        e = self.cfg.eval
        if not e.enabled:
            return False
        step = self.step_count
        if step == 0:
            return e.at_start
        periodic = bool(e.every) and step % e.every == 0
        return periodic if not after_last else not periodic

    def _final_eval_due(self, start: int) -> bool:
        """Whether to evaluate after the last step, this run having started at step
        ``start``: once, where ``_eval_due(after_last=True)``. A run started again at its last
        step evaluates there only if ``eval.jsonl`` holds no evaluation of it: its first try
        stopped on a signal during that step (checkpointed, not evaluated), or was killed
        while it evaluated. Collective over the actor ranks (rank 0 reads the file)."""
        if not self._eval_due(after_last=True):
            return False
        if self.step_count > start:
            return True
        done = self.is_main and any(row.get("step") == self.step_count
                                    for row in read_history(self.telemetry.eval_path))
        return not comm.all_reduce_ints([int(done)], group=self.actor_group)[0]

    @torch.no_grad()
    def evaluate(self) -> tuple[dict, list[dict]]:
        """Generate for this rank's share of the evaluation prompts and score the responses;
        returns every rank's figures and records (the same on every rank). The actor is
        gathered once for all of it (under ZeRO-3 entering generation is collective, and the
        ranks' shares may need a different number of batches; under the stage a shorter one
        pads with empty rollouts, ``_pad_eval_rollouts``)."""
        e = self.cfg.eval
        t0 = time.perf_counter()
        data_rank = self.actor.rank
        mine = self.eval_prompts[data_rank::self.world_size]
        batch = self.cfg.ppo.batch_size
        on_stage = "reward" in self.stage_kinds  # the scorer rank's reward model scores them
        if on_stage:  # the critic's copy there up to date before any rollout it serves
            self._send_critic_to_stage()
        params = self._eval_sampling()
        # the same draws at every evaluation, none of training's
        rng = torch.Generator().manual_seed(self.cfg.seed * 1000 + EVAL_SEED_OFFSET + data_rank)
        records = []
        with self.actor.generation_context() as model:
            if on_stage:
                self._pad_eval_rollouts(-(-len(mine) // batch))
            for i in range(0, len(mine), batch):
                prompts = mine[i:i + batch]
                ids, mask = left_pad([p.input_ids for p in prompts], self.tokenizer.pad_token_id)
                if on_stage:
                    gen, scores = self._stage_scores(model, ids.to(self.device),
                                                     mask.to(self.device), params, rng)
                else:
                    gen = generate(model, ids.to(self.device), mask.to(self.device), params, rng)
                    args = (gen.prompt_ids, gen.prompt_mask, gen.response_ids, gen.response_mask)
                    scores = self.function_scores([p.id for p in prompts], gen, self.eval_rows) \
                        if self.reward_fn is not None else \
                        self._micro_batched(lambda *a: sequence_scores(
                            self.reward, *a, self.cfg.system.packing_samples), args)
                gold = torch.tensor(self._gold(gen)) if e.prompts == "builtin" else None
                scores = self.normalized(scores)
                records += text_records(self.tokenizer, [p.id for p in prompts], gen, scores, gold,
                                        params.eos_token_ids, params.max_new_tokens)
        records = comm.gather_lists(records, self.dp_group)
        return eval_metrics(records, time.perf_counter() - t0), records

    def _pad_eval_rollouts(self, batches: int) -> None:
        """The scorer rank serves every actor rank's rollouts in rounds, one of each: a rank
        whose share of the evaluation prompts takes fewer batches than the longest share (rank
        0's) sends an empty rollout for each batch it lacks, and nothing when the shares take
        as many. (Padding the share with prompts instead changed its batches' shapes, so its
        sampled answers: they differed from the inline run's.)"""
        longest = -(-len(self.eval_prompts) // self.world_size)  # rank 0's share
        for _ in range(-(-longest // self.cfg.ppo.batch_size) - batches):
            if self.remote is not None:
                self.remote.empty_rollout()

    def _stage_scores(self, actor, ids: torch.Tensor, mask: torch.Tensor, params, rng):
        """Answers to one batch and their rewards from the scorer rank: streamed to it as a
        rollout (the same scores as scoring the whole answers, as training's are), in chunks of
        the size training uses now. Their row ids follow every row a carrying stage holds for
        the rollout pool, so it takes them as new and drops its carried rows, which the next
        training rollout then sends again with their responses so far."""
        o = self.cfg.oppo
        chunk = o.chunk_size if self.chunk_ctl is None else self.chunk_ctl.next_chunk_size()
        first = 1 + max(self.remote.held, default=-1) if self.remote is not None else 0
        gen, streamed, _ = stage_stream_generate(
            actor, self.remote, ids, mask, params, rng, chunk, replica=self.replica,
            row_ids=range(first, first + ids.shape[0]))
        return gen, streamed["reward"].float()

    def _eval_sampling(self):
        """Training's sampling parameters at ``eval.temperature`` (null: training's own)."""
        t = self.cfg.eval.temperature
        return self.sampling if t is None else dataclasses.replace(self.sampling, temperature=t)

    def evaluate_only(self) -> Optional[dict]:
        """``oppo-train --evaluate``: one evaluation of the actor as the run loaded it (the
        checkpoint ``checkpoint.resume`` names, else ``model.actor``), nothing trained or
        saved, the run's own logs untouched (the trainer built with ``evaluate_only``). Rank 0
        writes the figures, with the settings they depend on, to ``evaluations/step_N.json``
        under ``logging.output_dir`` and every answer to ``step_N_samples.jsonl`` beside it (N:
        the checkpoint's step, 0 without one; ``step_N-2`` and so on when that step was
        evaluated before), and returns the figures; the other ranks, None."""
        from .rollout.generate import cudnn_attention

        with cudnn_attention(self.cfg.system.cudnn_attention), self._stage_failures():
            if self.stage is not None and self.stage.is_scorer:
                return self._serve_as_scorer_rank()  # until the actor ranks close the stage
            metrics, records = self.evaluate()
            if self.remote is not None:
                self.remote.close()
        if not self.is_main:
            return None
        actor = f"checkpoint {self.resumed_from}" if self.resumed_from else self.sources.actor
        e = self.cfg.eval
        # the answers follow these: the prompts, and the draws, which come batch by batch
        settings = {"eval.prompts": e.prompts, "eval.num_prompts": e.num_prompts,
                    "eval.temperature": self._eval_sampling().temperature,
                    "ppo.batch_size": self.cfg.ppo.batch_size,
                    "seed": self.cfg.seed, "ranks": self.world_size}
        result = {"step": self.step_count, "actor": actor, **metrics, "settings": settings}
        folder = os.path.join(self.cfg.logging.output_dir, "evaluations")
        os.makedirs(folder, exist_ok=True)
        stem = os.path.join(folder, f"step_{self.step_count}")
        again = 1
        while os.path.exists(stem + ".json"):  # an earlier evaluation of the step is kept
            again += 1
            stem = os.path.join(folder, f"step_{self.step_count}-{again}")
        for path, text in ((stem + "_samples.jsonl", "".join(
                json.dumps(r, ensure_ascii=False) + "\n" for r in records)),
                           (stem + ".json", json.dumps(result, indent=2) + "\n")):
            with open(path + ".tmp", "w") as f:  # whole or not at all: a kill leaves the last
                f.write(text)
            os.replace(path + ".tmp", path)
        logger.info("evaluated %s (step %d): %s", actor, self.step_count, stem + ".json")
        return result

    def _evaluate_and_log(self) -> None:
        metrics, records = self.evaluate()
        self.telemetry.log_eval(self.step_count, metrics, records)
