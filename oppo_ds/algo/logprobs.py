"""Token log-probabilities and entropies from language-model logits."""
from __future__ import annotations

import torch


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under the softmax of its logits.

    Args:
        logits: (B, T, V) logits; position t must already be the prediction for
            ``labels[:, t]`` (the caller shifts model outputs by one).
        labels: (B, T) token ids.

    Returns:
        (B, T) float32 (or float64 if the logits are) log-probabilities,
        ``log softmax(logits)[b, t, labels[b, t]]``.
    """
    # bf16/fp16 log_softmax over a large vocabulary loses several bits, and the
    # PPO ratio exp(logp - old_logp) amplifies such errors; fp32 is the minimum.
    logits = _upcast(logits)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(dim=-1, index=labels.long().unsqueeze(-1)).squeeze(-1)


def policy_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The sampling policy's logits: upcast to fp32 (fp64 stays), then divided by the
    temperature (as they are at 0, greedy decoding). Every site that turns a model's logits
    into policy log-probs goes through here (the decode's, the update's, the reference's,
    streamed or not), so the same logits give the same log-probs everywhere: dividing bf16
    logits before the upcast rounds the quotient to bf16 again (about 0.02 nats a token at
    T = 0.7), and the first epoch's ratio pi / pi_old would start off 1 that much."""
    logits = _upcast(logits)
    return logits / temperature if temperature > 0 else logits


# elements of logits one block of ``policy_token_logprobs`` takes at a time: its fp32 copies
# (upcast, divided by the temperature, log-softmax) are 12 bytes an element, 384 MiB here
BLOCK_ELEMENTS = 32 * 2 ** 20


@torch.no_grad()
def policy_token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float, *,
                          select=None, block_elements: int | None = None) -> torch.Tensor:
    """``logprobs_from_logits(policy_logits(logits, temperature), labels)`` without autograd,
    taken over blocks of rows (the first dimension), so that the fp32 copies a vocabulary
    needs exist for one block at a time: all at once, 64 rows of 1024 positions of a 128k
    vocabulary would take 96 GiB beside the logits. Each row's figures are those of the
    whole call (rows are computed independently).

    ``select(rows)``, when given, returns the block's logits (…, V) from ``logits``: a
    gather (the prefill's prefix positions) done block by block too, rather than copied
    whole first; ``labels`` is then (rows, …) matching what it returns."""
    rows = labels.shape[0]
    per_row = max(1, labels[:1].numel()) * logits.shape[-1]
    step = max(1, (block_elements or BLOCK_ELEMENTS) // per_row)
    out = []
    for start in range(0, rows, step):
        part = slice(start, min(start + step, rows))
        block = logits[part] if select is None else select(part)
        out.append(logprobs_from_logits(policy_logits(block, temperature), labels[part]))
    return torch.cat(out) if out else labels.new_zeros(labels.shape, dtype=torch.float32)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by each logit vector.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``, which equals
    ``-sum_v p_v log p_v`` without ever taking ``log 0``.

    Args:
        logits: (B, T, V) logits.

    Returns:
        (B, T) entropies in nats, float32 (or float64 if the logits are).
    """
    logits = _upcast(logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    if logits.dtype in (torch.float16, torch.bfloat16):
        return logits.float()
    return logits
