"""Per-token estimators of KL(pi || ref) from log-probabilities of sampled tokens.

Every estimator takes ``logprobs`` (log pi of the sampled token) and
``ref_logprobs`` (log ref of the same token), both (B, T), where the token was
sampled from pi. With ``log_ratio = logprobs - ref_logprobs``, the sums over a
response estimate the sequence-level KL(pi || ref) (see J. Schulman,
"Approximating KL Divergence", 2020, for k1/k2/k3).
"""

from collections.abc import Callable

import torch


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = logprobs - ref_logprobs: unbiased, high variance, can be negative.

    Shapes: (B, T), (B, T) -> (B, T).
    """
    return logprobs - ref_logprobs


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1: unbiased, low variance, >= 0.

    The ``- (ref - logp)`` term is a control variate with expectation 0 under
    pi, and ``exp(u) - u - 1 >= 0`` for every u, so each sample is nonnegative.
    Shapes: (B, T), (B, T) -> (B, T).
    """
    log_ref_ratio = ref_logprobs - logprobs
    return torch.expm1(log_ref_ratio) - log_ref_ratio


def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """abs = |logprobs - ref_logprobs|: biased, >= 0.

    Shapes: (B, T), (B, T) -> (B, T).
    """
    return (logprobs - ref_logprobs).abs()


def kl_mse(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """mse (Schulman's k2) = 0.5 * (logprobs - ref_logprobs)^2: biased, low variance, >= 0.

    Shapes: (B, T), (B, T) -> (B, T).
    """
    return 0.5 * (logprobs - ref_logprobs) ** 2


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "k3": kl_k3,
    "abs": kl_abs,
    "mse": kl_mse,
}


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate by the estimator named ``estimator``.

    Args:
        logprobs: (B, T) log pi of the sampled tokens (the sampling policy).
        ref_logprobs: (B, T) log ref of the same tokens.
        estimator: a key of ``KL_ESTIMATORS``: "k1", "k3", "abs" or "mse".
        mask: optional (B, T), 1.0 for valid tokens: both inputs are zeroed at padding first,
            which makes every estimator exactly 0 there even when padded log-probs are
            garbage (k3 would otherwise exp() them).

    Returns:
        (B, T) per-token estimates; unmasked without ``mask``.

    Raises:
        ValueError: if ``estimator`` is not a known name.
    """
    try:
        fn = KL_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; allowed: {sorted(KL_ESTIMATORS)}"
        ) from None
    if mask is not None:
        valid = mask.bool()
        logprobs, ref_logprobs = torch.where(valid, logprobs, 0.0), torch.where(valid, ref_logprobs, 0.0)
    return fn(logprobs, ref_logprobs)


def adaptive_kl_coef(coef: float, kl: float, target: float, samples: int, horizon: int,
                     max_error: float = 0.2) -> float:
    """The KL coefficient after one step of the proportional controller of Ziegler et al.,
    "Fine-Tuning Language Models from Human Preferences" (2019), section 2.2.

    ``coef * (1 + e * samples / horizon)`` with ``e = clip(kl / target - 1, -max_error,
    max_error)``: the coefficient grows while the measured KL is above the target and shrinks
    while it is below, by at most ``max_error * samples / horizon`` of itself per step, so that
    over ``horizon`` samples the gap closes at a bounded rate whatever one noisy step measured.

    Args:
        coef: the coefficient this step used (> 0; a coefficient of 0 stays 0).
        kl: the step's KL, in the units of ``target`` (oppo-ds: per response, summed over
            its tokens, averaged over the step's responses).
        target: the KL aimed at (> 0).
        samples: responses the step trained on, on all ranks.
        horizon: responses over which the controller corrects (> 0).
        max_error: the bound on the relative error e.
    """
    if target <= 0 or horizon <= 0:
        raise ValueError(f"need target > 0 and horizon > 0, got target={target}, horizon={horizon}")
    error = min(max(kl / target - 1.0, -max_error), max_error)
    return coef * (1.0 + error * samples / horizon)
