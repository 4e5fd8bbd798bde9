"""Tier 0: pure PPO math against hand-derived values and loop references (CPU, fast)."""

import math
import os
import subprocess
import sys

import pytest
import torch

from oppo_ds.algo import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    aggregate_token_loss,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_bonus_loss,
    entropy_from_logits,
    gae_advantages,
    kl_loss,
    kl_penalty,
    kl_shaped_rewards,
    logprobs_from_logits,
    loss_normalizer,
    masked_mean,
    masked_var,
    masked_whiten,
    overlong_penalty,
    token_normalizer,
    truncated_is_weights,
    truncated_rows,
)

F64 = torch.float64
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def t(rows):
    return torch.tensor(rows, dtype=F64)


def random_mask(gen, batch, length, holes=False):
    if holes:
        return (torch.rand(batch, length, generator=gen) < 0.6).to(F64)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[0], lengths[-1] = 0, length  # always cover the empty and the full row
    return (torch.arange(length) < lengths[:, None]).to(F64)


# ---- log-probs and entropy ------------------------------------------------------------


def test_logprobs_and_entropy_match_categorical():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen, dtype=F64) * 3
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    dist = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), dist.log_prob(labels))
    torch.testing.assert_close(entropy_from_logits(logits), dist.entropy())
    # Uniform logits: H = log V; near-one-hot logits: H ~ 0 and no NaN from log(0).
    assert torch.allclose(entropy_from_logits(torch.zeros(1, 1, 8)), torch.tensor(math.log(8)))
    peaked = torch.tensor([[[1e4, 0.0, 0.0]]])
    assert entropy_from_logits(peaked).abs().item() < 1e-6


def test_logprobs_upcast_half_precision_logits_to_fp32():
    logits = torch.randn(1, 3, 50).to(torch.bfloat16)
    labels = torch.tensor([[1, 2, 3]])
    out = logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(out, expected)


# ---- KL estimators and shaped rewards -------------------------------------------------

# logp = log 0.5, ref = log 0.25, so logp - ref = log 2:
#   k1 = log 2 = 0.693147;   abs = log 2;   mse = 0.5 * (log 2)^2 = 0.240227
#   k3 = exp(-log 2) - (-log 2) - 1 = 0.5 + 0.693147 - 1 = 0.193147
LN2 = math.log(2.0)


@pytest.mark.parametrize(
    "name, expected",
    [("k1", LN2), ("k3", 0.5 + LN2 - 1.0), ("abs", LN2), ("mse", 0.5 * LN2**2)],
)
def test_kl_estimators_hand_values(name, expected):
    logp, ref = t([[math.log(0.5)]]), t([[math.log(0.25)]])
    torch.testing.assert_close(kl_penalty(logp, ref, name), t([[expected]]))
    # Swapping the roles flips the sign of k1 only.
    swapped = kl_penalty(ref, logp, name)
    expected_swapped = -LN2 if name == "k1" else (2.0 - LN2 - 1.0 if name == "k3" else expected)
    torch.testing.assert_close(swapped, t([[expected_swapped]]))


def test_kl_k3_nonnegative_and_unknown_name_raises():
    gen = torch.Generator().manual_seed(1)
    logp, ref = torch.randn(64, 8, generator=gen), torch.randn(64, 8, generator=gen)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert set(KL_ESTIMATORS) == {"k1", "k3", "abs", "mse"}
    with pytest.raises(ValueError, match="k1.*k3"):
        kl_penalty(logp, ref, "k2")


def test_kl_shaped_rewards_score_lands_at_last_valid_token():
    # ref = 0 so k1 = logp; kl_coef = 0.1 so each valid token gets -0.1 * logp.
    nan = float("nan")
    logp = t([[-1.0, -2.0, -0.5, nan], [-0.3, 7.0, 7.0, 7.0], [9.0, 9.0, 9.0, 9.0], [-1.0] * 4])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    scores = t([2.0, -1.0, 5.0, 0.5])
    rewards, stats = kl_shaped_rewards(scores, logp, torch.zeros_like(logp), mask, kl_coef=0.1)
    expected = t(
        [
            [0.1, 0.2, 0.05 + 2.0, 0.0],  # length 3: score at index 2
            [0.03 - 1.0, 0.0, 0.0, 0.0],  # length 1: score at index 0
            [0.0, 0.0, 0.0, 0.0],  # empty row: no score anywhere
            [0.1, 0.1, 0.1, 0.1 + 0.5],  # full row: score at index 3
        ]
    )
    torch.testing.assert_close(rewards, expected)
    # kl per sequence: -3.5, -0.3, 0, -4.0 -> mean -1.95; mean score (2 - 1 + 5 + 0.5) / 4
    torch.testing.assert_close(stats["kl"], torch.tensor(-1.95, dtype=F64))
    torch.testing.assert_close(stats["score"], torch.tensor(1.625))
    assert stats["score_clip_frac"].item() == 0.0
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())
    # A NaN log-prob at padding must not leak through k3's exp either.
    rewards_k3, _ = kl_shaped_rewards(scores, logp, torch.zeros_like(logp), mask, 0.1, "k3")
    assert torch.isfinite(rewards_k3).all() and (rewards_k3[mask == 0] == 0).all()


