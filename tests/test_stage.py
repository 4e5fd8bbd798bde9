"""Tier 1: the ``stage`` placement with real processes over gloo on a free port.

Laid out as the trainer does (``StageLayout``): the actor ranks in a gloo world of their own,
the scorer process in none, each streaming actor rank linked to it by a standalone two-rank
group. Rank 0 is the actor, rank 1 the scorer stage (in the last tests ranks 0 and 1 are one
model replica, or two actor ranks, and rank 2 the stage); all build the same tiny models from
config with fixed seeds. The stage's rollout must give the Generation of ``stream_generate`` exactly and
its scores within 1e-6: the scorer rank runs the same calls on the same inputs with the same
weights, so the numbers are bit-identical in practice (one intra-op thread on both sides); the
tolerance only leaves room for a kernel choosing another reduction order in another process.
A scorer that raises on the stage must surface on the actor as an error naming the rank, the
stage must serve the next rollout, and both processes must exit (timeouts everywhere).
"""
from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from _builders import left_padded_prompts, sharpen as _sharpen, spawn_stage

ARCHS = ["tiny-llama", "tiny-gpt2"]
VOCAB = 40
PAD = 0
PROMPT_LENS = [3, 7, 5, 6, 2, 4]


def _prompts(lens=PROMPT_LENS, seed=1):
    return left_padded_prompts(lens, VOCAB, PAD, seed)
MAX_NEW = 20
CHUNKS = [1, 3, MAX_NEW + 5]
SEED = 7
ATOL = 1e-6
JOIN_S = 90  # per spawn; the processes take a few seconds to import torch and transformers


def _params():
    from oppo_ds.rollout.generate import SamplingParams
    return SamplingParams(max_new_tokens=MAX_NEW, eos_token_ids=(2, 5, 7), pad_token_id=PAD,
                          temperature=1.0)


def _models(arch):
    from oppo_ds.models import build_causal_lm, build_value_model
    actor = build_causal_lm(arch, vocab_size=VOCAB, seed=0).eval()
    reference = _sharpen(build_causal_lm(arch, vocab_size=VOCAB, seed=1), seed=11)
    reward = _sharpen(build_value_model(arch, vocab_size=VOCAB, seed=2), seed=12)
    critic = _sharpen(build_value_model(arch, vocab_size=VOCAB, seed=3), seed=13)
    return actor, reference, reward, critic


def _scorers(reference, reward, critic, cls=None):
    from oppo_ds.rollout.streaming import StreamingScorer
    cls = cls or StreamingScorer
    return [cls(reward, "reward"), cls(reference, "reference"), cls(critic, "critic")]


class _FailsOnce:
    """Mixed into a scorer: its second consume of the first rollout raises."""
    calls = 0

    def consume(self, rows, tokens, lengths):
        type(self).calls += 1
        if type(self).calls == 2:
            raise RuntimeError("injected scorer failure")
        return super().consume(rows, tokens, lengths)


def _compare(actor, scorers, remote, chunk_size):
    """Stage vs inline on rank 0: what the pytest process checks."""
    from oppo_ds.rollout.stage_stream import stage_stream_generate
    from oppo_ds.rollout.streaming import stream_generate
    ids, mask = _prompts()
    params = _params()
    gen, got, timing = stage_stream_generate(actor, remote, ids, mask, params,
                                             torch.Generator().manual_seed(SEED), chunk_size)
    ref_gen, want, _ = stream_generate(actor, scorers, ids, mask, params,
                                       torch.Generator().manual_seed(SEED), chunk_size)
    same_gen = all(torch.equal(getattr(gen, f), getattr(ref_gen, f))
                   for f in ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
                             "logprobs", "lengths"))
    return {"chunk_size": chunk_size, "same_generation": same_gen,
            "kinds": sorted(got), "shapes": {k: tuple(v.shape) == tuple(want[k].shape)
                                             for k, v in got.items()},
            "diff": max((got[k] - want[k]).abs().max().item() for k in want),
            "chunks": timing.chunks, "lanes": sorted({e.lane for e in timing.events}),
            "busy": timing.scoring_busy_s, "hidden": timing.scoring_hidden_frac,
            "tail_ok": timing.scoring_end_s >= timing.decode_end_s > 0,
            "lengths": sorted(set(gen.lengths.tolist()))}


class _StopAt:
    """The rollout pool's stop rule, without ranks: enough rows have finished."""

    def __init__(self, need):
        self.need = need

    def __call__(self, state):
        return state is None or state.done or len(state.finish_order) >= self.need


