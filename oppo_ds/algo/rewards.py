"""Per-token rewards: a sequence score at the end, a KL penalty at every token."""

from typing import Callable

import torch

from oppo_ds.algo.kl import kl_penalty


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last valid token of each row.

    Args:
        mask: (B, T) 1.0 for valid tokens, 0.0 for padding.

    Returns:
        (B,) long tensor; ``mask.sum(-1) - 1`` for right-padded masks, and -1
        for rows with no valid token.
    """
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, -1).amax(dim=-1)


def truncated_rows(response_ids: torch.Tensor, mask: torch.Tensor, end_ids,
                   max_new_tokens: int) -> torch.Tensor:
    """Which responses reached the length limit without an end id (TRL's "missing EOS"):
    (B,) bool.

    Args:
        response_ids: (B, T) response tokens, right-padded.
        mask: (B, T) 1.0 for response tokens (the end id included), 0.0 for padding.
        end_ids: the ids that end a response.
        max_new_tokens: the response length limit.
    """
    lengths = mask.sum(-1).long()
    last = response_ids.gather(1, last_valid_index(mask).clamp_min(0).unsqueeze(1)).squeeze(1)
    ends = torch.as_tensor(list(end_ids), dtype=response_ids.dtype, device=response_ids.device)
    return (lengths >= max_new_tokens) & ~torch.isin(last, ends)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_len: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, as a (B,) penalty to take off the scores.

    A response of at most ``max_new_tokens - buffer_len`` tokens loses nothing; past that the
    penalty grows linearly with every token into the buffer and is ``factor`` at
    ``max_new_tokens`` (where every response stops): ``factor * clamp(L - (max_new_tokens -
    buffer_len), 0, buffer_len) / buffer_len``. Long responses then earn a little less the
    longer they run, instead of the cliff a truncated response meets at the limit.

    Args:
        lengths: (B,) response lengths in tokens, the end id included.
        max_new_tokens: the response length limit.
        buffer_len: tokens before the limit over which the penalty rises, in (0, max_new_tokens].
        factor: the penalty at the limit, >= 0.
    """
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"buffer_len must be in (0, max_new_tokens={max_new_tokens}], got {buffer_len}")
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    into = (lengths.double() - (max_new_tokens - buffer_len)).clamp(0, buffer_len)
    return factor * into / buffer_len


def kl_shaped_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
    reward_clip: float | None = None,
    penalty: torch.Tensor | None = None,
    baseline: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token rewards ``-kl_coef * kl_t``, plus the sequence score at the last token.

    Args:
        scores: (B,) reward-model score of each whole response.
        logprobs: (B, T) log pi of the response tokens (the policy that sampled them).
        ref_logprobs: (B, T) log ref of the same tokens.
        mask: (B, T) 1.0 for response tokens (EOS included), 0.0 for padding.
        kl_coef: weight beta of the per-token KL penalty.
        estimator: KL estimator name, see ``KL_ESTIMATORS``.
        reward_clip: if set, scores are clipped to ``[-reward_clip, reward_clip]``
            before being added.
        penalty: (B,) subtracted from each score after the clipping, so that a penalty
            (``missing_eos_penalty``) still bites on a score at the clip bound.
        baseline: applied to the (B,) scores after clipping and penalty, before they are
            placed at the last token: a critic-free estimator's group baseline
            (``group_baseline_scores``); the stats still describe the scores before it.

    Returns:
        rewards: (B, T), zero at padding. The (clipped) score is added at the
            last valid token of each row (``mask.sum(-1) - 1`` for right-padded
            masks); a row with no valid token gets no score.
        stats: 0-dim detached tensors: ``kl`` (per-sequence KL summed over
            tokens, averaged over the batch), ``score`` (mean raw score),
            ``score_clip_frac`` (fraction of scores changed by clipping).
    """
    kl = kl_penalty(logprobs, ref_logprobs, estimator, mask=mask)  # exactly 0 at padding
    rewards = -kl_coef * kl

    clipped = scores.to(rewards.dtype)
    if reward_clip is not None:
        if reward_clip <= 0:
            raise ValueError(f"reward_clip must be > 0 or None, got {reward_clip}")
        clipped = clipped.clamp(-reward_clip, reward_clip)
    score_clip_frac = (clipped != scores.to(clipped.dtype)).float().mean().detach()
    if penalty is not None:
        clipped = clipped - penalty.to(clipped.dtype)
    if baseline is not None:
        clipped = baseline(clipped)
    last = last_valid_index(mask)
    has_tokens = last >= 0
    score_at_end = torch.where(has_tokens, clipped, 0.0)
    rewards = rewards.scatter_add(1, last.clamp_min(0).unsqueeze(1), score_at_end.unsqueeze(1))

    stats = {
        "kl": kl.sum(dim=-1).mean().detach(),
        "score": scores.float().mean().detach(),
        "score_clip_frac": score_clip_frac,
    }
    return rewards, stats