def test_kl_shaped_rewards_clips_scores():
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    zeros = torch.zeros(3, 3, dtype=F64)
    scores = t([5.0, -0.5, -3.0])
    rewards, stats = kl_shaped_rewards(scores, zeros, zeros, mask, 0.1, reward_clip=1.0)
    torch.testing.assert_close(rewards, t([[0, 1.0, 0], [-0.5, 0, 0], [0, 0, -1.0]]))
    torch.testing.assert_close(stats["score_clip_frac"], torch.tensor(2 / 3))
    torch.testing.assert_close(stats["score"], torch.tensor(0.5))  # the raw mean
    with pytest.raises(ValueError, match="reward_clip"):
        kl_shaped_rewards(scores, zeros, zeros, mask, 0.1, reward_clip=0.0)


def test_missing_eos_penalty_after_the_clip():
    """Rows 0 and 2 reached the limit (3) without an end id (2); row 1 ended at it there, row 3
    ended short of it. The penalty (0.5) lands after the clip (1.0): row 0's 5.0 -> 1.0 - 0.5."""
    ids = torch.tensor([[7, 8, 9], [7, 8, 2], [4, 4, 4], [5, 0, 0]])
    mask = t([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 0]])
    truncated = truncated_rows(ids, mask, end_ids=(2, 3), max_new_tokens=3)
    assert truncated.tolist() == [True, False, True, False]
    # a row that ended before the limit without an end id (the length oracle's targets) is not
    assert truncated_rows(ids, mask, end_ids=(2,), max_new_tokens=4).tolist() == [False] * 4
    zeros = torch.zeros(4, 3, dtype=F64)
    rewards, stats = kl_shaped_rewards(t([5.0, 0.2, -0.4, 0.3]), zeros, zeros, mask, 0.1,
                                       reward_clip=1.0, penalty=truncated.double() * 0.5)
    torch.testing.assert_close(rewards[:, -1], t([0.5, 0.2, -0.9, 0.0]))
    torch.testing.assert_close(rewards[3, 0], torch.tensor(0.3, dtype=F64))
    torch.testing.assert_close(stats["score_clip_frac"], torch.tensor(0.25))  # the clip's alone


def test_overlong_penalty_hand_values():
    """Limit 10, buffer 4: nothing up to 6 tokens, then factor x (L - 6) / 4, factor at 10.
    With factor 2: 5 -> 0, 6 -> 0, 7 -> 0.5, 9 -> 1.5, 10 -> 2."""
    lengths = torch.tensor([5, 6, 7, 9, 10])
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, factor=2.0),
                               t([0.0, 0.0, 0.5, 1.5, 2.0]))
    # the whole response as buffer: linear from the first token, 1 at the limit
    torch.testing.assert_close(overlong_penalty(torch.tensor([0, 5, 10]), 10, 10), t([0.0, 0.5, 1.0]))
    assert overlong_penalty(lengths, 10, 4, factor=0.0).abs().sum() == 0
    # it joins the score after the clip, as missing_eos_penalty does: 5.0 -> 1.0 - 0.5
    mask = t([[1, 1, 1, 1, 1, 1, 1, 0, 0, 0]])
    zeros = torch.zeros(1, 10, dtype=F64)
    rewards, _ = kl_shaped_rewards(t([5.0]), zeros, zeros, mask, 0.1, reward_clip=1.0,
                                   penalty=overlong_penalty(mask.sum(-1), 10, 4, factor=2.0))
    torch.testing.assert_close(rewards[0, 6], torch.tensor(0.5, dtype=F64))
    for bad, match in (({"buffer_len": 0}, "buffer_len"), ({"buffer_len": 11}, "buffer_len"),
                       ({"buffer_len": 4, "factor": -1.0}, "factor")):
        with pytest.raises(ValueError, match=match):
            overlong_penalty(lengths, 10, **bad)


# ---- GAE ------------------------------------------------------------------------------


