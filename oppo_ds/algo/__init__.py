"""Pure PPO math: tensors in, tensors out; imports nothing but torch.

Shape conventions: B = batch, T = response length (right-padded), V = vocabulary.
``mask`` (B, T) is 1.0 for response tokens (EOS included) and 0.0 for padding;
``logprobs[b, t]`` is log pi(response token t | prompt + response[:t]).
"""

from oppo_ds.algo.advantages import gae_advantages
from oppo_ds.algo.baselines import (
    CRITIC_FREE_ESTIMATORS,
    GROUP_ESTIMATORS,
    group_baseline_scores,
)
from oppo_ds.algo.kl import (
    KL_ESTIMATORS,
    adaptive_kl_coef,
    kl_abs,
    kl_k1,
    kl_k3,
    kl_mse,
    kl_penalty,
)
from oppo_ds.algo.logprobs import (entropy_from_logits, logprobs_from_logits, policy_logits,
                                   policy_token_logprobs)
from oppo_ds.algo.losses import (
    LOSS_AGG_MODES,
    RATIO_LEVELS,
    aggregate_token_loss,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_bonus_loss,
    kl_loss,
    loss_normalizer,
    token_normalizer,
    truncated_is_weights,
)
from oppo_ds.algo.masked import masked_mean, masked_var, masked_whiten
from oppo_ds.algo.rewards import kl_shaped_rewards, last_valid_index, overlong_penalty, truncated_rows

__all__ = [
    "CRITIC_FREE_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "RATIO_LEVELS",
    "adaptive_kl_coef",
    "aggregate_token_loss",
    "clipped_policy_loss",
    "clipped_value_loss",
    "entropy_bonus_loss",
    "entropy_from_logits",
    "gae_advantages",
    "group_baseline_scores",
    "kl_abs",
    "kl_k1",
    "kl_k3",
    "kl_loss",
    "kl_mse",
    "kl_penalty",
    "kl_shaped_rewards",
    "last_valid_index",
    "logprobs_from_logits",
    "policy_token_logprobs",
    "policy_logits",
    "loss_normalizer",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "token_normalizer",
    "truncated_is_weights",
    "truncated_rows",
]
