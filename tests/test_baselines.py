"""Tier 0: the critic-free estimators' group baselines against hand-derived values."""

import math

import pytest
import torch

from oppo_ds.algo import CRITIC_FREE_ESTIMATORS, gae_advantages, group_baseline_scores, kl_shaped_rewards

SCORES = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0, 7.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])


def test_rloo_subtracts_the_mean_of_the_others():
    # group 0: 1 - (2+3)/2, 2 - (1+3)/2, 3 - (1+2)/2; group 1: 4 - (4+7)/2 twice, 7 - (4+4)/2
    got = group_baseline_scores(SCORES, GROUPS, "rloo")
    assert torch.allclose(got, torch.tensor([-1.5, 0.0, 1.5, -1.5, -1.5, 3.0]), atol=1e-6)


def test_reinforce_baseline_subtracts_the_group_mean():
    got = group_baseline_scores(SCORES, GROUPS, "reinforce_baseline")
    assert torch.allclose(got, torch.tensor([-1.0, 0.0, 1.0, -1.0, -1.0, 2.0]), atol=1e-6)


def test_group_norm_divides_by_the_unbiased_group_std():
    # group 0: variance (1 + 0 + 1) / 2 = 1; group 1: (1 + 1 + 4) / 2 = 3
    got = group_baseline_scores(SCORES, GROUPS, "group_norm", eps=0.0)
    r3 = math.sqrt(3.0)
    assert torch.allclose(got, torch.tensor([-1.0, 0.0, 1.0, -1 / r3, -1 / r3, 2 / r3]), atol=1e-6)


def test_group_norm_of_equal_scores_is_zero_not_nan():
    got = group_baseline_scores(torch.tensor([0.5, 0.5, 2.0, 3.0]), torch.tensor([0, 0, 1, 1]),
                                "group_norm")
    assert torch.isfinite(got).all()
    assert got[:2].abs().max() == 0
    assert torch.allclose(got[2:], torch.tensor([-0.5, 0.5]) / (math.sqrt(0.5) + 1e-6), atol=1e-6)


def test_reinforce_keeps_the_scores():
    got = group_baseline_scores(SCORES, GROUPS, "reinforce")
    assert torch.equal(got, SCORES) and got.data_ptr() != SCORES.data_ptr()


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_baseline", "group_norm"])
def test_labels_and_order_do_not_matter(estimator):
    # the same two groups, interleaved and labelled 9 and 5
    perm = torch.tensor([3, 0, 4, 1, 5, 2])
    labels = torch.tensor([9, 5, 9, 5, 9, 5])
    assert torch.equal(GROUPS[perm].eq(1), labels.eq(9))
    got = group_baseline_scores(SCORES[perm], labels, estimator)
    assert torch.allclose(got, group_baseline_scores(SCORES, GROUPS, estimator)[perm], atol=1e-6)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_baseline", "group_norm"])
def test_group_baselines_sum_to_zero_per_group(estimator):
    scores = torch.randn(12, generator=torch.Generator().manual_seed(0))
    groups = torch.arange(12) // 4
    got = group_baseline_scores(scores, groups, estimator)
    assert torch.allclose(torch.zeros(3), got.view(3, 4).sum(1), atol=1e-5)


def test_rloo_is_the_group_mean_baseline_scaled_by_n_over_n_minus_1():
    scores = torch.randn(15, generator=torch.Generator().manual_seed(1))
    groups = torch.arange(15) // 5
    rloo = group_baseline_scores(scores, groups, "rloo")
    centred = group_baseline_scores(scores, groups, "reinforce_baseline")
    assert torch.allclose(rloo, centred * 5 / 4, atol=1e-5)


def test_rloo_refuses_a_group_of_one():
    with pytest.raises(ValueError, match="at least 2 responses per prompt"):
        group_baseline_scores(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]), "rloo")


def test_unknown_estimator_and_shapes_are_refused():
    with pytest.raises(ValueError, match="unknown estimator 'gae'"):
        group_baseline_scores(SCORES, GROUPS, "gae")
    with pytest.raises(ValueError, match=r"\(B,\)"):
        group_baseline_scores(SCORES, GROUPS[:4], "rloo")
    assert "gae" not in CRITIC_FREE_ESTIMATORS


def test_baseline_comes_after_clipping_and_penalty_and_stats_describe_raw_scores():
    scores = torch.tensor([10.0, 0.0, 1.0, 3.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    zeros = torch.zeros(4, 3)
    penalty = torch.tensor([0.0, 1.0, 0.0, 0.0])
    rewards, stats = kl_shaped_rewards(
        scores, zeros, zeros, mask, kl_coef=0.1, reward_clip=5.0, penalty=penalty,
        baseline=lambda s: group_baseline_scores(s, groups, "reinforce_baseline"))
    # clipped and penalised: [5, -1 | 1, 3]; minus the group means 2 and 2: [3, -3 | -1, 1]
    expected = torch.tensor([[0.0, 3.0, 0.0], [-3.0, 0.0, 0.0], [0.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    assert torch.allclose(rewards, expected)
    assert stats["score"].item() == pytest.approx(3.5)           # the raw scores' mean
    assert stats["score_clip_frac"].item() == pytest.approx(0.25)


def test_critic_free_returns_are_the_reward_to_go():
    # what the trainer does without a critic: GAE with zero values and lambda 1 is the
    # discounted sum of the rewards from each token on
    rewards = torch.tensor([[-0.1, -0.2, 2.0, 0.0], [0.5, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    adv, returns = gae_advantages(rewards, torch.zeros_like(rewards), mask, gamma=0.5, lam=1.0)
    expected = torch.tensor([[-0.1 + 0.5 * (-0.2) + 0.25 * 2.0, -0.2 + 0.5 * 2.0, 2.0, 0.0],
                             [0.5 + 0.5 * (-1.0), -1.0, 0.0, 0.0]])
    assert torch.allclose(adv, expected) and torch.allclose(returns, expected)