def _against_fresh_inline(actor, scorers, inputs, uids, params, round_, state, got) -> dict:
    """The same pool rollout inline, with ``scorers`` prefilling every row's prompt and
    response so far afresh: whether the tokens agree, which rows ended, and the largest
    difference of the stage's results (``got``) to the inline ones."""
    from oppo_ds.rollout.streaming import stream_continue
    extra = (inputs["prefix_ids"], inputs["prefix_lengths"]) if "prefix_ids" in inputs else ()
    setup = [(sc.kind, "add", sc.add, (uids.tolist(), inputs["prompt_ids"],
                                        inputs["prompt_mask"], *extra)) for sc in scorers]
    ref_state, want, _ = stream_continue(actor, scorers, setup, inputs, uids, params,
                                         torch.Generator().manual_seed(SEED + round_), 3,
                                         stop=_StopAt(2))
    return {"same_tokens": torch.equal(state.tokens, ref_state.tokens) and
            torch.equal(state.lengths, ref_state.lengths),
            "ended": sorted(int(uids[r]) for r in state.finish_order),
            "rows": {k: sorted(v) for k, v in got.items()},
            "diff": max((got[k][r] - want[k][r]).abs().max().item() for k in want for r in want[k])}


def _continue_twice(actor, reference, reward, critic, remote):
    """Two pool rollouts through the stage (the second continues the rows the first left
    unfinished, from their responses so far) against ``stream_continue`` inline with scorers
    that prefill every row the same way: tokens identical, results of the rows that finished
    within ATOL, none for rows still running."""
    from oppo_ds.rollout.stage_stream import stage_stream_continue
    ids, mask = _prompts()
    params = _params()
    uids = torch.arange(100, 100 + ids.shape[0])
    inputs = dict(prompt_ids=ids, prompt_mask=mask)
    report = []
    for round_ in range(2):
        state, got, _ = stage_stream_continue(actor, remote, inputs, uids, params,
                                              torch.Generator().manual_seed(SEED + round_), 3,
                                              stop=_StopAt(2))
        scorers = _scorers(reference, reward, critic)
        report.append({**_against_fresh_inline(actor, scorers, inputs, uids, params, round_,
                                               state, got),
                       "kinds": sorted(got),
                       "running_before": int((inputs.get("prefix_lengths", torch.zeros(0)) > 0).sum())})
        # the next round continues the rows still running, from their responses so far
        keep = [i for i in range(len(uids)) if not bool(state.finished[i])]
        lengths = state.lengths[keep]
        width = int(lengths.max())
        inputs = dict(prompt_ids=inputs["prompt_ids"][keep], prompt_mask=inputs["prompt_mask"][keep],
                      prefix_ids=state.tokens[keep, :width], prefix_lengths=lengths,
                      prefix_logprobs=state.logprobs[keep, :width])
        uids = uids[keep]
    return report


