"""Tier 0: the chunk-size controller on synthetic costs, derived by hand."""
import math

import pytest

from oppo_ds.rollout.controllers import (ChunkSizeController, Pipeline, fit_prefill_cost,
                                         model_chunk_size, overlapped_cost)


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


def test_overlapped_cost_plays_the_pipeline_through():
    # two rows decoding 4 and 8 tokens (one row per group), 1 ms per decode step, one scorer
    # at 2 ms per call + 0.5 ms per token. Pure decoding ends at 8 ms.
    pipe = Pipeline(decode_s=1e-3, handover_s=0.0, rows=2, lengths=(4.0, 8.0))
    # chunk 8: handed over at 8 ms with 12 tokens: 2 + 6 = 8 ms of scoring, all in the tail
    assert overlapped_cost(8, pipe, 2e-3, 0.5e-3, 1) == pytest.approx(8e-3)
    # chunk 4: chunk 1 (8 tokens) at 4 ms, done at 4 + 6 = 10; chunk 2 (4 tokens) at 8 ms,
    # starts when the scorer is free (10), done at 14: 6 ms after the last token
    assert overlapped_cost(4, pipe, 2e-3, 0.5e-3, 1) == pytest.approx(6e-3)
    # chunk 2: 4 tokens at 2 ms (done 6), 4 at 4 (done 10), 2 at 6 (13), 2 at 8 (16): the
    # per-call cost outruns decoding and the backlog is the tail, 8 ms
    assert overlapped_cost(2, pipe, 2e-3, 0.5e-3, 1) == pytest.approx(8e-3)
    # a 1 ms hand-over per chunk delays each chunk and is paid by the actor: chunk 4 is
    # handed over at 5 ms (done 11) and 10 ms (done 15), against 8 ms of pure decoding
    slow = Pipeline(decode_s=1e-3, handover_s=1e-3, rows=2, lengths=(4.0, 8.0))
    assert overlapped_cost(4, slow, 2e-3, 0.5e-3, 1) == pytest.approx(7e-3)
    # two scorers: each chunk's work doubles (chunk 8: 2 x 8 ms)
    assert overlapped_cost(8, pipe, 2e-3, 0.5e-3, 2) == pytest.approx(16e-3)


def test_model_chunk_size_takes_the_cheapest_and_inline_the_largest():
    pipe = Pipeline(decode_s=1e-3, handover_s=0.0, rows=2, lengths=(4.0, 8.0))
    chosen, costs = model_chunk_size(2e-3, 0.5e-3, pipe, 1, (2, 4, 8))
    assert chosen == 4 and costs[4] == pytest.approx(6e-3)
    # no per-token cost: every size leaves one 2 ms call in the tail; ties go to the larger
    assert model_chunk_size(2e-3, 0.0, pipe, 1, (2, 4, 8))[0] == 8
    # without overlap nothing is hidden: the fewest hand-overs (largest chunk) win
    assert model_chunk_size(2e-3, 0.5e-3, pipe, 1, (2, 4, 8), overlapped=False) == (8, {})
    assert model_chunk_size(2e-3, 0.5e-3, None, 1, (2, 4, 8)) == (8, {})


def test_pipeline_from_a_rollouts_timing():
    from oppo_ds.rollout.streaming import StreamTiming

    # 16 rows that decoded 1..16 tokens in 4 chunks: 32 ms decoding, 3 ms between chunks
    timing = StreamTiming(chunks=4, chunk_decode_s=32e-3, handover_s=3e-3,
                          row_tokens=list(range(16, 0, -1)))
    pipe = Pipeline.from_timing(timing)
    assert pipe.decode_s == pytest.approx(2e-3)  # 32 ms over the longest row's 16 steps
    assert pipe.handover_s == pytest.approx(1e-3)  # 3 gaps between 4 chunks
    assert pipe.rows == 16
    # group i of 8 (2 rows each) at the sorted tokens' index (i + 0.5) * 2; the last: the max
    assert pipe.lengths == (2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0)
    assert Pipeline.from_list(pipe.as_list()) == pipe and len(pipe.as_list()) == Pipeline.SIZE
    assert Pipeline.from_timing(StreamTiming(row_tokens=[0, 0])) is None


def _cost(chunk, a=2e-3, b=1e-4, tokens=300, length=64):
    calls = math.ceil(length / chunk)
    return calls, tokens, a * calls + b * tokens


# the actor's side of the steps below: 16 rows, 1.5 ms per step, 0.2 ms per hand-over
PIPE = Pipeline(decode_s=1.5e-3, handover_s=0.2e-3, rows=16,
                lengths=(4.0, 8.0, 10.0, 14.0, 18.0, 25.0, 40.0, 64.0))


