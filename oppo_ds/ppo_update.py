"""The learning half of a PPO step (a mixin of ``PPOTrainer``): the advantages and returns of
the experience (KL-shaped rewards, GAE, whitening with statistics over every rank), the
actor's and critic's updates over mini- and micro-batches with token-level loss aggregation
(the clipped policy loss with its options, PPO-ptx, the KL in the loss), and the adaptive KL
coefficient. Generating and scoring the experience is ``trainer.py``'s.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from . import comm
from .algo import (adaptive_kl_coef, clipped_policy_loss, clipped_value_loss, entropy_from_logits,
                   gae_advantages, group_baseline_scores, kl_loss, kl_shaped_rewards,
                   loss_normalizer, masked_mean, masked_whiten, overlong_penalty, token_normalizer,
                   truncated_is_weights, truncated_rows)
from .config_checks import ptx_block_len
from .experience import Experience, response_logprobs, response_values
from .micro_batches import MicroBatches
from .ptx import lm_loss


# update statistics reduced by their largest value over micro-batches and ranks, not averaged
_MAXIMA = frozenset({"ratio_max"})


class PPOUpdate:
    """``compute_advantages``, ``update`` and the KL coefficient of ``PPOTrainer``."""

    def compute_advantages(self, exp: Experience) -> None:
        p = self.cfg.ppo
        mask = exp.response_mask
        penalty = self._length_penalty(exp)
        # with the KL in the loss the rewards carry the score alone; kl/mean is measured either
        # way (with the KL off, ppo.kl_coef 0, there is no reference and the KL is exactly 0)
        in_rewards = self.kl_coef if p.kl_penalty == "reward" else 0.0
        baseline = None
        if not p.uses_critic:  # a critic-free estimator: the score against the prompt's others
            groups = exp.groups if exp.groups is not None else torch.arange(len(exp))
            baseline = partial(group_baseline_scores, groups=groups.to(exp.scores.device),
                               estimator=p.advantage_estimator)
        exp.rewards, self._kl_stats = kl_shaped_rewards(
            exp.scores, exp.old_logprobs, exp.ref_logprobs, mask, kl_coef=in_rewards,
            estimator=p.kl_estimator, reward_clip=p.reward_clip, penalty=penalty, baseline=baseline)
        if p.whiten_rewards:
            exp.rewards = masked_whiten(exp.rewards, mask, shift_mean=False,
                                        **self._batch_moments(exp.rewards, mask))
        # without a critic the values are 0 and lambda 1: the rewards summed to the end
        lam = p.lam if p.uses_critic else 1.0
        advantages, exp.returns = gae_advantages(exp.rewards, exp.old_values, mask, p.gamma, lam)
        if p.whiten_advantages:
            advantages = masked_whiten(advantages, mask, **self._batch_moments(advantages, mask))
        exp.advantages = advantages

    def _batch_moments(self, x: torch.Tensor, mask: torch.Tensor) -> dict:
        """The mean and unbiased variance of ``x``'s valid entries over every rank's batch, so
        that whitening does not depend on how the batch is split over ranks."""
        n, s, sq = comm.all_reduce(torch.stack([mask.sum(), (x * mask).sum(),
                                                (x.pow(2) * mask).sum()]).double(),
                                   group=self.dp_group)
        mean = s / n
        var = (sq / n - mean ** 2) * n / (n - 1).clamp(min=1)
        return {"mean": mean.float(), "var": var.float()}

    def _length_penalty(self, exp: Experience) -> torch.Tensor | None:
        """(B,) what each response's score loses for its length (missing_eos_penalty for a
        truncated one, plus DAPO's overlong penalty), or None with neither configured."""
        p = self.cfg.ppo
        penalty = None
        if p.missing_eos_penalty:
            penalty = self._truncated(exp).double() * p.missing_eos_penalty
        if p.overlong_buffer_len:
            overlong = overlong_penalty(exp.response_mask.sum(-1), self.sampling.max_new_tokens,
                                        p.overlong_buffer_len, p.overlong_penalty_factor)
            penalty = overlong if penalty is None else penalty + overlong
        return penalty

    def _truncated(self, exp: Experience) -> torch.Tensor:
        """(B,) bool: responses that reached the length limit without an end id."""
        return truncated_rows(exp.response_ids, exp.response_mask, self.sampling.eos_token_ids,
                              self.sampling.max_new_tokens)

    def _loss_rows(self, mb: Experience) -> torch.Tensor:
        """(B,) bool: the responses in the actor's loss, all but the truncated ones with
        ppo.mask_truncated_completions."""
        if not self.cfg.ppo.mask_truncated_completions:
            return torch.ones(len(mb), dtype=torch.bool, device=mb.response_mask.device)
        return ~self._truncated(mb)

    def _loss_mask(self, mb: Experience) -> torch.Tensor:
        """(B, T) the tokens in the actor's loss: those of ``_loss_rows``."""
        if not self.cfg.ppo.mask_truncated_completions:
            return mb.response_mask
        return mb.response_mask * self._loss_rows(mb).unsqueeze(1)

    def update(self, exp: Experience) -> dict:
        p = self.cfg.ppo
        gas = p.mini_batch_size // p.micro_batch_size
        sums: dict[str, torch.Tensor] = {}
        weights: dict[str, torch.Tensor] = {}
        maxima: dict[str, torch.Tensor] = {}
        norms: dict[str, list[float]] = {"actor": [], "critic": []}
        ptx_losses: list[tuple[float, int]] = []
        counts: list[int] = []
        needed: list[int] = []  # under ppo.micro_batch_tokens: this rank's own splits
        actor_trains, takes_ptx = self.actor_trains, self.takes_ptx
        trained = [(n, e) for n, e in self.trained_engines.items() if n != "actor" or actor_trains]
        for _ in range(p.ppo_epochs):
            order = torch.randperm(len(exp), generator=self.shuffle_gen)
            for mini in order.split(p.mini_batch_size):
                rows, fewest = self._micro_batch_rows(exp, mini)
                micro = [exp.select(idx).trimmed() for idx in rows]
                counts.append(len(micro))
                if fewest is not None:
                    needed.append(fewest)
                loss_masks = [self._loss_mask(m) for m in micro]
                local = torch.stack([sum(m.response_mask.sum() for m in micro).double(),
                                     sum(m.sum() for m in loss_masks).double(),
                                     sum(self._loss_rows(m).sum() for m in micro).double()])
                tokens, actor_tokens, sequences = comm.all_reduce(local, group=self.dp_group).float()
                norm = token_normalizer(tokens, gas, self.world_size)
                # the actor's aggregation per micro-batch (ppo.loss_agg_mode) over the tokens and
                # responses in its loss (a mini-batch of truncated responses alone, masked,
                # sums to 0: 1 keeps it finite); the critic's is the token mean
                actor_norm = partial(loss_normalizer, mode=p.loss_agg_mode,
                                     global_tokens=actor_tokens.clamp(min=1),
                                     global_sequences=sequences.clamp(min=1), grad_accum_steps=gas,
                                     world_size=self.world_size,
                                     max_len=self.cfg.generation.max_new_tokens)
                loss_fn = partial(self._actor_loss, normalizer=actor_norm)
                actor_batches = micro
                if takes_ptx:
                    # full blocks: every rank predicts the same number of tokens
                    ptx = [self._ptx_batch(len(m)) for m in micro]
                    ptx_tokens = p.mini_batch_size * (ptx[0].shape[1] - 1) * self.world_size
                    loss_fn = partial(self._actor_ptx_loss, normalizer=actor_norm,
                                      ptx_normalizer=token_normalizer(float(ptx_tokens), gas, self.world_size))
                    actor_batches = list(zip(micro, ptx))
                actor_stats = self.actor.train_step(actor_batches, loss_fn) if actor_trains \
                    else [{} for _ in micro]
                # a mean over full blocks, each micro-batch weighed by its blocks (one a row)
                for m, a in zip(micro, actor_stats):
                    if "ptx_loss" in a:
                        ptx_losses.append((float(a.pop("ptx_loss")), len(m)))
                critic_stats = self.critic.train_step(micro, partial(self._critic_loss, normalizer=norm)) \
                    if self.critic is not None else [{} for _ in micro]
                for name, engine in trained:
                    value = engine.grad_norm()
                    if value is not None:
                        norms[name].append(value)
                # token-weighted (the actor's by the tokens in its loss), so the logged losses do
                # not depend on the micro-batch split; a maximum is the largest
                for mb, mask, a, c in zip(micro, loss_masks, actor_stats, critic_stats):
                    for part, weight in ((a, mask.sum()), (c, mb.response_mask.sum())):
                        for key, value in part.items():
                            value = torch.as_tensor(value).detach().double()
                            if key in _MAXIMA:
                                maxima[key] = torch.maximum(maxima.get(key, value), value)
                                continue
                            sums[key] = sums.get(key, 0.0) + weight.double() * value
                            weights[key] = weights.get(key, 0.0) + weight.double()
        stats = self._pooled(sums, weights, maxima)
        if self.critic is not None:
            stats["explained_variance"] = self._explained_variance(exp)
        if ptx_losses:
            stats["ptx_loss"] = sum(v * n for v, n in ptx_losses) / sum(n for _, n in ptx_losses)
        stats["micro_batches"] = sum(counts) / len(counts)  # the same on every rank
        if needed:  # this rank's own split, before the ranks agreed
            stats["micro_batches_needed"] = sum(needed) / len(needed)
        # the largest of the step's updates (the same on every rank: a global norm); NaN wins
        stats.update({f"{name}_grad_norm": next((x for x in v if x != x), max(v))
                      for name, v in norms.items() if v})
        return stats

    def _micro_batch_rows(self, exp: Experience,
                          mini: torch.Tensor) -> tuple[list[torch.Tensor], int | None]:
        """The rows of mini-batch ``mini`` (indices into ``exp``) in micro-batches, and how many
        this rank's own split needed (None without a budget): ppo.micro_batch_size each, or
        under ppo.micro_batch_tokens sized by tokens (``micro_batches.MicroBatches``), as
        many on this rank as on the data-parallel rank that needs most (ZeRO's collectives run
        once per backward)."""
        p = self.cfg.ppo
        if p.micro_batch_tokens is None:
            return list(mini.split(p.micro_batch_size)), None
        split = MicroBatches.by_tokens(
            exp.prompt_mask[mini].sum(1).tolist(), exp.response_mask[mini].sum(1).tolist(),
            p.micro_batch_tokens, self.cfg.system.packing_samples,
            # PPO-ptx: each row's block goes with it into the actor's backward
            extra_per_row=ptx_block_len(self.cfg) if self.takes_ptx else 0)
        fewest = len(split.groups)
        count = comm.all_reduce_ints([fewest], op=dist.ReduceOp.MAX, group=self.dp_group)[0]
        groups = split.at_least(count)
        # every rank's mini-batch has as many rows, so none runs out of rows to split: a rank
        # with fewer backwards than the others would leave them waiting in ZeRO's collectives
        if len(groups) != count:
            raise RuntimeError(f"ppo.micro_batch_tokens: {len(mini)} rows cannot make the {count} "
                               f"micro-batches another data-parallel rank needs")
        return [mini[torch.tensor(g, dtype=torch.long)] for g in groups], fewest

    def _pooled(self, sums: dict, weights: dict, maxima: dict) -> dict[str, float]:
        """The update's statistics over every rank's tokens: each weighted mean is the sum over
        the ranks over their summed weights (a plain mean of the ranks' means would weigh a
        rank of few tokens as one of many), each maximum the ranks' largest. Every rank has
        the same keys (the step's metrics are one all-reduce): 0 for a statistic over no
        token."""
        keys, peaks = sorted(sums), sorted(maxima)
        if keys:
            both = comm.all_reduce(torch.stack([torch.stack([sums[k], weights[k]]) for k in keys]),
                                   group=self.dp_group)
            sums = {k: s for k, (s, _) in zip(keys, both)}
            weights = {k: w for k, (_, w) in zip(keys, both)}
        if peaks:
            largest = comm.all_reduce(torch.stack([maxima[k] for k in peaks]),
                                      op=dist.ReduceOp.MAX, group=self.dp_group)
            maxima = dict(zip(peaks, largest))
        stats = {k: (sums[k] / weights[k].clamp(min=1)).item() for k in keys}
        stats.update({k: v.item() for k, v in maxima.items()})
        return stats

    def _explained_variance(self, exp: Experience) -> float:
        """``1 - Var(R - V) / Var(R)`` over every rank's response tokens, V the critic's values
        at the rollout (what GAE used), R the returns: how much of the returns the critic
        predicted (1: all, 0: no better than their mean, below 0: worse); 0 where the returns
        do not vary. One figure for the step, as CleanRL and Stable-Baselines3 log it."""
        mask = exp.response_mask.double()
        returns = exp.returns.double()
        both = torch.stack([returns, exp.old_values.double() - returns])
        # two passes (the means first), as precise as a variance over one rank's tokens
        sums = comm.all_reduce(torch.cat([mask.sum()[None], (both * mask).sum((1, 2))]),
                               group=self.dp_group)
        n, means = sums[0].clamp(min=1), sums[1:] / sums[0].clamp(min=1)
        squares = comm.all_reduce((((both - means[:, None, None]) * mask) ** 2).sum((1, 2)),
                                  group=self.dp_group)
        var_returns, var_error = (squares / n).tolist()
        return 1.0 - var_error / var_returns if var_returns > 1e-12 else 0.0

    def _actor_loss(self, model, mb: Experience, normalizer):
        """``normalizer(mask)``: the micro-batch's ``aggregate_token_loss`` normalizer."""
        p = self.cfg.ppo
        mask = self._loss_mask(mb)
        normalizer = normalizer(mask)
        logprobs, logits = response_logprobs(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                                             mb.response_mask, self.cfg.generation.temperature,
                                             packed=self.cfg.system.packing_samples)
        if p.entropy_coef != 0:  # a bonus, or (negative) a penalty: its gradient either way
            entropy = entropy_from_logits(logits)
        else:
            with torch.no_grad():
                entropy = entropy_from_logits(logits)
        weights = None
        if self.cfg.oppo.off_policy == "truncated_is":
            weights = truncated_is_weights(mb.old_logprobs, mb.behaviour_logprobs, mask,
                                           self.cfg.oppo.is_clip)
        loss, stats = clipped_policy_loss(logprobs, mb.old_logprobs, mb.advantages, mask,
                                          p.clip_eps, normalizer, entropy=entropy,
                                          entropy_coef=p.entropy_coef, is_weights=weights,
                                          clip_eps_high=p.clip_eps_high, dual_clip=p.dual_clip,
                                          ratio_level=p.importance_sampling_level)
        if weights is not None:
            stats["is_weight_mean"] = masked_mean(weights, mask)
        if p.kl_penalty == "loss" and p.uses_reference:
            penalty, kl_stats = kl_loss(logprobs, mb.ref_logprobs, mask, self.kl_coef,
                                        normalizer, p.kl_estimator)
            loss = loss + penalty
            stats.update(kl_stats)
        return loss, stats

    @property
    def trained_engines(self) -> dict:
        """The models that train, by name: the actor, and the critic where there is one (a
        critic-free ppo.advantage_estimator has none); what checkpoints and exports hold."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    @property
    def actor_trains(self) -> bool:
        """Whether this step's update trains the actor (not in ppo.freeze_actor_steps)."""
        return self.step_count >= self.cfg.ppo.freeze_actor_steps

    @property
    def takes_ptx(self) -> bool:
        """Whether this step's update gives the actor a pretraining block a row (PPO-ptx while
        the actor trains): its backward and the micro-batches' token budget both count it."""
        return self.ptx_stream is not None and self.actor_trains

    @property
    def policy_version(self) -> int:
        """The actor's updates so far: the version of the policy sampling now (the steps of
        ppo.freeze_actor_steps changed nothing, so their tokens are not stale)."""
        return max(0, self.step_count - self.cfg.ppo.freeze_actor_steps)

    def _ptx_batch(self, n: int) -> torch.Tensor:
        return torch.tensor([b.input_ids for b in self.ptx_stream.take(n)], dtype=torch.long,
                            device=self.device)

    def _actor_ptx_loss(self, model, batch, normalizer, ptx_normalizer):
        """The policy loss of an experience micro-batch plus ppo.ptx_coef times the
        language-modelling loss of its pretraining blocks, in one backward."""
        mb, ptx_ids = batch
        loss, stats = self._actor_loss(model, mb, normalizer)
        ptx_loss, ptx_mean = lm_loss(model, ptx_ids, ptx_normalizer)
        stats["ptx_loss"] = ptx_mean
        return loss + self.cfg.ppo.ptx_coef * ptx_loss, stats

    def _critic_loss(self, model, mb: Experience, normalizer):
        values = response_values(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                                 mb.response_mask, packed=self.cfg.system.packing_samples)
        return clipped_value_loss(values, mb.old_values, mb.returns, mb.response_mask,
                                  self.cfg.ppo.value_clip_eps, normalizer)

    def _adapt_kl_coef(self, metrics: dict) -> None:
        """Log the KL coefficient this step used (kl/coef) and, with ppo.kl_target, move it
        for the next step by the step's KL, averaged over all actor ranks so that every rank
        holds the same coefficient (the tensor-parallel ranks of a Megatron replica too)."""
        p = self.cfg.ppo
        metrics["kl/coef"] = self.kl_coef
        if p.kl_target is None:
            return
        self.kl_coef = adaptive_kl_coef(self.kl_coef, self.agreed_mean(metrics["kl/mean"]),
                                        p.kl_target, metrics["samples"], p.kl_horizon)