def _continue_carried(actor, reference, reward, critic, remote):
    """Three pool rollouts through a carrying stage (the trainer's: frozen scorers carry,
    the critic is rebuilt each rollout): round 1 continues the rows round 0 left unfinished,
    which the frozen scorers hold (sent again for the critic only), beside 2 new prompts;
    round 2 continues all but one of the still unfinished rows (the stage drops that one).
    Before each round the critic "trains" (its weights are redrawn here) and goes to the
    stage (``send_weights``). Against inline scorers, the critic with this round's weights,
    that prefill every row's prompt and response so far afresh each round: tokens
    identical, scores within 1e-5 (a carried prefix was prefilled chunk by chunk, a fresh one
    in one forward: float summation order)."""
    from oppo_ds.rollout.generate import finish
    from oppo_ds.rollout.stage_stream import stage_stream_continue
    from oppo_ds.rollout.streaming import StreamingScorer
    all_ids, all_mask = _prompts(PROMPT_LENS + [4, 5])
    first = len(PROMPT_LENS)
    params = _params()
    rows = list(range(first))  # indices into all_ids; the row id is 100 + index
    lengths = {}  # row index -> its response so far (tokens)
    report = []
    for round_ in range(3):
        if round_ == 1:
            rows = rows + [first, first + 1]
        if round_ == 2:
            rows = rows[1:]
        idx = torch.tensor(rows)
        width = max([len(lengths.get(r, [])) for r in rows] + [0])
        prefix = torch.full((len(rows), max(width, 1)), PAD, dtype=torch.long)
        for i, r in enumerate(rows):
            prefix[i, :len(lengths.get(r, []))] = torch.tensor(lengths.get(r, []), dtype=torch.long)
        inputs = dict(prompt_ids=all_ids[idx], prompt_mask=all_mask[idx])
        if width:
            inputs.update(prefix_ids=prefix[:, :width],
                          prefix_lengths=torch.tensor([len(lengths.get(r, [])) for r in rows]))
        uids = idx + 100
        held_before = set(remote.held)
        _sharpen(critic, seed=30 + round_)  # an update
        remote.send_weights(critic, version=round_, bucket=1000)  # several buckets
        state, got, timing = stage_stream_continue(actor, remote, inputs, uids, params,
                                                   torch.Generator().manual_seed(SEED + round_), 3,
                                                   stop=_StopAt(2))
        scorers = [StreamingScorer(reward, "reward"), StreamingScorer(reference, "reference"),
                   StreamingScorer(critic, "critic")]
        report.append({
            **_against_fresh_inline(actor, scorers, inputs, uids, params, round_, state, got),
            "carried": sorted(held_before & set(uids.tolist())),
            "held_after": sorted(remote.held),
            "stage_begins": {k: sum(e.name == "begin" and e.lane == k for e in timing.events)
                             for k in ("reward", "reference", "critic")}})
        gen = finish(state)
        lengths = {r: gen.response_ids[i, :int(gen.lengths[i])].tolist()
                   for i, r in enumerate(rows) if not bool(state.finished[i])}
        rows = [r for i, r in enumerate(rows) if not bool(state.finished[i])]
    # an empty rollout (a rank with nothing to decode while others do): no results, and the
    # stage drops the rows it held; the still unfinished rows then go again as new rows
    held_before_empty = sorted(remote.held)
    remote.empty_rollout()
    idx = torch.tensor(rows)
    inputs = dict(prompt_ids=all_ids[idx], prompt_mask=all_mask[idx])
    state, got, timing = stage_stream_continue(actor, remote, inputs, idx + 100, params,
                                               torch.Generator().manual_seed(SEED + 3), 3,
                                               stop=_StopAt(2))
    scorers = [StreamingScorer(reward, "reward"), StreamingScorer(reference, "reference"),
               StreamingScorer(critic, "critic")]
    after_empty = {**_against_fresh_inline(actor, scorers, inputs, idx + 100, params, 3, state, got),
                   "held_before_empty": held_before_empty, "n_rows": len(rows),
                   "stage_begins": {k: sum(e.name == "begin" and e.lane == k for e in timing.events)
                                    for k in ("reward", "reference", "critic")}}
    report.append(after_empty)
    from oppo_ds.models import build_value_model
    from oppo_ds.rollout.stage import RemoteScorerError

    def refused():
        try:
            stage_stream_continue(actor, remote, dict(prompt_ids=all_ids[:2],
                                                      prompt_mask=all_mask[:2]),
                                  torch.tensor([200, 201]), params,
                                  torch.Generator().manual_seed(0), 3)
            return None
        except RemoteScorerError as err:
            return str(err)

    # weights awaited from another link, where there is none: the next rollout says so
    remote.await_weights(version=42)
    never_sent = refused()
    # a critic of another shape: refused, and the stage says why at the next rollout
    remote.send_weights(build_value_model(ARCHS[1], vocab_size=VOCAB, seed=3), version=9)
    return report, (never_sent, refused())


def _worker(rank, _layout, links, out, scenario):
    from oppo_ds.rollout.stage import RemoteScorerError, RemoteScorers, ScorerStage
    from oppo_ds.rollout.streaming import StreamingScorer
    archs = ARCHS if scenario == "equal" else ARCHS[:1]
    for arch in archs:
        actor, reference, reward, critic = _models(arch)
        carry = scenario == "carry"
        if rank == 1:
            failing = type("Failing", (_FailsOnce, StreamingScorer), {})
            cls = failing if scenario == "error" else None
            scorers = _scorers(reference, reward, critic, cls)
            weights = None
            if carry:  # the stage's critic copy starts elsewhere: only WEIGHTS make it right
                from oppo_ds.rollout.stage import StageWeights
                weights = StageWeights(_sharpen(critic, seed=99))
            served = ScorerStage(scorers, links[0], timeout=timedelta(seconds=60),
                                 carry=carry, weights=weights).serve()
            out.put(("served", arch, served))
            continue
        remote = RemoteScorers(links[0], timeout=timedelta(seconds=60), carry=carry,
                               refresh=carry)
        scorers = _scorers(reference, reward, critic)
        try:
            if carry:
                out.put(("carry", arch, _continue_carried(actor, reference, reward, critic,
                                                          remote)))
            elif scenario == "continue":
                out.put(("continue", arch, _continue_twice(actor, reference, reward,
                                                           critic, remote)))
            elif scenario == "error":
                try:
                    _compare(actor, scorers, remote, 3)
                    out.put(("error", arch, None))
                except RemoteScorerError as err:
                    out.put(("error", arch, str(err)))
                # the stage reset and serves the next rollout (its scorer fails only once)
                out.put(("after_error", arch, _compare(actor, scorers, remote, 3)))
            else:
                for chunk_size in CHUNKS:
                    out.put(("equal", arch, _compare(actor, scorers, remote, chunk_size)))
        finally:
            remote.close()