def test_calibrates_then_explores_and_keeps_the_fastest():
    ctl = ChunkSizeController(candidates=(4, 8, 16, 32, 64), explore_every=4)
    used = []
    per_token = {4: 3.0, 8: 1.0, 16: 2.0, 32: 1.5, 64: 2.5}  # 8 is the fastest in practice
    messages = []
    for _ in range(12):
        c = ctl.next_chunk_size()
        used.append(c)
        msg = ctl.observe(c, per_token[c], *_cost(c), scorers=3, pipeline=PIPE)
        if msg:
            messages.append(msg)
    # calibration at both ends, then the model's choice (16: its costs are 4: 116 ms, 8: 74,
    # 16: 62, 32: 74, 64: 116 for three scorers at 2 ms per call + 0.1 ms per token), then at
    # step 4 an exploration round over all five candidates, after which the measured
    # fastest (8) is kept
    assert used[:2] == [4, 64]
    assert used[2:4] == [16, 16]
    assert used[4:9] == [4, 8, 16, 32, 64]
    assert used[9:] == [8, 8, 8]
    assert messages[0].startswith("chunk_size=16 from the cost model")
    assert "16: 62.0" in messages[0]
    assert any("exploring" in m for m in messages)
    assert any(m.startswith("chunk_size=8 after exploring") for m in messages)


def test_without_the_actors_timing_the_model_keeps_the_fewest_hand_overs():
    ctl = ChunkSizeController(candidates=(4, 8, 16, 32, 64), explore_every=0)
    for _ in range(2):
        c = ctl.next_chunk_size()
        msg = ctl.observe(c, 1.0, *_cost(c))
    assert ctl.chunk_size == 64 and "fewest hand-overs" in msg


def test_a_step_that_decoded_nothing_measures_nothing():
    """With overcommitment a step may take a batch the pool already held finished and decode
    nothing (no scorer call): it neither calibrates nor counts as an exploration trial (before,
    the second calibration step's zeros made the cost fit raise and killed the run)."""
    ctl = ChunkSizeController(candidates=(4, 8, 16, 32, 64), explore_every=4)
    assert ctl.observe(4, 1.0, *_cost(4), scorers=3, pipeline=PIPE) is None
    assert ctl.next_chunk_size() == 64
    assert ctl.observe(64, 0.0, 0.0, 0.0, 0.0, scorers=3, pipeline=None) is None
    assert ctl.next_chunk_size() == 64 and ctl.chunk_size is None  # calibrates 64 again
    assert ctl.observe(64, 1.0, *_cost(64), scorers=3, pipeline=PIPE).startswith("chunk_size=16")
    assert ctl.observe(16, 1.0, *_cost(16)).startswith("exploring")  # step 4, the idle one counted
    assert ctl.next_chunk_size() == 4
    assert ctl.observe(4, 0.0, 0.0, 0.0, 0.0) is None
    assert ctl.next_chunk_size() == 4 and ctl.trials == {}  # the trial of 4 is taken again
    ctl.observe(4, 2.0, *_cost(4))
    assert ctl.trials == {4: 2.0} and ctl.next_chunk_size() == 8


def test_calibration_that_cannot_tell_the_costs_apart_keeps_the_fewest_hand_overs():
    """Every response fit in one chunk at both calibration sizes (max_new_tokens <= 4), so
    both steps made one call per row: the fit has nothing to separate; the largest candidate
    is kept, with the reason, instead of an error."""
    ctl = ChunkSizeController(candidates=(4, 8, 16, 32, 64), explore_every=0)
    ctl.observe(4, 1.0, 48.0, 144.0, 0.05, scorers=3, pipeline=PIPE)
    msg = ctl.observe(64, 1.0, 48.0, 144.0, 0.05, scorers=3, pipeline=PIPE)
    assert ctl.chunk_size == 64
    assert msg == ("chunk_size=64: the calibration steps with chunk sizes 4 and 64 made the same "
                   "number of scorer calls per token, so the size changes nothing (the fewest "
                   "hand-overs)")


def test_a_calibration_saved_without_the_actors_timing_still_decides():
    # a checkpoint taken mid-calibration by a version that kept (calls, tokens, busy) only
    old = {"candidates": [4, 8, 16, 32, 64], "explore_every": 0, "chunk_size": None, "step": 1,
           "calibration": [list(_cost(4))], "exploring": [], "trials": {}}
    ctl = ChunkSizeController()
    ctl.load_state_dict(old)
    assert ctl.next_chunk_size() == 64
    msg = ctl.observe(64, 1.0, *_cost(64), scorers=3, pipeline=PIPE)
    assert ctl.chunk_size == 64 and "fewest hand-overs" in msg


