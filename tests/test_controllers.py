"""Tier 0: the chunk-size controller on synthetic costs, derived by hand."""
import math

import pytest

from oppo_ds.rollout.controllers import ChunkSizeController, fit_prefill_cost, model_chunk_size


def test_fit_recovers_per_call_and_per_token_cost():
    # a = 2 ms per call, b = 0.1 ms per token; two steps at different chunk sizes
    a, b = 2e-3, 1e-4
    obs = [(calls, tokens, a * calls + b * tokens) for calls, tokens in [(40, 300), (5, 310), (12, 290)]]
    fa, fb = fit_prefill_cost(obs)
    assert fa == pytest.approx(a, rel=1e-9) and fb == pytest.approx(b, rel=1e-9)


def test_fit_needs_two_different_chunk_sizes():
    # calls proportional to tokens: per-call and per-token cost cannot be told apart
    with pytest.raises(ValueError, match="two different chunk sizes"):
        fit_prefill_cost([(10, 100, 1.0), (20, 200, 2.0)])


def test_model_chunk_size_is_the_square_root_rule():
    # sqrt(L a / b) = sqrt(64 * 2e-3 / 1e-4) = sqrt(1280) = 35.8 -> nearest in log scale: 32
    assert model_chunk_size(2e-3, 1e-4, 64, (4, 8, 16, 32, 64)) == 32
    # sqrt(16 * 1e-3 / 1e-3) = 4
    assert model_chunk_size(1e-3, 1e-3, 16, (4, 8, 16, 32, 64)) == 4
    # without overlap nothing is hidden: the fewest hand-overs (largest chunk) win
    assert model_chunk_size(2e-3, 1e-4, 64, (4, 8, 16, 32, 64), overlapped=False) == 64
    assert model_chunk_size(2e-3, 0.0, 64, (4, 16)) == 16


def _cost(chunk, a=2e-3, b=1e-4, tokens=300, length=64):
    calls = math.ceil(length / chunk)
    return calls, tokens, a * calls + b * tokens


def test_calibrates_then_explores_and_keeps_the_fastest():
    ctl = ChunkSizeController(candidates=(4, 8, 16, 32, 64), explore_every=4)
    used = []
    per_token = {4: 3.0, 8: 2.0, 16: 1.0, 32: 1.5, 64: 2.5}  # 16 is the fastest in practice
    messages = []
    for _ in range(12):
        c = ctl.next_chunk_size()
        used.append(c)
        msg = ctl.observe(c, per_token[c], *_cost(c), response_len=64)
        if msg:
            messages.append(msg)
    # calibration at both ends, then the model's choice (32), then at step 4 an exploration
    # round over all five candidates, after which the measured fastest (16) is kept
    assert used[:2] == [4, 64]
    assert used[2:4] == [32, 32]
    assert used[4:9] == [4, 8, 16, 32, 64]
    assert used[9:] == [16, 16, 16]
    assert any("cost model" in m for m in messages)
    assert any("exploring" in m for m in messages)
    assert any(m.startswith("chunk_size=16 after exploring") for m in messages)


def test_state_dict_round_trip_mid_exploration():
    per_token = {4: 3.0, 8: 2.0, 16: 1.0, 32: 1.5, 64: 2.5}

    def drive(ctl, n):
        out = []
        for _ in range(n):
            c = ctl.next_chunk_size()
            out.append(c)
            ctl.observe(c, per_token[c], *_cost(c), response_len=64)
        return out

    full = ChunkSizeController(explore_every=4)
    expected = drive(full, 14)
    first = ChunkSizeController(explore_every=4)
    head = drive(first, 6)  # stops inside the exploration round
    resumed = ChunkSizeController(explore_every=4)
    resumed.load_state_dict(first.state_dict())
    assert head + drive(resumed, 8) == expected


def test_bad_candidates_are_rejected():
    with pytest.raises(ValueError, match="candidates"):
        ChunkSizeController(candidates=(0, 8))


# ---- Delta (overcommitment degree) from the reward trend --------------------------------


def test_slope_hand_values():
    from oppo_ds.rollout.controllers import slope

    assert slope([1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert slope([3.0, 1.0]) == pytest.approx(-2.0)
    assert slope([5.0, 5.0, 5.0, 5.0]) == pytest.approx(0.0)
    # y = 0, 1, 0, 1: slope = sum((x - 1.5)(y - 0.5)) / sum((x - 1.5)^2) = 1 / 5
    assert slope([0.0, 1.0, 0.0, 1.0]) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="at least 2"):
        slope([1.0])


def test_delta_grows_while_reward_rises_and_shrinks_to_min_otherwise():
    from oppo_ds.rollout.controllers import DeltaController

    ctl = DeltaController(delta_min=1, delta_max=4, window=3)
    assert ctl.delta == 4  # starts at the top
    decisions = []
    # falling window: 4 -> 3; flat: 3 -> 2; rising: 2 -> 3; falling twice: -> 2 -> 1; again stays 1
    for window in ([3.0, 2.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.5, 1.0], [1, 0, 0], [2, 1, 0], [5, 4, 3]):
        for r in window[:-1]:
            assert ctl.observe(r) is None  # decisions only when a window closes
        decisions.append(ctl.observe(window[-1]))
        assert decisions[-1] is not None and f"delta={ctl.delta}" in decisions[-1]
    assert [int(d.split()[0].split("=")[1]) for d in decisions] == [3, 2, 3, 2, 1, 1]
    assert "rising" in decisions[2] and "falling" in decisions[0]
    # rising forever is capped at delta_max
    for _ in range(5):
        for r in (0.0, 1.0, 2.0):
            ctl.observe(r)
    assert ctl.delta == 4


def test_delta_state_dict_round_trip_mid_window():
    from oppo_ds.rollout.controllers import DeltaController

    a = DeltaController(delta_min=0, delta_max=3, window=4)
    for r in (1.0, 0.5):
        a.observe(r)
    b = DeltaController(delta_min=0, delta_max=3, window=4)
    b.load_state_dict(a.state_dict())
    for r in (0.2, 0.1):
        assert a.observe(r) == b.observe(r)
    assert a.delta == b.delta == 2
    with pytest.raises(ValueError, match="delta_min <= delta_max"):
        DeltaController(delta_min=3, delta_max=2)