def _spawn(scenario):
    return spawn_stage(_worker, 1, scenario, join_s=JOIN_S)


def test_stage_scores_equal_inline():
    messages = _spawn("equal")
    equal = [(arch, m) for kind, arch, m in messages if kind == "equal"]
    assert [(arch, m["chunk_size"]) for arch, m in equal] == \
        [(a, c) for a in ARCHS for c in CHUNKS]
    for arch, m in equal:
        assert m["same_generation"], (arch, m)
        assert m["kinds"] == ["critic", "reference", "reward"] and all(m["shapes"].values())
        assert m["diff"] < ATOL, (arch, m)
        assert m["lanes"] == ["actor", "critic", "reference", "reward"]
        assert m["busy"] > 0 and 0.0 <= m["hidden"] <= 1.0 and m["tail_ok"], m
        assert len(m["lengths"]) >= 3  # rows end at different chunks
    # chunk larger than every response: one chunk; chunk 1: one per token of the longest
    by_chunk = {m["chunk_size"]: m["chunks"] for _, m in equal}
    assert by_chunk[MAX_NEW + 5] == 1 and by_chunk[1] >= by_chunk[3] > 1
    # each arch's stage served 3 rollouts and returned on SHUTDOWN
    assert sorted((arch, n) for kind, arch, n in messages if kind == "served") == \
        [(a, len(CHUNKS)) for a in sorted(ARCHS)]


def test_stage_continues_the_pools_rows_as_inline_scorers_do():
    """The rollout pool through the stage: a rollout stops once 2 rows ended, the stage sends
    results for those only; the next rollout sends the others with their responses so far,
    which the stage prefills, and they go on to the end. Tokens and scores as inline."""
    messages = _spawn("continue")
    (report,) = [m for kind, _, m in messages if kind == "continue"]
    first, second = report
    for r in report:
        assert r["same_tokens"] and r["kinds"] == ["critic", "reference", "reward"], r
        assert r["diff"] < ATOL, r
        # results exactly for the rows that ended in this rollout
        assert all(rows == r["ended"] for rows in r["rows"].values()), r
    assert len(first["ended"]) >= 2 and len(first["ended"]) < len(PROMPT_LENS)
    assert second["running_before"] > 0  # the second rollout continued begun responses
    assert set(first["ended"]).isdisjoint(second["ended"])
    assert [n for kind, _, n in messages if kind == "served"] == [2]


def test_a_carrying_stage_keeps_the_deferred_rows_between_rollouts():
    """The trainer's stage (carry=True; reward and reference carry, the critic takes new
    weights before every rollout and rebuilds every row): rows a rollout left unfinished stay
    in the frozen scorers' caches, the next BEGIN prefills only new rows there (none when
    every row is carried), a row the actor stops decoding is dropped, and every score,
    the critic's included, equals fresh inline scoring of every row's whole prefix with
    that round's weights (1e-5). Weights awaited from another actor rank's link (there is
    none) and WEIGHTS of a critic of another shape are refused with the reason, at the next
    rollout."""
    messages = _spawn("carry")
    (report, (never_sent, refused)) = [m for kind, _, m in messages if kind == "carry"][0]
    first, second, third, after_empty = report
    for r in report[:3]:
        assert r["same_tokens"] and r["diff"] < 1e-5, r
        assert r["rows"]["critic"] == r["ended"], r
        assert all(rows == r["ended"] for rows in r["rows"].values()), r
    frozen = ("reward", "reference")
    assert first["carried"] == [] and first["stage_begins"] == dict.fromkeys(frozen + ("critic",), 1)
    unfinished = first["held_after"]
    assert unfinished and second["carried"] == unfinished  # continued without being re-sent
    # the 2 new prompts only (one add per frozen scorer), and the critic rebuilds every row
    assert second["stage_begins"] == dict.fromkeys(frozen + ("critic",), 1)
    assert third["carried"] == second["held_after"][1:]  # the first one left the rollout
    assert third["stage_begins"] == {"reward": 0, "reference": 0, "critic": 1}
    # after an empty rollout the stage held nothing: the unfinished rows were prefilled anew
    # (one begin in every scorer), and every score is fresh inline scoring's
    assert after_empty["held_before_empty"] == third["held_after"] != []
    assert after_empty["n_rows"] == len(third["held_after"])
    assert after_empty["stage_begins"] == dict.fromkeys(frozen + ("critic",), 1)
    assert after_empty["same_tokens"] and after_empty["diff"] < 1e-5, after_empty
    assert never_sent is not None and "awaited the critic's weights version 42" in never_sent
    assert "serves one actor rank's link alone" in never_sent, never_sent
    assert refused is not None and "is not the stage's copy" in refused, refused
    assert [n for kind, _, n in messages if kind == "served"] == [7]


