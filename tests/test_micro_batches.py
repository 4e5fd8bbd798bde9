"""Micro-batches sized by tokens (``oppo_ds.micro_batches``, ``ppo.micro_batch_tokens``): the
cost of a forward, padded and packed, and the split of a mini-batch under a budget, worked out
by hand; the whole update's invariance is in test_trainer.py and, over two ZeRO-3 ranks, in
test_distributed.py."""
from __future__ import annotations

import random

import pytest
import torch

from oppo_ds.experience import packed_inputs
from oppo_ds.micro_batches import (MicroBatches, collective_scorers, first_fit_rows, fixed_rows,
                                   forward_tokens, split_by_tokens)


def test_fixed_rows_are_micro_batch_size_rows_in_order():
    """ppo.micro_batch_size's rule (the update's and the scoring's without a token budget):
    rows in order, the last micro-batch holding what is left."""
    assert fixed_rows(5, 2) == [[0, 1], [2, 3], [4]]
    assert fixed_rows(4, 4) == [[0, 1, 2, 3]]
    assert fixed_rows(3, 8) == [[0, 1, 2]]
    assert fixed_rows(0, 3) == []


def test_a_forward_costs_its_rows_times_their_widths():
    # padded: 3 rows x (longest prompt 5 + longest response 7)
    assert forward_tokens([5, 2, 3], [1, 7, 2], packed=False) == 36
    # packed: lengths 6, 9, 5 in rows of 9: [9], [6], [5] (6 + 5 > 9) -> 3 x 9
    assert forward_tokens([5, 2, 3], [1, 7, 2], packed=True) == 27
    # lengths 6, 3, 3 in rows of 6: [6], [3, 3] -> 2 x 6, where padding costs 3 x 6
    assert forward_tokens([2, 2, 2], [4, 1, 1], packed=True) == 12
    assert forward_tokens([2, 2, 2], [4, 1, 1], packed=False) == 18
    assert forward_tokens([], [], packed=False) == 0
    assert first_fit_rows([6, 3, 3, 2], 6) == [[0], [1, 2], [3]]


def test_packed_cost_is_the_rows_packed_inputs_builds():
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 8)
        prompts = [rng.randint(1, 6) for _ in range(n)]
        responses = [rng.randint(1, 9) for _ in range(n)]
        prompt_mask = torch.tensor([[0] * (6 - p) + [1] * p for p in prompts])
        response_mask = torch.tensor([[1] * r + [0] * (9 - r) for r in responses])
        ids = torch.ones(n, 6, dtype=torch.long), torch.ones(n, 9, dtype=torch.long)
        inputs, _ = packed_inputs(ids[0], prompt_mask, ids[1], response_mask)
        assert forward_tokens(prompts, responses, packed=True) == inputs["input_ids"].numel()


def test_the_split_fills_micro_batches_longest_first_within_the_budget():
    prompts, responses = [4, 4, 2, 2], [10, 2, 2, 1]  # lengths 14, 6, 4, 3
    # [0] alone (with row 1: 2 x 14 > 20); [1, 2, 3]: 3 x (4 + 2) = 18
    assert split_by_tokens(prompts, responses, 20, packed=False) == [[0], [1, 2, 3]]
    # three asked for: the costlier one with rows to spare is split, its longer half first
    assert split_by_tokens(prompts, responses, 20, packed=False, count=3) == [[0], [1], [2, 3]]
    assert split_by_tokens(prompts, responses, 20, packed=False, count=4) == [[0], [1], [2], [3]]
    # packed rows hold more within the same budget: lengths 6, 3, 3 pack into 2 rows of 6
    prompts, responses = [2, 2, 2, 2], [4, 1, 1, 1]
    assert split_by_tokens(prompts, responses, 12, packed=False) == [[0, 1], [2, 3]]
    assert split_by_tokens(prompts, responses, 12, packed=True) == [[0, 1, 2], [3]]
    # a row over the budget goes alone; a budget of everything is one micro-batch
    assert split_by_tokens([30, 1], [5, 1], 10, packed=False) == [[0], [1]]
    assert split_by_tokens(prompts, responses, 10 ** 6, packed=False) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("packed", [False, True])
