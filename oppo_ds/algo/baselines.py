"""Group baselines of the critic-free estimators (``ppo.advantage_estimator``).

Without a critic, a response's advantage comes from its score against the other responses
sampled for the same prompt (its *group*, ``data.samples_per_prompt`` of them):

  * ``reinforce``: no baseline, the score itself (REINFORCE; REINFORCE++ with whitening).
  * ``rloo``: the score minus the mean of the *other* responses' scores (leave-one-out,
    Ahmadian et al. 2024): an unbiased baseline, since it does not depend on the response.
  * ``reinforce_baseline``: the score minus the group's mean (REINFORCE++-baseline).
  * ``group_norm``: the score minus the group's mean, divided by the group's standard
    deviation (GRPO, Shao et al. 2024).

These act on the sequence scores only; the per-token KL penalty (``kl_shaped_rewards``) and
the returns over tokens come after, as with GAE.
"""

import torch

GROUP_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm")
CRITIC_FREE_ESTIMATORS = ("reinforce",) + GROUP_ESTIMATORS


@torch.no_grad()
def group_baseline_scores(scores: torch.Tensor, groups: torch.Tensor, estimator: str,
                          eps: float = 1e-6) -> torch.Tensor:
    """``scores`` (B,) with their group baseline taken off, by ``estimator``.

    Args:
        scores: (B,) one score per response.
        groups: (B,) integer labels; responses with the same label share a prompt. Any
            labels and any order: rows of a group need not be adjacent.
        estimator: one of ``CRITIC_FREE_ESTIMATORS``.
        eps: added to the group's standard deviation (``group_norm``), so a group whose
            responses all scored alike gets advantages 0, not NaN.

    ``group_norm`` divides by the unbiased standard deviation (n - 1), as ``torch.std`` and
    the GRPO implementations do. ``rloo`` needs at least 2 responses in every group (with one
    there are no others to compare with); the others accept groups of 1 (``reinforce_baseline``
    and ``group_norm`` then give 0).
    """
    if estimator == "reinforce":
        return scores.clone()
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {CRITIC_FREE_ESTIMATORS}")
    if scores.shape != groups.shape or scores.dim() != 1:
        raise ValueError(f"scores and groups must both be (B,), got {tuple(scores.shape)} "
                         f"and {tuple(groups.shape)}")
    _, index = torch.unique(groups, return_inverse=True)
    x = scores.double()
    n = torch.zeros(int(index.max()) + 1 if index.numel() else 0, dtype=torch.float64,
                    device=scores.device)
    n = n.index_add(0, index, torch.ones_like(x))
    total = torch.zeros_like(n).index_add(0, index, x)
    size, group_sum = n[index], total[index]
    if estimator == "rloo":
        if bool((size < 2).any()):
            raise ValueError("rloo needs at least 2 responses per prompt (data.samples_per_prompt "
                             f">= 2); group sizes here: {sorted(set(n.long().tolist()))}")
        out = x - (group_sum - x) / (size - 1)
    else:
        mean = group_sum / size
        out = x - mean
        if estimator == "group_norm":
            sq = torch.zeros_like(n).index_add(0, index, (x - mean).pow(2))[index]
            std = (sq / (size - 1).clamp(min=1)).sqrt()
            out = out / (std + eps)
    return out.to(scores.dtype)