def test_scorer_failure_reaches_the_actor_and_the_stage_recovers():
    messages = _spawn("error")
    (error,) = [m for kind, _, m in messages if kind == "error"]
    assert error is not None, "the actor finished a rollout whose scorer raised"
    assert "scorer stage on rank 1" in error and "injected scorer failure" in error
    (after,) = [m for kind, _, m in messages if kind == "after_error"]
    assert after["same_generation"] and after["diff"] < ATOL, after
    # the failed rollout was aborted, the next one ended: two rollouts, then SHUTDOWN
    assert [n for kind, _, n in messages if kind == "served"] == [2]


# ------------------------------------------------------------------ one sender per model replica
# Ranks 0 and 1 stand for the two ranks of a tensor-parallel replica: they decode the same
# tokens (same weights, same generator seed); only rank 0 streams to the scorer rank 2, and
# rank 1 takes the scores from rank 0. (Real tensor-parallel replicas run in
# tests/test_megatron.py; here the ranks decode independently, which is enough for the
# protocol: who sends, who receives, and that a failure reaches both.)

def _replica_worker(rank, layout, links, out, scenario):
    import torch.distributed as dist
    from oppo_ds.rollout.stage import RemoteScorerError, RemoteScorers, ScorerStage
    from oppo_ds.rollout.stage_stream import Replica, stage_stream_generate
    from oppo_ds.rollout.streaming import StreamingScorer, stream_generate
    actor, reference, reward, critic = _models(ARCHS[0])
    if rank == 2:
        assert sorted(links) == layout.senders == [0]  # one sender for the replica
        cls = type("Failing", (_FailsOnce, StreamingScorer), {}) if scenario == "error" \
            else None
        out.put(("served", rank, ScorerStage(_scorers(reference, reward, critic, cls), links[0],
                                             timeout=timedelta(seconds=60)).serve()))
        return
    remote = RemoteScorers(links[0], timeout=timedelta(seconds=60)) if rank == 0 else None
    assert (rank in links) == (rank == 0)
    replica = Replica(dist.group.WORLD, sender=0)  # the two actor ranks are the world
    ids, mask = _prompts()
    params = _params()

    def rollout():
        gen, got, timing = stage_stream_generate(
            actor, remote, ids, mask, params, torch.Generator().manual_seed(SEED), 3,
            replica=replica)
        ref_gen, want, _ = stream_generate(actor, _scorers(reference, reward, critic), ids,
                                           mask, params, torch.Generator().manual_seed(SEED), 3)
        return {"same_generation": torch.equal(gen.response_ids, ref_gen.response_ids) and
                torch.equal(gen.lengths, ref_gen.lengths),
                "kinds": sorted(got), "diff": max((got[k] - want[k]).abs().max().item()
                                                  for k in want),
                "chunks": timing.chunks, "busy": timing.scoring_busy_s}

    try:
        if scenario == "error":
            try:
                rollout()
                out.put(("error", rank, None))
            except RemoteScorerError as err:
                out.put(("error", rank, str(err)))
        out.put(("rollout", rank, rollout()))
    finally:
        if remote is not None:
            remote.close()


def _spawn_replica(scenario):
    return spawn_stage(_replica_worker, 2, scenario, join_s=JOIN_S, tp=2)


def test_one_rank_of_a_replica_streams_and_shares_the_scores():
    messages = _spawn_replica("equal")
    got = {rank: m for kind, rank, m in messages if kind == "rollout"}
    assert sorted(got) == [0, 1]
    for m in got.values():
        assert m["same_generation"] and m["diff"] < ATOL, m
        assert m["kinds"] == ["critic", "reference", "reward"]
    # rank 1 holds the sender's timing (the stage's events), not a timing of its own
    assert got[1]["chunks"] == got[0]["chunks"] > 1 and got[1]["busy"] == got[0]["busy"] > 0
    # the scorer rank served one rollout (rank 0's), then SHUTDOWN
    assert [n for kind, _, n in messages if kind == "served"] == [1]


def test_a_scorer_failure_reaches_every_rank_of_the_replica():
    messages = _spawn_replica("error")
    errors = {rank: m for kind, rank, m in messages if kind == "error"}
    assert errors[0] is not None and "scorer stage on rank 2" in errors[0]
    assert "injected scorer failure" in errors[0]
    # rank 1 never talked to the stage: the sender tells it what failed
    assert errors[1] is not None and "rank 0, which streams for its replica, failed" in errors[1]
    assert "injected scorer failure" in errors[1]
    after = {rank: m for kind, rank, m in messages if kind == "rollout"}
    assert all(m["same_generation"] and m["diff"] < ATOL for m in after.values()), after
    assert [n for kind, _, n in messages if kind == "served"] == [2]


