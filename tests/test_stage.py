"""Tier 1: the ``stage`` placement with real processes over gloo on a free port.

Rank 0 is the actor, rank 1 the scorer stage; both build the same tiny models from config with
fixed seeds. The stage's rollout must give the Generation of ``stream_generate`` exactly and
its scores within 1e-6: the scorer rank runs the same calls on the same inputs with the same
weights, so the numbers are bit-identical in practice (one intra-op thread on both sides); the
tolerance only leaves room for a kernel choosing another reduction order in another process.
A scorer that raises on the stage must surface on the actor as an error naming the rank, the
stage must serve the next rollout, and both processes must exit (timeouts everywhere).
"""
from __future__ import annotations

import traceback
from datetime import timedelta

import pytest
import torch

from _builders import left_padded_prompts, sharpen as _sharpen, spawn_and_collect

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
    from oppo_ds.rollout.stage import stage_stream_generate
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


def _worker(rank, port, scenario, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=60))
        from oppo_ds.rollout.stage import RemoteScorerError, RemoteScorers, ScorerStage
        from oppo_ds.rollout.streaming import StreamingScorer
        archs = ARCHS if scenario == "equal" else ARCHS[:1]
        for arch in archs:
            actor, reference, reward, critic = _models(arch)
            if rank == 1:
                failing = type("Failing", (_FailsOnce, StreamingScorer), {})
                cls = failing if scenario == "error" else None
                served = ScorerStage(_scorers(reference, reward, critic, cls), actor_rank=0,
                                     timeout=timedelta(seconds=60)).serve()
                out.put(("served", arch, served))
                continue
            remote = RemoteScorers(scorer_rank=1, timeout=timedelta(seconds=60))
            scorers = _scorers(reference, reward, critic)
            try:
                if scenario == "error":
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
        dist.destroy_process_group()
    except BaseException:
        out.put(("crash", rank, traceback.format_exc()))
        raise


def _spawn(scenario):
    return spawn_and_collect(_worker, lambda rank, port, out: (rank, port, scenario, out), 2, JOIN_S)


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


def test_scorer_failure_reaches_the_actor_and_the_stage_recovers():
    messages = _spawn("error")
    (error,) = [m for kind, _, m in messages if kind == "error"]
    assert error is not None, "the actor finished a rollout whose scorer raised"
    assert "scorer stage on rank 1" in error and "injected scorer failure" in error
    (after,) = [m for kind, _, m in messages if kind == "after_error"]
    assert after["same_generation"] and after["diff"] < ATOL, after
    # the failed rollout was aborted, the next one ended: two rollouts, then SHUTDOWN
    assert [n for kind, _, n in messages if kind == "served"] == [2]
