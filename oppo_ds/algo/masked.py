"""Statistics over the valid (unmasked) entries of a tensor.

Masking uses ``torch.where`` rather than multiplication by the mask, so that a
NaN or inf sitting in a padded position cannot turn the result into NaN
(``nan * 0`` is NaN).
"""

import torch


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None
) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is nonzero.

    Args:
        x: (B, T) values (any shape works if ``mask`` has the same shape).
        mask: (B, T) 1.0 for valid entries, 0.0 for padding.
        dim: reduce only this dimension; None reduces everything to a 0-dim tensor.

    Returns:
        0-dim tensor (``dim=None``) or ``x`` reduced over ``dim``. An empty
        selection gives 0 rather than NaN, so an all-padding micro-batch does
        not poison logged statistics.
    """
    weights = mask.to(x.dtype)
    total = torch.where(mask.bool(), x, 0.0) * weights
    if dim is None:
        return total.sum() / _safe_count(weights.sum())
    return total.sum(dim) / _safe_count(weights.sum(dim))


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True
) -> torch.Tensor:
    """Variance of ``x`` over the entries where ``mask`` is nonzero.

    Args:
        x: (B, T) values.
        mask: (B, T) 1.0 for valid entries, 0.0 for padding.
        unbiased: apply Bessel's correction ``n / (n - 1)``.

    Returns:
        0-dim tensor. Zero when fewer than two entries are valid (with
        ``unbiased``) or none are (without).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if not unbiased:
        return var
    count = mask.to(x.dtype).sum()
    return torch.where(count > 1, var * count / (count - 1).clamp_min(1.0), 0.0)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    mean: torch.Tensor | None = None,
    var: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalise the valid entries of ``x`` to zero mean and unit variance.

    Args:
        x: (B, T) values, typically advantages.
        mask: (B, T) 1.0 for valid entries, 0.0 for padding.
        shift_mean: if False, only rescale and keep the original mean
            (useful for rewards, whose sign carries meaning).
        eps: added to the variance before the square root.
        mean: 0-dim mean to use instead of the local one; pass statistics
            reduced across data-parallel ranks here so every rank whitens with
            the same numbers as a single-process run would.
        var: 0-dim variance to use instead of the local (unbiased) one.

    Returns:
        (B, T) whitened values; padded positions are 0.
    """
    if mean is None:
        mean = masked_mean(x, mask)
    if var is None:
        var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)


def _safe_count(count: torch.Tensor) -> torch.Tensor:
    # The numerator is exactly 0 whenever the count is, so any positive floor
    # turns 0/0 into 0 without changing nonempty results.
    return count.clamp_min(torch.finfo(count.dtype).tiny)