# ------------------------------------------------------------------ several actor ranks at once
# Actor ranks 0 and 1 share the scorer rank 2. Rank 0 begins a rollout, sends a chunk, and
# then waits for rank 1 (a barrier of the two) before it sends the rest; rank 1 runs a whole
# rollout meanwhile. Served in turn (rank 0's rollout to its end first) this deadlocks: rank 1
# would wait for its results and rank 0 for rank 1. ``serve_round`` serves both at once.

def _fixed_rollout(rank):
    """A rank's rollout without an actor: its prompts and 6 given tokens per row, sent as two
    chunks of 3 (the second ends every row)."""
    ids, mask = _prompts(seed=1 + rank)
    tokens = torch.randint(3, VOCAB, (ids.shape[0], 6), generator=torch.Generator().manual_seed(rank))
    return ids, mask, tokens, torch.arange(ids.shape[0])


def _send_chunk(remote, rollout, i):
    _, _, tokens, rows = rollout
    ended = rows if i == 1 else torch.zeros(0, dtype=torch.long)
    remote.chunk(str(i), rows, tokens[:, 3 * i:3 * i + 3], torch.full_like(rows, 3), ended)


def _diff_to_inline(got, scorers, rollout):
    """The largest difference of the stage's results ``got`` to the same calls here."""
    ids, mask, tokens, rows = rollout
    want = {}
    for scorer in scorers:
        scorer.begin(ids, mask)
        for i in (0, 1):
            scorer.consume(rows, tokens[:, 3 * i:3 * i + 3], torch.full_like(rows, 3))
        want[scorer.kind] = scorer.finish(rows)
    return max((got[k][r] - want[k][r]).abs().max().item() for k in want for r in want[k])


def _serve_rounds(stages, out):
    """The scorer rank of these tests: rounds until the actor ranks shut it down."""
    from oppo_ds.rollout.stage import serve_round
    served = 0
    while stages[0].stopped_by is None:
        served += serve_round(stages)
    out.put(("served", 2, served))


def _concurrent_worker(rank, _layout, links, out):
    import torch.distributed as dist
    from oppo_ds.rollout.stage import RemoteScorers, ScorerStage
    from oppo_ds.rollout.streaming import StreamingScorer
    _, reference, reward, _ = _models(ARCHS[0])

    def scorers():
        return [StreamingScorer(reward, "reward"), StreamingScorer(reference, "reference")]

    if rank == 2:
        _serve_rounds([ScorerStage(scorers(), links[a], timeout=timedelta(seconds=60))
                       for a in (0, 1)], out)
        return
    rollout = _fixed_rollout(rank)
    remote = RemoteScorers(links[rank], timeout=timedelta(seconds=60))
    remote.begin(*rollout[:2])
    _send_chunk(remote, rollout, 0)
    if rank == 0:
        dist.barrier()  # of the two actor ranks: rank 1's whole rollout happens meanwhile
    _send_chunk(remote, rollout, 1)
    got, _ = remote.results()
    if rank == 1:
        dist.barrier()
    remote.close()
    out.put(("rollout", rank, {"kinds": sorted(got), "rows": sorted(got["reward"]),
                               "diff": _diff_to_inline(got, scorers(), rollout)}))


def test_scorer_rank_serves_several_actor_ranks_at_once():
    messages = spawn_stage(_concurrent_worker, 2, join_s=JOIN_S)
    got = {rank: m for kind, rank, m in messages if kind == "rollout"}
    assert sorted(got) == [0, 1]
    for m in got.values():
        assert m["kinds"] == ["reference", "reward"] and m["rows"] == list(range(len(PROMPT_LENS)))
        assert m["diff"] < ATOL, m
    assert [n for kind, _, n in messages if kind == "served"] == [2]


# ------------------------------------------------------------------ one critic copy, one sender
# Actor ranks 0 and 1 share scorer rank 2 and its one critic copy, which starts with other
# weights. Each round both "train" the critic to the same new weights; rank 0 sends them,
# rank 1 only names the version (AWAIT_WEIGHTS) and sends its whole rollout at once, while
# rank 0 holds its WEIGHTS back (a barrier, then half a second), so rank 1's BEGIN reaches
# the stage first. A stage that scored it then would use the older copy (round 0: none at
# all). A third round awaits a version nobody sends: rank 0's rollout is served, and then
# rank 1's BEGIN is answered with the error instead of a hang.

