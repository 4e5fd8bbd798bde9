"""PPO losses (Schulman et al., 2017, arXiv 1707.06347) with token- or sequence-level aggregation."""

import torch

from oppo_ds.algo.kl import kl_penalty
from oppo_ds.algo.masked import masked_mean

Normalizer = float | torch.Tensor


def token_normalizer(
    global_tokens: Normalizer, grad_accum_steps: int, world_size: int
) -> Normalizer:
    """The ``normalizer`` for an engine that averages ``k`` loss contributions.

    DeepSpeed scales each micro-batch loss by ``1 / gradient_accumulation_steps``
    and all-reduce averages gradients over data-parallel ranks, so the applied
    gradient is the mean over ``k = grad_accum_steps * world_size``
    contributions. Each contribution normalised by ``global_tokens / k`` then
    yields exactly ``grad(sum of token losses) / global_tokens``.

    Args:
        global_tokens: valid tokens in the whole mini-batch (all micro-batches,
            all ranks), as a number or a 0-dim tensor.
        grad_accum_steps: micro-batches per rank per optimizer step.
        world_size: data-parallel ranks that average their gradients.

    Returns:
        ``global_tokens / (grad_accum_steps * world_size)``, same type as given.
    """
    if grad_accum_steps < 1 or world_size < 1:
        raise ValueError(
            f"grad_accum_steps and world_size must be >= 1, got {grad_accum_steps}, {world_size}"
        )
    return global_tokens / (grad_accum_steps * world_size)


LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
# where the policy ratio is taken: per token (PPO) or per response (GSPO)
RATIO_LEVELS = ("token", "sequence")


def loss_normalizer(
    mask: torch.Tensor,
    mode: str,
    global_tokens: Normalizer,
    global_sequences: Normalizer,
    grad_accum_steps: int,
    world_size: int,
    max_len: int | None = None,
) -> Normalizer | torch.Tensor:
    """The ``normalizer`` of ``aggregate_token_loss`` for one micro-batch under a loss
    aggregation ``mode``, for an engine that averages ``k = grad_accum_steps * world_size``
    contributions (see ``token_normalizer``). Summed over the micro-batches and ranks of a
    mini-batch, the aggregated loss is, with N the mini-batch's sequences and |o_i| the
    valid tokens of sequence i:

    - ``token_mean``: sum_i sum_t l_it / sum_i |o_i| (every token weighs the same; PPO as
      DeepSpeed-Chat and OpenRLHF train it, DAPO's token-level loss);
    - ``seq_mean_token_mean``: (1/N) sum_i (1/|o_i|) sum_t l_it (each sequence weighs the
      same, its tokens averaged first: the GRPO paper's objective);
    - ``seq_mean_token_sum_norm``: (1/N) sum_i sum_t l_it / max_len (a constant length in
      place of |o_i|: Dr. GRPO's, free of the per-sequence length bias).

    Args:
        mask: (B, T) valid tokens of this micro-batch.
        mode: one of ``LOSS_AGG_MODES``.
        global_tokens: valid tokens in the whole mini-batch (all micro-batches, all ranks).
        global_sequences: sequences in the whole mini-batch (N).
        grad_accum_steps, world_size: as in ``token_normalizer``.
        max_len: the constant length of ``seq_mean_token_sum_norm`` (the generation limit).

    Returns:
        A number or 0-dim tensor (``token_mean``, ``seq_mean_token_sum_norm``), or a (B, 1)
        tensor of per-sequence normalizers (``seq_mean_token_mean``).
    """
    if mode == "token_mean":
        return token_normalizer(global_tokens, grad_accum_steps, world_size)
    sequences = token_normalizer(global_sequences, grad_accum_steps, world_size)
    if mode == "seq_mean_token_mean":
        # an empty row adds nothing whatever its normalizer: 1 keeps it finite
        return mask.sum(-1, keepdim=True).clamp(min=1) * sequences
    if mode == "seq_mean_token_sum_norm":
        if max_len is None or max_len < 1:
            raise ValueError(f"seq_mean_token_sum_norm needs max_len >= 1, got {max_len}")
        return max_len * sequences
    raise ValueError(f"unknown loss aggregation {mode!r}; one of {', '.join(LOSS_AGG_MODES)}")