def test_every_row_once_and_every_micro_batch_within_the_budget(packed):
    rng = random.Random(1)
    for _ in range(50):
        n = rng.randint(1, 16)
        prompts = [rng.randint(1, 32) for _ in range(n)]
        responses = [rng.choice([rng.randint(1, 8), rng.randint(1, 64)]) for _ in range(n)]
        budget = rng.randint(96, 400)
        fewest = split_by_tokens(prompts, responses, budget, packed)
        for count in range(len(fewest), n + 1):
            groups = split_by_tokens(prompts, responses, budget, packed, count)
            assert len(groups) == count
            assert sorted(i for g in groups for i in g) == list(range(n))
            for g in groups:
                cost = forward_tokens([prompts[i] for i in g], [responses[i] for i in g], packed)
                assert cost <= budget


@pytest.mark.parametrize("packed", [False, True])
def test_the_running_cost_is_the_forward_of_the_rows_so_far(packed):
    """The split keeps each micro-batch's cost as it fills (its widths, or its packed rows'
    room); the greedy rule it must match, checked from scratch with ``forward_tokens``: rows
    longest first (ties by index), each micro-batch within the budget (or one row alone), and
    the next row would have taken it over. Ptx blocks (extra positions a row) included."""
    rng = random.Random(2)
    for _ in range(300):
        n = rng.randint(1, 40)
        prompts = [rng.randint(1, 24) for _ in range(n)]
        responses = [rng.choice([rng.randint(0, 6), rng.randint(0, 80)]) for _ in range(n)]
        budget, extra = rng.randint(1, 900), rng.choice([0, 0, 7])
        groups = split_by_tokens(prompts, responses, budget, packed, extra_per_row=extra)

        def cost(rows):
            return forward_tokens([prompts[i] for i in rows], [responses[i] for i in rows],
                                  packed) + extra * len(rows)

        order = sorted(range(n), key=lambda i: (-(prompts[i] + responses[i]), i))
        assert [i for g in groups for i in g] == order
        for g, after in zip(groups, groups[1:] + [None]):
            assert len(g) == 1 or cost(g) <= budget
            if after is not None:
                assert cost(g + after[:1]) > budget


def test_the_ranks_agreement_splits_only_where_another_rank_needs_more():
    """``MicroBatches.at_least``, the rule every caller uses to match the rank that needs
    most: a split by tokens is split further to the count, never past one row a call (the
    caller's filler makes the rest) and never below its fewest; fixed rows stay as they are;
    the kept split is not changed by asking."""
    prompts, responses = [4, 4, 2, 2], [10, 2, 2, 1]
    split = MicroBatches.by_tokens(prompts, responses, 20, packed=False)
    assert split.groups == split_by_tokens(prompts, responses, 20, packed=False) == [[0], [1, 2, 3]]
    assert split.at_least(None) == split.at_least(1) == split.at_least(2) == [[0], [1, 2, 3]]
    assert split.at_least(3) == [[0], [1], [2, 3]]  # the costlier one in two
    assert split.at_least(9) == [[0], [1], [2], [3]]  # one a row at most
    assert split.groups == [[0], [1, 2, 3]]
    fixed = MicroBatches.fixed(5, 2)
    assert fixed.groups == fixed.at_least(7) == fixed_rows(5, 2)
    assert MicroBatches.by_tokens([], [], 20, packed=True).at_least(3) == []


def test_the_ranks_agree_on_the_scoring_calls_of_zero3s_partitioned_models_only():
    """The trainer's and the planner's rule: a forward that gathers partitioned weights is a
    collective (ZeRO-3 on more than one rank): the actor's, the critic's, and a reference's
    when it is partitioned; a whole copy's (the reward model) never is."""
    assert collective_scorers(3, 2, partition_reference=False) == ("actor", "critic")
    assert collective_scorers(3, 8, partition_reference=True) == ("actor", "critic", "reference")
    assert collective_scorers(3, 1, partition_reference=True) == ()
    assert collective_scorers(2, 8, partition_reference=False) == ()


def test_impossible_splits_are_refused():
    with pytest.raises(ValueError, match="between the fewest micro-batches .2. and the rows .4."):
        split_by_tokens([4, 4, 2, 2], [10, 2, 2, 1], 20, packed=False, count=5)
    with pytest.raises(ValueError, match="got 1"):
        split_by_tokens([4, 4, 2, 2], [10, 2, 2, 1], 20, packed=False, count=1)
    with pytest.raises(ValueError, match="no rows"):
        split_by_tokens([], [], 20, packed=False)