def _one_sender_worker(rank, _layout, links, out):
    import time
    import torch.distributed as dist
    from oppo_ds.rollout.stage import (RemoteScorerError, RemoteScorers, ScorerStage,
                                       StageWeights)
    _, reference, reward, critic = _models(ARCHS[0])
    if rank == 2:
        weights = StageWeights(_sharpen(critic, seed=99))
        _serve_rounds([ScorerStage(_scorers(reference, reward, weights.model), links[a],
                                   timeout=timedelta(seconds=60), weights=weights)
                       for a in (0, 1)], out)
        return
    rollout = _fixed_rollout(rank)
    remote = RemoteScorers(links[rank], timeout=timedelta(seconds=60))

    def send_rollout():
        remote.begin(*rollout[:2])
        _send_chunk(remote, rollout, 0)
        _send_chunk(remote, rollout, 1)

    for round_ in range(3):
        if round_ < 2:
            _sharpen(critic, seed=30 + round_)  # an update, the same on both ranks
        if rank == 0:
            dist.barrier()  # rank 1's rollout is on its way
            time.sleep(0.5)
            if round_ < 2:
                remote.send_weights(critic, version=round_, bucket=1000)
            send_rollout()
        else:
            remote.await_weights(version=round_ if round_ < 2 else 7)
            send_rollout()
            dist.barrier()
        try:
            got, _ = remote.results()
        except RemoteScorerError as err:
            out.put(("refused", rank, (round_, str(err))))
            continue
        diff = _diff_to_inline(got, _scorers(reference, reward, critic), rollout)
        out.put(("rollout", rank, (round_, sorted(got), diff)))
    remote.close()


def test_one_rank_sends_the_critic_the_others_await_it():
    """The stage waits for the awaited version before serving a rank's rollout, so every
    rollout is scored by the critic of its round (1e-6 against this process's critic), with
    the weights sent once per round; a version never sent is an error at that rank's BEGIN,
    after the other rank's rollout was served."""
    messages = spawn_stage(_one_sender_worker, 2, join_s=JOIN_S)
    got = sorted(m for kind, _, m in messages if kind == "rollout")
    assert [(r, k) for r, k, _ in got] == [(0, ["critic", "reference", "reward"])] * 2 + \
        [(1, ["critic", "reference", "reward"])] * 2 + [(2, ["critic", "reference", "reward"])]
    assert all(diff < ATOL for *_, diff in got), got
    (refused,) = [(rank, m) for kind, rank, m in messages if kind == "refused"]
    assert refused[0] == 1 and refused[1][0] == 2, refused
    assert "awaited the critic's weights version 7" in refused[1][1], refused
    assert [n for kind, _, n in messages if kind == "served"] == [6]


def _abort_worker(rank, port, out):
    """Actor ranks 0 and 1 in a gloo world of their own, the scorer rank 2 in none; actor rank
    1 ends before it opens its link (the trainer's ``atexit`` calls ``abort``), the others try
    to open theirs."""
    import os
    import time
    import traceback

    import torch.distributed as dist

    from _builders import _exit_without_finalizing
    from oppo_ds.rollout.stage_layout import StageAborted, StageLayout

    torch.set_num_threads(1)
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        layout = StageLayout(rank, 3, [0, 1])
        if not layout.is_scorer:
            dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2,
                                    timeout=timedelta(seconds=60))
        start = time.monotonic()
        if rank != 1:
            try:
                layout.open_links("gloo", timedelta(minutes=10))
                out.put(("linked", rank, None))
            except StageAborted as err:
                out.put(("aborted", rank, (str(err), time.monotonic() - start)))
        layout.abort()  # at exit: rank 0 hosts the store until the scorer rank has read it
    except BaseException:
        out.put(("crash", rank, traceback.format_exc()))
        raise
    _exit_without_finalizing(out)


def test_a_rank_ending_before_its_link_opened_stops_the_others_at_once():
    """An actor rank that ends before its link opens (a bad path, say) says so in the store
    at its exit; the scorer rank and the other actor rank, waiting to open theirs, stop within
    seconds naming it, not after the link timeout (30 minutes in the trainer)."""
    from _builders import spawn_and_collect

    messages = spawn_and_collect(_abort_worker, lambda rank, port, out: (rank, port, out), 3,
                                 JOIN_S)
    got = sorted((rank, m) for kind, rank, m in messages if kind == "aborted")
    assert [rank for rank, _ in got] == [0, 2], messages
    for rank, (text, seconds) in got:
        assert "actor rank 1 ended before its link to the scorer rank (rank 2) opened" in text
        assert seconds < 30, (rank, seconds)


# ------------------------------------------------------------------ the layout of a launch