def test_gae_hand_values():
    # gamma = 0.9, lam = 0.8, so gamma * lam = 0.72.
    # Row 0 (3 valid tokens), r = [1, 0, 2], V = [0.5, 1.0, 1.5], V after the end = 0:
    #   t=2: delta = 2 + 0.9*0   - 1.5 = 0.5;   A2 = 0.5
    #   t=1: delta = 0 + 0.9*1.5 - 1.0 = 0.35;  A1 = 0.35 + 0.72*0.5  = 0.71
    #   t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4;   A0 = 1.4  + 0.72*0.71 = 1.9112
    #   returns = A + V = [2.4112, 1.71, 2.0]
    # Row 1 (2 valid tokens), padding holds garbage that must be ignored:
    #   t=1: delta = 0 + 0 - 1.0 = -1.0;        A1 = -1.0
    #   t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4;   A0 = 1.4 + 0.72*(-1.0) = 0.68
    #   returns = [1.18, 0.0]
    rewards = t([[1.0, 0.0, 2.0], [1.0, 0.0, 100.0]])
    values = t([[0.5, 1.0, 1.5], [0.5, 1.0, -50.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, t([[1.9112, 0.71, 0.5], [0.68, -1.0, 0.0]]))
    torch.testing.assert_close(ret, t([[2.4112, 1.71, 2.0], [1.18, 0.0, 0.0]]))


def gae_loop_reference(rewards, values, mask, gamma, lam):
    """Plain Python: run textbook GAE over each row's valid tokens only."""
    r, v, m = rewards.tolist(), values.tolist(), mask.tolist()
    adv = [[0.0] * len(r[0]) for _ in r]
    ret = [[0.0] * len(r[0]) for _ in r]
    for b in range(len(r)):
        next_value, next_adv = 0.0, 0.0
        for i in reversed([i for i in range(len(r[b])) if m[b][i] > 0]):
            delta = r[b][i] + gamma * next_value - v[b][i]
            next_adv = delta + gamma * lam * next_adv
            next_value = v[b][i]
            adv[b][i], ret[b][i] = next_adv, next_adv + v[b][i]
    return t(adv), t(ret)


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_loop_reference(seed, holes):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(7, 13, generator=gen, dtype=F64)
    values = torch.randn(7, 13, generator=gen, dtype=F64)
    mask = random_mask(gen, 7, 13, holes)
    gamma, lam = [(1.0, 0.95), (0.99, 0.9), (0.9, 0.8)][seed]
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_loop_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, ref_ret, atol=1e-6, rtol=0)


@pytest.mark.parametrize("holes", [False, True])
def test_gae_masked_positions_do_not_leak(holes):
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(6, 9, generator=gen, dtype=F64)
    values = torch.randn(6, 9, generator=gen, dtype=F64)
    mask = random_mask(gen, 6, 9, holes)
    adv, ret = gae_advantages(rewards, values, mask, 0.99, 0.95)
    pad = mask == 0
    for junk in (1e6, float("nan"), float("inf")):
        adv2, ret2 = gae_advantages(
            rewards.masked_fill(pad, junk), values.masked_fill(pad, -junk), mask, 0.99, 0.95
        )
        assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert (adv[pad] == 0).all() and (ret[pad] == 0).all()


# ---- masked statistics ----------------------------------------------------------------


def test_masked_mean_and_var():
    x = t([[1.0, 2.0, 3.0, 99.0], [4.0, float("nan"), 0.0, 0.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    torch.testing.assert_close(masked_mean(x, mask), torch.tensor(2.5, dtype=F64))
    torch.testing.assert_close(masked_mean(x, mask, dim=1), t([2.0, 4.0]))
    torch.testing.assert_close(masked_mean(x, torch.zeros_like(mask)), torch.tensor(0.0, dtype=F64))
    valid = t([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(masked_var(x, mask), valid.var(unbiased=True))
    torch.testing.assert_close(masked_var(x, mask, unbiased=False), valid.var(unbiased=False))


def test_masked_whiten_normalises_valid_entries_only():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 8, generator=gen, dtype=F64) * 3 + 2
    mask = random_mask(gen, 5, 8)
    white = masked_whiten(x, mask)
    assert abs(masked_mean(white, mask).item()) < 1e-6
    assert abs(masked_var(white, mask).item() - 1.0) < 1e-6
    assert (white[mask == 0] == 0).all()
    assert torch.equal(white, masked_whiten(x.masked_fill(mask == 0, 1e9), mask))
    # shift_mean=False rescales but keeps the original mean.
    kept = masked_whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(masked_mean(kept, mask), masked_mean(x, mask))
    # Global statistics passed in: whitening shards with them equals whitening the whole.
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    shards = [masked_whiten(x[s], mask[s], mean=mean, var=var) for s in (slice(0, 2), slice(2, 5))]
    torch.testing.assert_close(torch.cat(shards), white)


# ---- losses: hand values --------------------------------------------------------------


@pytest.mark.parametrize(
    "ratio, advantage, loss, grad, clipped",
    [
        # ratio 1.5 > 1.2, A = +1: max(-1.5, -1.2) = -1.2, the constant clipped term: no grad.
        (1.5, 1.0, -1.2, 0.0, 1.0),
        # ratio 1.5, A = -1: max(1.5, 1.2) = 1.5, unclipped; d/dlogp (-A * ratio) = 1.5.
        (1.5, -1.0, 1.5, 1.5, 0.0),
        # ratio 0.5 < 0.8, A = +1: max(-0.5, -0.8) = -0.5, unclipped; grad -A * ratio = -0.5.
        (0.5, 1.0, -0.5, -0.5, 0.0),
    ],
)
def test_clipped_policy_loss_one_token(ratio, advantage, loss, grad, clipped):
    logp = t([[math.log(ratio)]]).requires_grad_()
    out, stats = clipped_policy_loss(logp, t([[0.0]]), t([[advantage]]), t([[1.0]]), 0.2, 1.0)
    out.backward()
    torch.testing.assert_close(out, torch.tensor(loss, dtype=F64))
    torch.testing.assert_close(logp.grad, t([[grad]]))
    assert stats["clip_frac"].item() == clipped
    # approx_kl = k3 of KL(old || new) = (ratio - 1) - log(ratio)
    approx_kl = torch.tensor(ratio - 1 - math.log(ratio), dtype=F64)
    torch.testing.assert_close(stats["approx_kl"], approx_kl)
    torch.testing.assert_close(stats["ratio_max"], torch.tensor(ratio, dtype=F64))
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


@pytest.mark.parametrize(
    "ratio, advantage, high, dual, loss, grad, capped",
    [
        # clip-higher: ratio 1.5, A = +1, upper bound 1.3: max(-1.5, -1.3) = -1.3, no grad.
        (1.5, 1.0, 0.3, None, -1.3, 0.0, None),
        # the lower bound stays 1 - clip_eps: ratio 0.7, A = -1: max(0.7, 0.8) = 0.8, no grad.
        (0.7, -1.0, 0.3, None, 0.8, 0.0, None),
        # under the raised bound: ratio 1.25, A = +1: max(-1.25, -1.25), the unclipped grad.
        (1.25, 1.0, 0.3, None, -1.25, -1.25, None),
        # dual clip c = 3: ratio 5, A = -1: min(max(5, 1.2), 3) = 3, capped, no grad.
        (5.0, -1.0, None, 3.0, 3.0, 0.0, 1.0),
        # ratio 2, A = -2: max(4, 2.4) = 4 < 3 * 2 = 6: not capped, grad -A * ratio = 4.
        (2.0, -2.0, None, 3.0, 4.0, 4.0, 0.0),
        # a positive advantage is never capped: ratio 5, A = +1: max(-5, -1.2) = -1.2.
        (5.0, 1.0, None, 3.0, -1.2, 0.0, 0.0),
    ],
)
def test_clip_higher_and_dual_clip_one_token(ratio, advantage, high, dual, loss, grad, capped):
    logp = t([[math.log(ratio)]]).requires_grad_()
    out, stats = clipped_policy_loss(logp, t([[0.0]]), t([[advantage]]), t([[1.0]]), 0.2, 1.0,
                                     clip_eps_high=high, dual_clip=dual)
    out.backward()
    torch.testing.assert_close(out, torch.tensor(loss, dtype=F64))
    torch.testing.assert_close(logp.grad, t([[grad]]))
    assert ("dual_clip_frac" in stats) == (dual is not None)
    if dual is not None:
        assert stats["dual_clip_frac"].item() == capped


@pytest.mark.parametrize("estimator, value, grad", [
    # log pi = log 0.5, log ref = log 0.25: log_ratio = log 2
    ("mse", 0.5 * math.log(2) ** 2, math.log(2)),       # d/dlogp 0.5 u^2 = u
    ("k3", 0.5 + math.log(2) - 1, 0.5),                 # d/dlogp (e^-u + u - 1) = 1 - e^-u
    ("k1", math.log(2), 1.0),
])
def test_kl_loss_hand_values(estimator, value, grad):
    """coef 0.1 over a normalizer of 2: the second token is padding and adds nothing; the
    reference's log-probs get no gradient."""
    logp = t([[math.log(0.5), 3.0]]).requires_grad_()
    ref = t([[math.log(0.25), -3.0]]).requires_grad_()
    loss, stats = kl_loss(logp, ref, t([[1.0, 0.0]]), 0.1, 2.0, estimator)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(0.1 * value / 2, dtype=F64))
    torch.testing.assert_close(logp.grad, t([[0.1 * grad / 2, 0.0]]))
    assert ref.grad is None or not ref.grad.any()
    torch.testing.assert_close(stats["kl_loss"], torch.tensor(value, dtype=F64))


def test_sequence_level_ratio_by_hand():
    """GSPO's ratio (ratio_level="sequence"), clip 0.2, one mini-batch of 2 responses, token
    mean over their 3 valid tokens.
    Row 0: 2 tokens, log-ratios 0.05 and -0.05 -> mean 0, ratio 1 on both, A = +1: unclipped,
      loss_t = -1 each; d(-A exp(mean))/d logp_t = -1 x 1/2 per token, in each of 2 token
      losses: -1/2 x 2 / 3 (the token mean's 1/3) = -1/3 for each token.
    Row 1: 1 token (+ padding holding a huge log-prob that must not count), log-ratio 0.3 ->
      ratio e^0.3 = 1.3499 > 1.2, A = +1: clipped, loss -1.2, no gradient.
    Loss = (-1 - 1 - 1.2) / 3; clip_frac = 1/3."""
    logp = t([[0.05, -0.05], [0.3, 50.0]]).requires_grad_()
    old = torch.zeros(2, 2, dtype=F64)
    adv = t([[1.0, 1.0], [1.0, 7.0]])
    mask = t([[1, 1], [1, 0]])
    out, stats = clipped_policy_loss(logp, old, adv, mask, 0.2, 3.0, ratio_level="sequence")
    out.backward()
    torch.testing.assert_close(out, torch.tensor(-3.2 / 3, dtype=F64))
    torch.testing.assert_close(logp.grad, t([[-1 / 3, -1 / 3], [0.0, 0.0]]))
    torch.testing.assert_close(stats["clip_frac"], torch.tensor(1 / 3, dtype=F64))
    torch.testing.assert_close(stats["ratio_max"], torch.tensor(math.exp(0.3), dtype=F64))
    # per token the ratios are e^0.05 and e^-0.05 on row 0: another loss
    token, _ = clipped_policy_loss(logp.detach().requires_grad_(), old, adv, mask, 0.2, 3.0)
    assert token.item() != pytest.approx(out.item())
    # one-token responses: the two levels are the same loss
    one = t([[0.1], [-0.4]])
    a, _ = clipped_policy_loss(one, old[:, :1], t([[1.0], [-1.0]]), t([[1.0], [1.0]]), 0.2, 2.0)
    b, _ = clipped_policy_loss(one, old[:, :1], t([[1.0], [-1.0]]), t([[1.0], [1.0]]), 0.2, 2.0,
                               ratio_level="sequence")
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="ratio_level"):
        clipped_policy_loss(one, old[:, :1], one, t([[1.0], [1.0]]), 0.2, 2.0, ratio_level="seq")


def test_dual_clip_needs_a_bound_above_one_and_ignores_padding():
    logp, old, adv = t([[math.log(5.0), 9.0]]), t([[0.0, 0.0]]), t([[-1.0, -1.0]])
    loss, stats = clipped_policy_loss(logp, old, adv, t([[1.0, 0.0]]), 0.2, 1.0, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor(3.0, dtype=F64))  # the padded token adds 0
    assert stats["dual_clip_frac"].item() == 1.0
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        clipped_policy_loss(logp, old, adv, t([[1.0, 1.0]]), 0.2, 1.0, dual_clip=1.0)


def test_policy_loss_entropy_bonus_and_normalizer():
    logp, old = t([[math.log(1.5), 0.0]]), t([[0.0, 0.0]])
    adv, mask, entropy = t([[-1.0, 2.0]]), t([[1.0, 1.0]]), t([[0.7, 0.3]])
    # Token losses: 1.5 and -2.0 * 1.0; sum -0.5 over normalizer 4 -> -0.125.
    # Entropy bonus: -0.1 * (0.7 + 0.3) / 4 = -0.025.
    loss, stats = clipped_policy_loss(logp, old, adv, mask, 0.2, 4.0, entropy, entropy_coef=0.1)
    torch.testing.assert_close(loss, torch.tensor(-0.15, dtype=F64))
    torch.testing.assert_close(stats["entropy"], torch.tensor(0.5, dtype=F64))
    torch.testing.assert_close(stats["ratio_mean"], torch.tensor(1.25, dtype=F64))
    bonus, bonus_stats = entropy_bonus_loss(entropy, mask, 0.1, 4.0)
    torch.testing.assert_close(bonus, torch.tensor(-0.025, dtype=F64))
    torch.testing.assert_close(bonus_stats["entropy"], stats["entropy"])
    with pytest.raises(ValueError, match="entropy"):
        clipped_policy_loss(logp, old, adv, mask, 0.2, 4.0, entropy_coef=0.1)


# ---- truncated importance sampling (deferred tokens sampled by an older policy) ---------


def test_truncated_is_weights_hand_values():
    # pi_old / mu per token: 0.3 / 0.6 = 0.5; 0.9 / 0.3 = 3 -> clipped to 2; equal -> 1;
    # mu = e^-1000 would overflow exp(): the clip in log space gives 2; padding -> 0.
    old = t([[math.log(0.3), math.log(0.9), math.log(0.2), 0.0, 5.0]])
    mu = t([[math.log(0.6), math.log(0.3), math.log(0.2), -1000.0, 0.0]])
    mask = t([[1.0, 1.0, 1.0, 1.0, 0.0]])
    w = truncated_is_weights(old, mu, mask, clip=2.0)
    torch.testing.assert_close(w, t([[0.5, 2.0, 1.0, 2.0, 0.0]]))
    assert not w.requires_grad and torch.isfinite(w).all()
    with pytest.raises(ValueError, match="clip must be >= 1"):
        truncated_is_weights(old, mu, mask, clip=0.5)


def test_policy_loss_importance_weight_scales_loss_and_gradient():
    # ratio 0.5, A = +1, unclipped: loss -0.5, grad -0.5 (above); weight 0.5 halves both,
    # and the weight itself gets no gradient.
    logp = t([[math.log(0.5)]]).requires_grad_()
    w = t([[0.5]]).requires_grad_()
    out, _ = clipped_policy_loss(logp, t([[0.0]]), t([[1.0]]), t([[1.0]]), 0.2, 1.0, is_weights=w)
    out.backward()
    torch.testing.assert_close(out, torch.tensor(-0.25, dtype=F64))
    torch.testing.assert_close(logp.grad, t([[-0.25]]))
    assert w.grad is None
    # weights of 1 give exactly the unweighted loss
    logp2 = t([[math.log(0.5), 0.1]])
    args = (logp2, t([[0.0, 0.0]]), t([[1.0, -2.0]]), t([[1.0, 1.0]]), 0.2, 2.0)
    plain, _ = clipped_policy_loss(*args)
    ones, _ = clipped_policy_loss(*args, is_weights=t([[1.0, 1.0]]))
    assert plain.item() == ones.item()


@pytest.mark.parametrize(
    "value, ret, loss, grad, clipped",
    [
        # old = 1.0, eps = 0.2, so v_clip = clip(v, 0.8, 1.2).
        # v = 1.5, R = 2: 0.5 * max(0.5^2, (1.2 - 2)^2) = 0.5 * 0.64 = 0.32; clipped, no grad.
        (1.5, 2.0, 0.32, 0.0, 1.0),
        # v = 1.5, R = 1: 0.5 * max(0.5^2, 0.2^2) = 0.125; unclipped, grad v - R = 0.5.
        (1.5, 1.0, 0.125, 0.5, 0.0),
        # v = 1.1 inside the range: both terms 0.5 * 0.9^2 = 0.405; grad v - R = -0.9.
        (1.1, 2.0, 0.405, -0.9, 0.0),
    ],
)
def test_clipped_value_loss_one_token(value, ret, loss, grad, clipped):
    v = t([[value]]).requires_grad_()
    out, stats = clipped_value_loss(v, t([[1.0]]), t([[ret]]), t([[1.0]]), 0.2, 1.0)
    out.backward()
    torch.testing.assert_close(out, torch.tensor(loss, dtype=F64))
    torch.testing.assert_close(v.grad, t([[grad]]))
    assert stats["value_clip_frac"].item() == clipped
    unclipped, _ = clipped_value_loss(t([[value]]), t([[1.0]]), t([[ret]]), t([[1.0]]), None, 1.0)
    torch.testing.assert_close(unclipped, torch.tensor(0.5 * (value - ret) ** 2, dtype=F64))


def test_losses_ignore_masked_positions():
    gen = torch.Generator().manual_seed(5)
    shape = (4, 6)
    mask = random_mask(gen, *shape)
    pad = mask == 0
    inputs = [torch.randn(*shape, generator=gen, dtype=F64) for _ in range(3)]

    def run(loss_fn, junk):
        first = inputs[0].masked_fill(pad, junk).requires_grad_()
        rest = [x.masked_fill(pad, -junk) for x in inputs[1:]]
        loss, _ = loss_fn(first, *rest, mask, 0.2, mask.sum())
        loss.backward()
        # Unmasked on purpose: a NaN gradient at padding would reach the model's weights.
        return loss, first.grad

    for loss_fn in (clipped_policy_loss, clipped_value_loss):
        clean_loss, clean_grad = run(loss_fn, 0.0)
        for junk in (1e4, float("nan"), float("inf")):
            loss, grad = run(loss_fn, junk)
            torch.testing.assert_close(loss, clean_loss)
            torch.testing.assert_close(grad, clean_grad)
            assert (grad[pad] == 0).all()


# ---- token-level aggregation: gradient invariance under splitting ----------------------


def test_token_normalizer_and_validation():
    assert token_normalizer(120, 3, 4) == 10.0
    torch.testing.assert_close(token_normalizer(torch.tensor(12.0), 2, 3), torch.tensor(2.0))
    with pytest.raises(ValueError):
        token_normalizer(10, 0, 1)
    with pytest.raises(ValueError):
        aggregate_token_loss(torch.ones(1, 1), torch.ones(1, 1), 0)


def _loss_of(kind, model, batch, rows, normalizer):
    feats, old, target, mask = (x[rows] for x in batch)
    out = model(feats).squeeze(-1)
    if kind == "policy":
        logp = -torch.nn.functional.softplus(out)
        return clipped_policy_loss(logp, old, target, mask, 0.2, normalizer)
    return clipped_value_loss(out, old, target, mask, 0.2, normalizer)


def _grad(kind, model, batch, rows, normalizer):
    model.zero_grad()
    loss, stats = _loss_of(kind, model, batch, rows, normalizer)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), stats


@pytest.mark.parametrize("kind", ["policy", "value"])
def test_token_aggregation_gradient_is_invariant_to_splitting(kind):
    gen = torch.Generator().manual_seed(6)
    torch.manual_seed(6)
    B, T, D = 8, 6, 5
    model = torch.nn.Linear(D, 1, dtype=F64)
    feats = torch.randn(B, T, D, generator=gen, dtype=F64)
    with torch.no_grad():  # old = current output + noise, so some tokens clip and some not
        out = model(feats).squeeze(-1)
        start = -torch.nn.functional.softplus(out) if kind == "policy" else out
    old = start + 0.3 * torch.randn(B, T, generator=gen, dtype=F64)
    target = torch.randn(B, T, generator=gen, dtype=F64)  # advantages or returns
    mask = random_mask(gen, B, T)
    batch = (feats, old, target, mask)
    global_tokens = mask.sum()

    full, stats = _grad(kind, model, batch, slice(0, B), global_tokens)
    clip_frac = stats["clip_frac" if kind == "policy" else "value_clip_frac"].item()
    assert 0.0 < clip_frac < 1.0, "both the clipped and unclipped branches must be exercised"

    # Plain accumulation: micro-batches of 1, 3, 4 rows, gradients summed.
    summed = sum(_grad(kind, model, batch, s, global_tokens)[0]
                 for s in (slice(0, 1), slice(1, 4), slice(4, 8)))
    torch.testing.assert_close(summed, full, atol=1e-10, rtol=0)

    # DeepSpeed-style: 2 ranks x 2 accumulation steps of uneven token counts; the engine
    # divides each loss by grad_accum and averages the ranks' gradients.
    grad_accum, world_size = 2, 2
    normalizer = token_normalizer(global_tokens, grad_accum, world_size)
    ranks = [(slice(0, 1), slice(1, 4)), (slice(4, 6), slice(6, 8))]
    per_rank = [sum(_grad(kind, model, batch, s, normalizer)[0] for s in micro) / grad_accum
                for micro in ranks]
    torch.testing.assert_close(sum(per_rank) / world_size, full, atol=1e-10, rtol=0)

    # The test has teeth: a per-micro-batch token mean gives a different gradient.
    local = sum(_grad(kind, model, batch, s, mask[s].sum())[0] for micro in ranks for s in micro)
    assert (local / (grad_accum * world_size) - full).abs().max() > 1e-4


# ---- sequence-level aggregation (ppo.loss_agg_mode) -------------------------------------


def test_loss_aggregation_modes_by_hand():
    """Two responses of 1 and 3 tokens with token losses [6] and [1, 2, 3]:
    token_mean (6 + 1 + 2 + 3) / 4 = 3; seq_mean_token_mean (6/1 + 6/3) / 2 = 4 (GRPO: the
    short response's token weighs 3x the long one's); seq_mean_token_sum_norm with a limit of
    4 tokens (6/4 + 6/4) / 2 = 1.5 (Dr. GRPO: every token weighs 1 / (N * 4))."""
    loss = t([[6.0, 9.0, 9.0], [1.0, 2.0, 3.0]])  # 9: padding, must not count
    mask = t([[1, 0, 0], [1, 1, 1]])
    expected = {"token_mean": 3.0, "seq_mean_token_mean": 4.0, "seq_mean_token_sum_norm": 1.5}
    assert set(expected) == set(LOSS_AGG_MODES)
    for mode, value in expected.items():
        norm = loss_normalizer(mask, mode, mask.sum(), 2.0, 1, 1, max_len=4)
        assert aggregate_token_loss(loss, mask, norm).item() == pytest.approx(value), mode
    torch.testing.assert_close(loss_normalizer(mask, "seq_mean_token_mean", 4.0, 2.0, 1, 1),
                               t([[2.0], [6.0]]))  # |o_i| * N
    # k = grad_accum * world_size contributions: each normalizer divided by k
    assert loss_normalizer(mask, "seq_mean_token_sum_norm", 4.0, 8.0, 2, 2, max_len=4) == 8.0
    assert loss_normalizer(mask, "token_mean", 12.0, 8.0, 2, 3) == 2.0
    with pytest.raises(ValueError, match="needs max_len >= 1"):
        loss_normalizer(mask, "seq_mean_token_sum_norm", 4.0, 2.0, 1, 1)
    with pytest.raises(ValueError, match="unknown loss aggregation 'seq_mean'; one of token_mean"):
        loss_normalizer(mask, "seq_mean", 4.0, 2.0, 1, 1)


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_sequence_aggregation_gradient_is_invariant_to_splitting(mode):
    """As the token mean: micro-batches on 2 ranks x 2 accumulation steps give the gradient of
    the whole mini-batch; and the whole mini-batch's loss is the mode's formula written as a
    loop over sequences."""
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    B, T, D, max_len = 8, 6, 5, 6
    model = torch.nn.Linear(D, 1, dtype=F64)
    feats = torch.randn(B, T, D, generator=gen, dtype=F64)
    with torch.no_grad():
        old = -torch.nn.functional.softplus(model(feats).squeeze(-1))
    old = old + 0.3 * torch.randn(B, T, generator=gen, dtype=F64)
    adv = torch.randn(B, T, generator=gen, dtype=F64)
    mask = random_mask(gen, B, T)
    batch = (feats, old, adv, mask)

    def norm(rows, k=1):
        return loss_normalizer(mask[rows], mode, mask.sum(), float(B), k, 1, max_len=max_len)

    full_loss, stats = _loss_of("policy", model, batch, slice(0, B), norm(slice(0, B)))
    assert 0.0 < stats["clip_frac"].item() < 1.0
    # the loop reference: per sequence its clipped surrogate summed over its tokens
    with torch.no_grad():
        logp = -torch.nn.functional.softplus(model(feats).squeeze(-1))
        ratio = torch.exp(logp - old)
        per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        reference = 0.0
        for i in range(B):
            n = int(mask[i].sum())
            total = sum(float(per_token[i, j]) for j in range(T) if mask[i, j] > 0)
            # an empty row adds nothing, but counts among the N sequences
            reference += total / (max(n, 1) if mode == "seq_mean_token_mean" else max_len) / B
    assert full_loss.item() == pytest.approx(reference, abs=1e-12)

    full, _ = _grad("policy", model, batch, slice(0, B), norm(slice(0, B)))
    grad_accum, world_size = 2, 2
    ranks = [(slice(0, 1), slice(1, 4)), (slice(4, 6), slice(6, 8))]
    per_rank = [sum(_grad("policy", model, batch, s, norm(s, grad_accum * world_size))[0]
                    for s in micro) / grad_accum for micro in ranks]
    torch.testing.assert_close(sum(per_rank) / world_size, full, atol=1e-10, rtol=0)
    # and it is not the token mean's gradient
    token, _ = _grad("policy", model, batch, slice(0, B), mask.sum())
    assert (token - full).abs().max() > 1e-4


# ---- import hygiene -------------------------------------------------------------------


def test_import_algo_pulls_no_heavy_frameworks():
    code = (
        "import sys, oppo_ds.algo; "
        "heavy = sorted({m.split('.')[0] for m in sys.modules} "
        "& {'deepspeed', 'megatron', 'transformers'}); "
        "assert not heavy, heavy"
    )
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("block", [1, 7, 10 ** 9])
def test_policy_token_logprobs_in_blocks_of_rows_equal_the_whole_call(block):
    """Taken a block of rows at a time (``block`` logits' elements, at least one row), with
    or without a ``select`` that gathers each block: the same figures as
    ``logprobs_from_logits(policy_logits(...))`` at once, to the bit; no rows, no output."""
    from oppo_ds.algo import logprobs_from_logits, policy_logits, policy_token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4, 11, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 11, (5, 4), generator=g)
    want = logprobs_from_logits(policy_logits(logits, 0.7), labels)
    got = policy_token_logprobs(logits, labels, 0.7, block_elements=block)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    at = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 0], [2, 2]])
    rows = torch.arange(5)[:, None]
    picked = policy_token_logprobs(logits, labels[:, :2], 0.7, block_elements=block,
                                   select=lambda part: logits[rows[part], at[part]])
    assert torch.equal(picked, logprobs_from_logits(policy_logits(logits[rows, at], 0.7),
                                                    labels[:, :2]))
    empty = policy_token_logprobs(logits[:0], labels[:0], 1.0, block_elements=block)
    assert empty.shape == (0, 4)