def test_state_dict_round_trip_mid_exploration():
    per_token = {4: 3.0, 8: 2.0, 16: 1.0, 32: 1.5, 64: 2.5}

    def drive(ctl, n):
        out = []
        for _ in range(n):
            c = ctl.next_chunk_size()
            out.append(c)
            ctl.observe(c, per_token[c], *_cost(c), pipeline=PIPE)
        return out

    full = ChunkSizeController(explore_every=4)
    expected = drive(full, 14)
    first = ChunkSizeController(explore_every=4)
    head = drive(first, 6)  # stops inside the exploration round
    resumed = ChunkSizeController(explore_every=4)
    resumed.load_state_dict(first.state_dict())
    assert head + drive(resumed, 8) == expected


def test_a_resume_keeps_the_configured_candidates_and_exploration_period():
    """The checkpoint's candidates and period replaced the configured ones: a resume with
    oppo.chunk_candidates=[2,3,5] went on choosing among [4, ..., 64]. Now the chosen size is
    decided again among the new candidates from the saved calibration (2 ms per call, 0.1 ms
    per token, three scorers: 5 is the cheapest of them), and the new period holds."""
    first = ChunkSizeController(candidates=(4, 8, 16, 32, 64), explore_every=50)
    for _ in range(3):
        c = first.next_chunk_size()
        first.observe(c, 1.0, *_cost(c), scorers=3, pipeline=PIPE)
    assert first.chunk_size == 16
    resumed = ChunkSizeController(candidates=(2, 3, 5), explore_every=2)
    note = resumed.load_state_dict(first.state_dict())
    assert note.startswith("chunk size candidates [2, 3, 5], not the checkpoint's [4, 8, 16, 32, "
                           "64]; chunk_size=5 from the cost model")
    assert resumed.chunk_size == 5 and resumed.step == 3
    c = resumed.next_chunk_size()
    assert resumed.observe(c, 1.0, *_cost(c)).startswith("exploring chunk sizes [2, 3, 5]")  # step 4
    same = ChunkSizeController(candidates=(4, 8, 16, 32, 64), explore_every=50)
    assert same.load_state_dict(first.state_dict()) is None and same.chunk_size == 16


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


def test_delta_moves_a_whole_prompt_at_a_time():
    """With the pool drawing whole prompts of 4 responses, Delta steps by 4 rows: a step of 1
    left the pool unchanged for three windows in four while the logs named another Delta."""
    from oppo_ds.rollout.controllers import DeltaController

    ctl = DeltaController(delta_min=0, delta_max=8, window=2, step_size=4)
    seen = [ctl.delta]
    for window in ([2.0, 1.0], [1.0, 1.0], [0.0, 1.0], [0.0, 1.0], [3.0, 0.0], [3.0, 0.0], [3.0, 0.0]):
        ctl.observe(window[0])
        assert ctl.observe(window[1]).startswith(f"delta={ctl.delta} ")
        seen.append(ctl.delta)
    assert seen == [8, 4, 0, 4, 8, 4, 0, 0]
    with pytest.raises(ValueError, match="multiples of step_size 4, got 0 and 6"):
        DeltaController(delta_min=0, delta_max=6, step_size=4)
    # a checkpoint's Delta that is no multiple (saved with other settings) goes down to one
    resumed = DeltaController(delta_min=4, delta_max=12, window=2, step_size=4)
    assert resumed.load_state_dict({"delta": 7, "rewards": []}) == \
        "delta=4: the checkpoint's 7 is not a multiple of 4"
    assert resumed.load_state_dict({"delta": 2, "rewards": []}) == \
        "delta=4: the checkpoint's 2 is outside [4, 12]"
    assert resumed.load_state_dict({"delta": 12, "rewards": []}) is None and resumed.delta == 12


def test_a_resume_keeps_delta_within_the_configured_bounds():
    """A checkpoint's Delta of 8 stayed 8 after a resume with oppo.delta_max=2 until the next
    window closed; now it starts within the run's bounds, and a shorter window keeps only the
    rewards it can use."""
    from oppo_ds.rollout.controllers import DeltaController

    saved = DeltaController(delta_min=0, delta_max=8, window=10)
    for r in range(6):
        saved.observe(float(r))
    lower = DeltaController(delta_min=0, delta_max=2, window=3)
    assert lower.load_state_dict(saved.state_dict()) == "delta=2: the checkpoint's 8 is outside [0, 2]"
    assert lower.delta == 2 and lower.rewards == [4.0, 5.0]
    assert lower.observe(6.0).startswith("delta=2 (was 2): reward rising")  # capped at the new max
    again = DeltaController(delta_min=0, delta_max=8, window=10)
    assert again.load_state_dict(saved.state_dict()) is None and again.delta == 8