def test_layout_from_the_deepspeed_launcher():
    """``deepspeed --num_gpus 3`` on one node: ranks 0-1 act, rank 2 scores. An actor rank
    joins a world of 2 (and the node's process count follows, as DeepSpeed's CPU all-reduce
    compares the two); the scorer process changes nothing."""
    from oppo_ds.rollout.stage_layout import StageLayout
    env = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_SIZE": "3",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    actor = StageLayout.from_env(env)
    assert (actor.rank, actor.scorer_rank, actor.actor_ranks, actor.senders) == (1, 2, [0, 1], [0, 1])
    assert not actor.is_scorer
    assert actor.env_updates(env) == {"WORLD_SIZE": "2", "LOCAL_SIZE": "2"}
    scorer = StageLayout.from_env(dict(env, RANK="2", LOCAL_RANK="2"))
    assert scorer.is_scorer and scorer.env_updates(env) == {}
    # several nodes: the per-node count is not the world's and stays
    assert actor.env_updates(dict(env, LOCAL_SIZE="8")) == {"WORLD_SIZE": "2"}


def test_layout_from_a_bare_srun_task_and_a_model_split():
    """Under ``srun`` without a launcher the variables come from Slurm's (the same rules as
    ``oppo_ds.rendezvous``); with tensor_parallel 2 one rank per replica streams."""
    from oppo_ds.rollout.stage_layout import StageLayout
    env = {"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "5", "SLURM_LOCALID": "0",
           "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "77"}
    layout = StageLayout.from_env(env, tp=2)
    assert layout.is_scorer and layout.senders == [0, 2]
    assert layout.env_updates(env) == {"RANK": "4", "WORLD_SIZE": "5", "LOCAL_RANK": "0",
                                       "MASTER_ADDR": "gpu01", "MASTER_PORT": "10077"}
    actor = StageLayout.from_env(dict(env, SLURM_PROCID="3"), tp=2)
    assert actor.env_updates(dict(env, SLURM_PROCID="3"))["WORLD_SIZE"] == "4"


@pytest.mark.parametrize("env, tp, words", [
    ({}, 1, "got WORLD_SIZE=1"),
    ({"RANK": "0", "WORLD_SIZE": "4"}, 2, "k x 2 actor ranks plus the scorer rank, got WORLD_SIZE=4"),
])
def test_layout_refuses_a_launch_it_cannot_split(env, tp, words):
    from oppo_ds.rollout.stage_layout import StageLayout
    with pytest.raises(ValueError, match=words):
        StageLayout.from_env(env, tp=tp)


def test_a_closed_connection_is_told_from_a_process_s_own_error():
    """``link_failure`` decides whether a process of the stage names another's reported
    failure (a closed connection, a transport error, a timeout) or reports its own (anything
    else, a tensor op's RuntimeError included)."""
    import torch.distributed as dist
    from oppo_ds.finite import NonFiniteError
    from oppo_ds.rollout.stage_layout import link_failure

    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:40123. This is typically caused by a remote worker crashing.")
    assert link_failure(gloo)
    assert link_failure(RuntimeError("[pair.cc:598] Connection reset by peer"))
    assert link_failure(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                                     "waiting 1800000ms for recv operation to complete"))
    assert link_failure(dist.DistBackendError("NCCL error: remote process exited"))
    assert link_failure(TimeoutError("the other end of its link was not ready"))
    assert not link_failure(RuntimeError("The size of tensor a (4) must match the size of b (3)"))
    assert not link_failure(NonFiniteError("step 3: Connection closed by peer"))
    assert not link_failure(ValueError("Connection closed by peer"))


def test_the_links_wait_as_long_as_oppo_stage_timeout_minutes():
    """The scorer rank waits for the next rollout through whatever the actor ranks do between
    two (a 70B checkpoint save included): the links' timeout is `oppo.stage_timeout_minutes`
    (30 by default, at least 1). The stage layout here is a stand-in that records what the
    trainer asks of it: opening real links is what the tests above do."""
    from oppo_ds.config import ConfigError, load_config
    from oppo_ds.stage_placement import StagePlacement

    opened = []
    placement = StagePlacement.__new__(StagePlacement)
    placement.stage = SimpleNamespace(is_scorer=False,
                                      open_links=lambda *args: opened.append(args) or {})
    for overrides, minutes in (([], 30), (["oppo.stage_timeout_minutes=120"], 120)):
        placement.cfg = load_config(None, overrides)
        placement._open_stage_links()
        assert opened.pop() == ("gloo", timedelta(minutes=minutes))
    with pytest.raises(ConfigError, match="oppo.stage_timeout_minutes: must be >= 1, got 0"):
        load_config(None, ["oppo.stage_timeout_minutes=0"])
