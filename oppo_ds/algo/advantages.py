"""Generalized advantage estimation (Schulman et al., 2016, arXiv 1506.02438)."""

import torch


@torch.no_grad()
def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and lambda-returns for token-level rewards.

    Over the valid tokens of a row, with V(after the last valid token) = 0
    because the episode ends there::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t

    Padded positions are skipped, not treated as an episode end: the
    recursion carries ``V`` and ``A`` of the next valid token across them.
    For the usual right-padded mask this is the same thing, and it keeps the
    function right for masks with holes (e.g. tokens not produced by the
    policy). Nothing stored at a padded position reaches a valid one.

    Runs without autograd: advantages and returns are fixed targets for the
    update, and a graph through the old values would be wrong, not just slow.

    Args:
        rewards: (B, T) per-token rewards (e.g. from ``kl_shaped_rewards``).
        values: (B, T) critic values V(prompt + response[:t]) of the same tokens.
        mask: (B, T) 1.0 for response tokens, 0.0 for padding.
        gamma: discount factor.
        lam: GAE lambda.

    Returns:
        advantages: (B, T), 0 at padded positions.
        returns: (B, T) ``advantages + values``, 0 at padded positions.
    """
    valid = mask.bool()
    # where() rather than multiplication: a NaN at padding must not propagate.
    rewards = torch.where(valid, rewards, 0.0)
    values = torch.where(valid, values, 0.0)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        valid_t = valid[:, t]
        advantages[:, t] = torch.where(valid_t, advantage, 0.0)
        next_value = torch.where(valid_t, values[:, t], next_value)
        next_advantage = torch.where(valid_t, advantage, next_advantage)
    returns = torch.where(valid, advantages + values, 0.0)
    return advantages, returns