def aggregate_token_loss(
    token_loss: torch.Tensor, mask: torch.Tensor, normalizer: Normalizer
) -> torch.Tensor:
    """Sum the valid token losses and divide by ``normalizer``.

    ``normalizer`` must be the number of valid tokens in the WHOLE mini-batch
    (all micro-batches on all ranks), not of this micro-batch: then summing
    the per-micro-batch losses (and their gradients) gives the token mean over
    the mini-batch, so every token weighs the same however the batch is split.
    A local ``mask.sum()`` would overweight tokens of short micro-batches.

    An engine that averages gradients over ``k`` micro-batch/rank
    contributions (DeepSpeed divides by gradient_accumulation_steps and
    averages over data-parallel ranks) must be given
    ``normalizer = global_tokens / k``, i.e.
    ``token_normalizer(global_tokens, grad_accum_steps, world_size)``, so that
    the accumulated gradient equals the full-batch token mean.

    A (B, 1) ``normalizer`` divides each sequence's token losses by its own number (the
    per-sequence aggregations of ``loss_normalizer``).

    Args:
        token_loss: (B, T) per-token losses.
        mask: (B, T) 1.0 for valid tokens, 0.0 for padding.
        normalizer: positive number or 0-dim tensor, as above, or (B, 1) per sequence.

    Returns:
        0-dim loss tensor.
    """
    if isinstance(normalizer, (int, float)) and normalizer <= 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    masked = torch.where(mask.bool(), token_loss, 0.0)
    if isinstance(normalizer, torch.Tensor) and normalizer.dim() > 0:
        return (masked / normalizer).sum()
    return masked.sum() / normalizer


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    normalizer: Normalizer,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    ratio_level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss, optionally with an entropy bonus.

    Per token, with ``ratio = exp(logprobs - old_logprobs)``::

        loss_t = max(-A_t * ratio, -A_t * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))

    and with ``dual_clip`` (c > 1; Ye et al., "Mastering Complex Control in MOBA Games
    with Deep Reinforcement Learning", 2020), where A_t < 0, ``min(loss_t, -c * A_t)``: a
    ratio far above 1 on a token with a negative advantage adds at most c |A_t|, without
    gradient. Aggregated by ``aggregate_token_loss``; minus ``entropy_coef`` times the
    equally aggregated entropy when ``entropy`` is given.

    With ``ratio_level="sequence"`` (GSPO: Zheng et al., "Group Sequence Policy
    Optimization", 2025; TRL's ``importance_sampling_level``) every token of a response takes
    the response's ratio, the geometric mean of its tokens' ratios
    ``exp(mean_t(logprobs - old_logprobs))``, so a response is clipped as a whole and each of
    its tokens' log-probs gets 1/|y| of its gradient.

    Args:
        logprobs: (B, T) log pi_theta of the response tokens (with grad).
        old_logprobs: (B, T) log pi_old of the same tokens, from the rollout.
        advantages: (B, T) advantages (usually whitened).
        mask: (B, T) 1.0 for response tokens, 0.0 for padding.
        clip_eps: PPO clip range epsilon.
        normalizer: see ``aggregate_token_loss``.
        entropy: optional (B, T) per-token policy entropy (with grad if
            ``entropy_coef`` is nonzero).
        entropy_coef: weight of the entropy bonus; needs ``entropy``.
        is_weights: optional (B, T) detached per-token importance weights
            (``truncated_is_weights``) multiplying each token's surrogate, for
            tokens sampled by an older policy than the one ``old_logprobs``
            come from.
        clip_eps_high: the upper clip range (DAPO's clip-higher); None = ``clip_eps``.
        dual_clip: the dual-clip bound c (> 1) on negative-advantage tokens; None = off.
        ratio_level: ``"token"`` (PPO's) or ``"sequence"`` (GSPO's), see above.

    Returns:
        loss: 0-dim tensor.
        stats: 0-dim detached tensors: ``pg_loss`` (token mean of the clipped
            surrogate), ``clip_frac`` (fraction of tokens where the clipped
            term is the larger, i.e. whose gradient clipping removed),
            ``approx_kl`` (k3 estimate of KL(pi_old || pi_theta), token mean),
            ``ratio_mean``, ``ratio_max``, ``entropy`` if given, and with ``dual_clip``
            ``dual_clip_frac`` (fraction of tokens its bound capped).
    """
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef is nonzero but no entropy was given")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    valid = mask.bool()
    # Zero the log-ratio at padding before exp(): where() alone would still
    # backpropagate 0 * inf = NaN from an overflowing padded ratio.
    log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0)
    if ratio_level == "sequence":  # the mean over the response's tokens, on each of them
        per_row = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = torch.where(valid, per_row.expand_as(log_ratio), 0.0)
    ratio = torch.exp(log_ratio)
    advantages = torch.where(valid, advantages, 0.0)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + high)
    token_loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        capped = (advantages < 0) & (token_loss > -dual_clip * advantages)
        token_loss = torch.where(capped, -dual_clip * advantages, token_loss)
    if is_weights is not None:
        token_loss = token_loss * is_weights.detach()
    loss = aggregate_token_loss(token_loss, mask, normalizer)
    if entropy is not None and entropy_coef != 0.0:
        loss = loss - entropy_coef * aggregate_token_loss(entropy, mask, normalizer)

    with torch.no_grad():
        old_masked = torch.where(valid, old_logprobs, 0.0)
        new_masked = torch.where(valid, logprobs, 0.0)
        stats = {
            "pg_loss": masked_mean(token_loss, mask),
            "clip_frac": masked_mean((clipped > unclipped).to(ratio.dtype), mask),
            "approx_kl": masked_mean(kl_penalty(old_masked, new_masked, "k3"), mask),
            "ratio_mean": masked_mean(ratio, mask),
            # ratio > 0, so 0 at padding never wins the max over valid tokens.
            "ratio_max": torch.where(valid, ratio, 0.0).max(),
        }
        if entropy is not None:
            stats["entropy"] = masked_mean(entropy, mask)
        if dual_clip is not None:
            stats["dual_clip_frac"] = masked_mean(capped.to(ratio.dtype), mask)
    return loss, {k: v.detach() for k, v in stats.items()}


def truncated_is_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
) -> torch.Tensor:
    """Truncated importance weights ``min(pi_old / mu, clip)`` per token.

    With overcommitment, the tokens of a deferred response were sampled by
    ``mu``, the policy of the step that decoded them, while PPO's ratio is taken
    against ``pi_old``, the current actor's log-probs recomputed at the start of
    the update. Weighting each token's surrogate by ``pi_old(a) / mu(a)``
    corrects the expectation to ``pi_old``'s; truncating at ``clip`` bounds the
    variance (the bias is small while the policies are close), as in
    truncated importance sampling (Espeholt et al., 2018, arXiv 1802.01561).
    For a token sampled by ``pi_old`` itself the weight is 1 up to rounding.

    Args:
        old_logprobs: (B, T) log pi_old of the response tokens.
        behaviour_logprobs: (B, T) log mu, recorded when each token was sampled.
        mask: (B, T) 1.0 for response tokens, 0.0 for padding.
        clip: upper bound of the weight, >= 1.

    Returns:
        (B, T) detached weights, 0.0 at padding.
    """
    if clip < 1.0:
        raise ValueError(f"clip must be >= 1, got {clip}")
    valid = mask.bool()
    log_w = torch.where(valid, old_logprobs - behaviour_logprobs, 0.0)
    # clamp in log space first: exp of a large log-ratio would overflow to inf
    w = torch.exp(log_w.clamp(max=float(torch.log(torch.tensor(clip)))))
    return torch.where(valid, w, 0.0).detach()


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None,
    normalizer: Normalizer,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss, aggregated by ``aggregate_token_loss``.

    Per token, with ``v_clip = clip(v, old_v - clip_eps, old_v + clip_eps)``::

        loss_t = 0.5 * max((v - R)^2, (v_clip - R)^2)

    Args:
        values: (B, T) current critic values (with grad).
        old_values: (B, T) critic values from the rollout.
        returns: (B, T) value targets (from ``gae_advantages``).
        mask: (B, T) 1.0 for response tokens, 0.0 for padding.
        clip_eps: value clip range; None for the unclipped ``0.5 * (v - R)^2``.
        normalizer: see ``aggregate_token_loss``.

    Returns:
        loss: 0-dim tensor.
        stats: 0-dim detached tensors: ``vf_loss`` (token mean),
            ``value_clip_frac`` (fraction of tokens where the clipped term is
            the larger).
    """
    valid = mask.bool()
    error = torch.where(valid, values - returns, 0.0)
    unclipped = error**2
    if clip_eps is None:
        clipped = unclipped
    else:
        delta = torch.where(valid, values - old_values, 0.0)
        values_clipped = old_values + delta.clamp(-clip_eps, clip_eps)
        clipped = torch.where(valid, values_clipped - returns, 0.0) ** 2
    token_loss = 0.5 * torch.maximum(unclipped, clipped)
    loss = aggregate_token_loss(token_loss, mask, normalizer)

    with torch.no_grad():
        stats = {
            "vf_loss": masked_mean(token_loss, mask),
            "value_clip_frac": masked_mean((clipped > unclipped).to(values.dtype), mask),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    normalizer: Normalizer,
    estimator: str = "k3",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The KL to the reference as a loss to add to the policy loss (GRPO's; OpenRLHF's
    ``--use_kl_loss``), instead of a penalty in the rewards: ``coef *
    aggregate_token_loss(kl_t)`` with ``kl_t`` the per-token estimate of KL(pi_theta || ref)
    at the sampled tokens, whose gradient goes through ``logprobs`` only.

    Over tokens sampled by pi_theta, mse's (k2's) gradient is in expectation that of
    KL(pi_theta || ref), k3's that of KL(ref || pi_theta) (close to it near the reference),
    and k1's is zero: k1 regularises nothing as a loss.

    Args:
        logprobs: (B, T) log pi_theta of the response tokens (with grad).
        ref_logprobs: (B, T) log ref of the same tokens.
        mask: (B, T) 1.0 for response tokens, 0.0 for padding.
        coef: the KL coefficient.
        normalizer: see ``aggregate_token_loss``.
        estimator: a key of ``KL_ESTIMATORS``.

    Returns:
        loss: 0-dim tensor.
        stats: ``kl_loss`` (token mean of the estimate), 0-dim detached.
    """
    kl = kl_penalty(logprobs, ref_logprobs.detach(), estimator, mask=mask)
    return coef * aggregate_token_loss(kl, mask, normalizer), {"kl_loss": masked_mean(kl, mask).detach()}


def entropy_bonus_loss(
    entropy: torch.Tensor, mask: torch.Tensor, coef: float, normalizer: Normalizer
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Entropy bonus as a loss to add: ``-coef * aggregate_token_loss(entropy)``.

    For engines that keep the policy and entropy terms separate; otherwise pass
    ``entropy`` and ``entropy_coef`` to ``clipped_policy_loss``.

    Args:
        entropy: (B, T) per-token policy entropy (with grad).
        mask: (B, T) 1.0 for response tokens, 0.0 for padding.
        coef: entropy coefficient (positive encourages exploration).
        normalizer: see ``aggregate_token_loss``.

    Returns:
        loss: 0-dim tensor.
        stats: ``entropy`` (token mean), 0-dim detached.
    """
    loss = -coef * aggregate_token_loss(entropy, mask, normalizer)
    return loss, {"entropy": masked_mean(entropy, mask).detach()}
