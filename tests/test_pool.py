"""Tier 0/2: the rollout pool (inter-step overlap) on real tiny models: a deferred sequence
continues as if never interrupted, the first B are taken in finishing order with forced
entries first, the ledger balances, the pool survives torch.save, and the lock-step stop rule
over two real gloo processes stops every rank at the same token."""
from __future__ import annotations

import os
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from _builders import LikeAGpuGenerator, left_padded_prompts, random_lm, spawn_gloo

from oppo_ds.rollout.generate import SamplingParams, decode_steps, finish, start_decode
from oppo_ds.rollout.pool import (BatchStop, PromptLedger, RolloutPool, entries_to_generation,
                                  staleness_metrics, staleness_rows)

pytestmark = pytest.mark.usefixtures("torch_one_thread")

VOCAB, PAD, EOS = 48, 0, 2
LENS = [3, 7, 5, 6, 2, 4]
_MODELS = {}


def _model(arch):
    """Random weights far from the init scale, so that tokens (and EOS) vary by context."""
    if arch not in _MODELS:
        _MODELS[arch] = random_lm(arch, VOCAB, seed=3)
    return _MODELS[arch]


def _prompts(n=len(LENS), seed=1):
    ids, mask = left_padded_prompts(LENS[:n], VOCAB, PAD, seed)
    return [SimpleNamespace(id=f"p{i}", input_ids=ids[i][mask[i].bool()].tolist()) for i in range(n)]


class AfterTokens:
    """A stop rule: enough after ``n`` calls (tokens)."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __call__(self, state):
        self.calls += 1
        return self.calls >= self.n


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2", "tiny-gpt2"])
@pytest.mark.parametrize("greedy", [True, False])
def test_deferred_sequences_continue_as_if_never_interrupted(arch, greedy):
    """Stop after 5 tokens, carry every unfinished row through the pool, rebuild the actor's
    cache with one prefill of prompt + partial response, decode to the end: the tokens equal
    one uninterrupted decode with the same generator, and the log-probs within 1e-5 (the
    prefill computes the prefix's keys in one matmul instead of one per token)."""
    model = _model(arch)
    params = SamplingParams(max_new_tokens=16, eos_token_ids=(EOS,), pad_token_id=PAD,
                            temperature=0.0 if greedy else 1.0)
    prompts = _prompts()
    pool = RolloutPool(batch_size=2, max_defer_steps=3)
    pool.top_up(prompts, len(prompts))
    inputs = pool.decode_inputs(pool.running(), PAD, "cpu")

    g_ref = torch.Generator().manual_seed(7)
    ref = start_decode(model, inputs["prompt_ids"], inputs["prompt_mask"], params)
    decode_steps(model, ref, params, g_ref)
    reference = finish(ref)

    g = torch.Generator().manual_seed(7)
    running = pool.running()
    state = start_decode(model, params=params, **inputs)
    decode_steps(model, state, params, g, stop=AfterTokens(5))
    assert state.stopped and not state.done
    pool.absorb(running, state, version=0, step=0)
    assert {len(e.tokens) for e in pool.running()} == {5}
    # the update would happen here; the same weights make the continuation checkable
    running = pool.running()
    inputs = pool.decode_inputs(running, PAD, "cpu")
    state = start_decode(model, params=params, **inputs)
    assert state.lengths.tolist() == [5] * len(running)
    decode_steps(model, state, params, g)
    # the caller's prefix lengths are its own: decoding advanced a copy (a scorer preparing
    # the same rows from these inputs, as the stage placement's does, must see 5)
    assert inputs["prefix_lengths"].tolist() == [5] * len(running)
    pool.absorb(running, state, version=1, step=1)

    by_key = {e.key: e for e in pool.entries}
    assert all(e.finished for e in pool.entries)
    for i, p in enumerate(prompts):
        n = int(reference.lengths[i])
        e = by_key[p.id]
        assert e.tokens == reference.response_ids[i, :n].tolist(), p.id
        torch.testing.assert_close(torch.tensor(e.logprobs), reference.logprobs[i, :n],
                                   atol=1e-5, rtol=0)
        # versions: the first 5 tokens by policy 0, the rest by policy 1
        assert e.versions == [0] * min(n, 5) + [1] * max(0, n - 5)


def test_start_decode_rejects_a_prefix_with_nothing_left():
    model = _model("tiny-llama")
    params = SamplingParams(max_new_tokens=4, eos_token_ids=(EOS,), pad_token_id=PAD)
    ids, mask = left_padded_prompts([3, 2], VOCAB, PAD)
    with pytest.raises(ValueError, match="leaves nothing to decode"):
        start_decode(model, ids, mask, params, prefix_ids=torch.full((2, 4), 5),
                     prefix_lengths=torch.tensor([4, 1]))


def _finish_order_pool(max_defer_steps=2):
    """A pool whose entries finished at known places: e0 and e3 in an earlier step, e1 and e4
    at positions 0 and 1 of this step, e2 and e5 unfinished; e5 deferred to the limit."""
    pool = RolloutPool(batch_size=3, max_defer_steps=max_defer_steps)
    pool.top_up(_prompts(), 6)
    e = pool.entries
    for i, at in [(0, (0, 1)), (3, (0, 0)), (1, (1, 0)), (4, (1, 1))]:
        e[i].finished, e[i].finished_at, e[i].tokens = True, at, [5, EOS]
        e[i].logprobs, e[i].versions = [-1.0, -2.0], [0, 1]
    e[5].tokens, e[5].logprobs, e[5].versions = [7], [-0.5], [0]
    return pool


def test_take_first_b_in_finishing_order_and_defer_the_rest():
    pool = _finish_order_pool()
    taken = pool.take()
    # earlier steps' finished entries first, in their order, then this step's
    assert [t.key for t in taken] == ["p3", "p0", "p1"]
    assert [e.key for e in pool.entries] == ["p2", "p4", "p5"]
    assert all(e.deferrals == 1 for e in pool.entries)
    pool.check()  # drawn 6 = trained 3 + in flight 3
    assert sum(pool.ledger.trained.values()) == 3


def test_forced_entries_are_taken_first():
    pool = _finish_order_pool(max_defer_steps=2)
    e5 = pool.entries[5]
    e5.deferrals, e5.finished, e5.finished_at = 2, True, (1, 7)  # forced, finished last
    taken = pool.take()
    assert taken[0].key == "p5" and [t.key for t in taken[1:]] == ["p3", "p0"]


def test_take_refuses_a_short_batch_and_the_ledger_catches_a_loss():
    pool = RolloutPool(batch_size=3, max_defer_steps=2)
    pool.top_up(_prompts(), 6)
    with pytest.raises(RuntimeError, match="fewer than the batch of 3"):
        pool.take()
    pool.entries.pop()  # a sequence lost by a bug
    with pytest.raises(AssertionError, match="p5: drawn 1, trained 0, dropped 0, in flight 0"):
        pool.check()
    ledger = PromptLedger()
    ledger.drawn["a"] += 1
    ledger.trained["a"] += 2  # trained twice
    with pytest.raises(AssertionError, match="a: drawn 1, trained 2"):
        ledger.check([])
    with pytest.raises(ValueError, match="does not reach 8"):
        RolloutPool(3, 2).top_up(_prompts(), 8)


def test_a_step_of_rounds_defers_once_puts_back_and_drops_in_the_ledger():
    """ppo.filter_groups with the pool: takes without deferring, a taken entry put back (a
    rank's surplus: in flight again, first in the pool), one dropped by the rule (the ledger
    counts it), then one deferral of what is left; the ledger balances throughout and
    survives a save."""
    pool = _finish_order_pool()
    first = pool.take(batch=2, defer=False)
    assert [t.key for t in first] == ["p3", "p0"]
    assert all(e.deferrals == 0 for e in pool.entries) and pool.entries[-1].deferrals == 0
    pool.check()
    pool.put_back(first[1:])  # p0: surplus
    assert [e.key for e in pool.entries][:2] == ["p0", "p1"]
    pool.check()
    second = pool.take(batch=1, defer=False)  # p0 again: it finished first
    assert [t.key for t in second] == ["p0"]
    pool.ledger.drop(["p3"])  # its responses all scored the same
    pool.check()
    pool.entries[0].results = {"reward": torch.tensor(1.0), "critic": torch.zeros(2)}
    pool.end_step()
    assert all(e.deferrals == 1 for e in pool.entries[:-1])
    assert pool.entries[0].results.keys() == {"reward"}  # the critic trains: stale
    assert (pool.ledger.trained["p3"], pool.ledger.dropped["p3"], pool.ledger.trained["p0"]) == (0, 1, 1)
    other = RolloutPool(batch_size=3, max_defer_steps=2)
    other.load_state_dict(pool.state_dict())
    other.check()
    assert other.ledger.dropped == pool.ledger.dropped
    pool.ledger.drop(["p3"])  # dropped twice: it was trained -1 times
    with pytest.raises(AssertionError, match="p3: drawn 1, trained -1, dropped 2"):
        pool.check()


def test_pool_state_survives_torch_save(tmp_path):
    pool = _finish_order_pool()
    pool.entries[1].results = {"reward": torch.tensor(0.25)}
    torch.save(pool.state_dict(), tmp_path / "pool.pt")
    other = RolloutPool(batch_size=3, max_defer_steps=2)
    other.load_state_dict(torch.load(tmp_path / "pool.pt", weights_only=False))
    assert other.next_uid == pool.next_uid == 6
    for a, b in zip(pool.entries, other.entries):
        assert (a.uid, a.key, a.prompt, a.tokens, a.logprobs, a.versions, a.finished,
                a.deferrals, a.finished_at) == \
               (b.uid, b.key, b.prompt, b.tokens, b.logprobs, b.versions, b.finished,
                b.deferrals, b.finished_at)
    assert other.entries[1].results["reward"].item() == 0.25
    assert [t.uid for t in other.take()] == [t.uid for t in pool.take()]


def _group_pool(max_defer_steps=2):
    """Batch 4 in groups of 2: 4 prompts, two responses each (rows pK#0, pK#1). Group 3 ended
    in an earlier step; groups 0 and 2 in this one (group 0 last); group 1 only half."""
    pool = RolloutPool(batch_size=4, max_defer_steps=max_defer_steps, group_size=2)
    rows = [SimpleNamespace(id=f"{p.id}#{k}", input_ids=p.input_ids) for p in _prompts(4) for k in (0, 1)]
    pool.top_up(rows, 8)
    e = pool.entries
    for i, at in [(6, (0, 0)), (7, (0, 1)), (0, (1, 0)), (1, (1, 5)), (2, (1, 1)), (4, (1, 2)),
                  (5, (1, 3))]:
        e[i].finished, e[i].finished_at, e[i].tokens = True, at, [5, EOS]
        e[i].logprobs, e[i].versions = [-1.0, -2.0], [0, 0]
    return pool


def test_group_pool_takes_whole_groups_by_their_last_response():
    pool = _group_pool()
    assert [e.group for e in pool.entries] == [0, 0, 2, 2, 4, 4, 6, 6]  # the first member's uid
    taken = pool.take()
    # group 3 (last at (0, 1)), then group 2 (last at (1, 3)); group 0 ended last, at (1, 5),
    # and group 1 is not complete: both wait, whole, for the next step
    assert [t.key for t in taken] == ["p3#0", "p3#1", "p2#0", "p2#1"]
    assert [e.key for e in pool.entries] == ["p0#0", "p0#1", "p1#0", "p1#1"]
    assert all(e.deferrals == 1 for e in pool.entries)
    pool.check()


def test_group_pool_takes_a_forced_group_first_and_refuses_partial_groups():
    pool = _group_pool(max_defer_steps=1)
    for e in pool.entries[:2]:
        e.deferrals = 1  # group 0 is forced
    assert [t.key for t in pool.take()][:2] == ["p0#0", "p0#1"]
    short = _group_pool()
    short.entries[0].finished = short.entries[4].finished = False  # only group 3 complete
    with pytest.raises(RuntimeError, match="1 prompts whose 2 responses all finished"):
        short.take()
    with pytest.raises(ValueError, match="not whole groups of 2"):
        RolloutPool(batch_size=4, max_defer_steps=2, group_size=2).top_up(_prompts(3), 3)
    with pytest.raises(ValueError, match="must divide batch_size"):
        RolloutPool(batch_size=3, max_defer_steps=2, group_size=2)


def test_group_stop_counts_whole_groups():
    """The stop rule of the group pool: B / 2 = 2 groups. Group 3 ended before this
    rollout (it counts from the start); group 0 has both rows running, groups 1 and 2 one."""
    pool = _group_pool()
    for i in (1, 5):  # p0#1 and p2#1 still running
        pool.entries[i].finished, pool.entries[i].finished_at = False, None
    pool.entries[0].finished = False
    running = pool.running()  # p0#0, p0#1, p1#1, p2#1
    assert [e.key for e in running] == ["p0#0", "p0#1", "p1#1", "p2#1"]
    stop = pool.batch_stop(running, sync=False)
    assert (stop.need, stop.already) == (2, 1)

    def state(finished):
        return SimpleNamespace(done=False, finished=torch.tensor(finished),
                               finish_order=[i for i, f in enumerate(finished) if f])

    assert not stop.local(state([True, False, False, False]))  # group 0 half: still 1 group
    assert stop.local(state([False, False, True, False]))      # group 1 now complete
    assert stop.local(state([False, False, False, True]))      # group 2 now complete
    assert stop.local(state([True, True, False, False]))       # group 0 complete
    # a forced row must end whatever the groups
    for e in running[3:]:
        e.deferrals = 2
    assert not pool.batch_stop(running, sync=False).local(state([True, True, False, False]))
    assert pool.batch_stop(running, sync=False).local(state([True, True, False, True]))


def test_group_ids_survive_the_checkpoint(tmp_path):
    pool = _group_pool()
    torch.save(pool.state_dict(), tmp_path / "pool.pt")
    other = RolloutPool(batch_size=4, max_defer_steps=2, group_size=2)
    other.load_state_dict(torch.load(tmp_path / "pool.pt", weights_only=False))
    assert [e.group for e in other.entries] == [e.group for e in pool.entries]
    assert [t.uid for t in other.take()] == [t.uid for t in pool.take()]


def test_generation_and_staleness_of_a_batch():
    pool = _finish_order_pool()
    taken = pool.take()
    gen = entries_to_generation(taken, PAD, "cpu")
    assert gen.response_ids.tolist() == [[5, EOS]] * 3
    assert gen.response_mask.tolist() == [[1.0, 1.0]] * 3
    assert gen.prompt_mask.sum(1).tolist() == [LENS[3], LENS[0], LENS[1]]
    taken[0].deferrals = 1
    m = staleness_metrics(staleness_rows(taken, version=1))
    # 3 rows x 2 tokens, each with one token of policy 0 < 1
    assert m["pool/stale_token_frac"] == pytest.approx(0.5)
    assert m["pool/deferrals"] == [1, 0, 0] and m["pool/deferred_frac"] == pytest.approx(1 / 3)
    assert m["pool/policy_lag_max"] == 1


# ---- lock-step stopping over two real processes ----------------------------------------


def _lockstep_worker(rank, port, out):
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        model = _model("tiny-llama")
        # rank 0 needs 1 finished row and gets it early; rank 1 needs all 4 of its rows
        params = SamplingParams(max_new_tokens=12, eos_token_ids=(EOS,), pad_token_id=PAD,
                                temperature=1.0)
        pool = RolloutPool(batch_size=1 if rank == 0 else 4, max_defer_steps=3)
        pool.top_up(_prompts(4, seed=rank + 1), 4)
        running = pool.running()
        stop = BatchStop(pool.batch_size, 0, [], sync=True)
        ticks_when_local = []

        class Recording:
            def __call__(self, state):
                if stop.local(state) and not ticks_when_local:
                    ticks_when_local.append(stop.calls)
                return stop(state)

        g = torch.Generator().manual_seed(rank)
        state = None
        if not stop(None):
            state = start_decode(model, params=params, **pool.decode_inputs(running, PAD, "cpu"))
            decode_steps(model, state, params, g, stop=Recording())
            stop.wait(state)
        pool.absorb(running, state, version=0, step=0)
        out.put((rank, {"calls": stop.calls, "finished": len(state.finish_order),
                        "first_local": ticks_when_local[0] if ticks_when_local else None,
                        "tokens": int(state.lengths.sum())}))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc()))


def test_ranks_stop_together_and_the_early_rank_keeps_decoding():
    from oppo_ds.engines.deepspeed_engine import find_free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = find_free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_lockstep_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    os.environ.clear()
    os.environ.update(env)
    for r in (0, 1):
        assert isinstance(results[r], dict), results[r]
    r0, r1 = results[0], results[1]
    # one all-reduce per call, and every rank leaves at the same one
    assert r0["calls"] == r1["calls"] > 1
    # rank 1 needed all its rows: it decoded until they ended
    assert r1["finished"] == 4
    # rank 0 had its one row early, and went on decoding (more rows finished, more tokens)
    assert r0["first_local"] is not None and r0["first_local"] < r0["calls"]
    assert r0["finished"] >= 1 and r0["tokens"] > 4


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2", "tiny-gpt2"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_actor_logprobs_after_an_update_equal_the_recomputed_ones(arch, temperature):
    """What the trainer takes as PPO's old log-probs when the actor streams (``oppo.stream_to``
    holds ``actor``): after an update (here: the weights perturbed), a deferred row's carried
    tokens get their log-probs from the prefill that rebuilds its cache, its new tokens as
    they are sampled; together they equal the recomputation they replace (one forward of the
    updated model over prompt + response, ``response_logprobs``) within 1e-5, the tolerance
    of the other streamed scores. The carried tokens' behaviour log-probs stay the old
    weights' (they differ by far more)."""
    from oppo_ds.experience import response_logprobs

    model = random_lm(arch, VOCAB, seed=3)
    params = SamplingParams(max_new_tokens=16, eos_token_ids=(EOS,), pad_token_id=PAD,
                            temperature=temperature)
    pool = RolloutPool(batch_size=2, max_defer_steps=3)
    pool.top_up(_prompts(), len(LENS))
    g = torch.Generator().manual_seed(7)
    running = pool.running()
    state = start_decode(model, params=params, **pool.decode_inputs(running, PAD, "cpu"))
    decode_steps(model, state, params, g, stop=AfterTokens(5))
    pool.absorb(running, state, version=0, step=0)

    noise = torch.Generator().manual_seed(11)
    with torch.no_grad():  # the update
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=noise))
    running = pool.running()
    assert running and {len(e.tokens) for e in running} == {5}
    state = start_decode(model, params=params, **pool.decode_inputs(running, PAD, "cpu"))
    decode_steps(model, state, params, g)
    gen = finish(state)
    recomputed, _ = response_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.response_ids,
                                      gen.response_mask, temperature)
    width, on = gen.response_ids.shape[1], gen.response_mask.bool()
    actor = state.actor_logprobs[:, :width]
    torch.testing.assert_close(actor[on], recomputed[on], atol=1e-5, rtol=0)
    assert (actor[~on] == 0).all()
    # tokens sampled in this decode: behaviour == current; carried ones: the old weights'
    assert torch.equal(state.logprobs[:, 5:width][on[:, 5:]], actor[:, 5:][on[:, 5:]])
    assert (state.logprobs[:, :5] - actor[:, :5]).abs().max() > 1e-2


# ---- the stop rule when decoding in blocks (generation.sync_every > 1) -------------------

ENDS = (EOS, 5, 11, 23, 31)  # rows end all through a 16-token decode


def _pool_rollout(sync_every, group_size, seed=4, stop_sync=False, group=None, batch=None,
                  prompts=None, forced=True):
    """One pool rollout of six rows, batch 2 (or one group of 2 responses), a forced row (a
    forced group), decoded per token (sync_every 1, sampling as on a GPU) or in blocks.
    Returns the state, its stop rule, the taken keys and the generator."""
    params = SamplingParams(max_new_tokens=16, eos_token_ids=ENDS, pad_token_id=PAD,
                            temperature=1.0, sync_every=sync_every)
    pool = RolloutPool(batch_size=batch or 2, max_defer_steps=1, group_size=group_size)
    pool.top_up(prompts or _prompts(), 6)
    for e in pool.entries[4:4 + group_size] if forced else []:
        e.deferrals = 1  # forced: the step does not stop before it ends
    running = pool.running()
    stop = pool.batch_stop(running, sync=stop_sync, group=group, blocks=sync_every > 1)
    g = (torch.Generator() if sync_every > 1 else LikeAGpuGenerator()).manual_seed(seed)
    state = start_decode(_model("tiny-llama"), params=params,
                         **pool.decode_inputs(running, PAD, "cpu"))
    if not stop(None):
        decode_steps(_model("tiny-llama"), state, params, g, stop=stop)
        stop.wait(state)
    pool.absorb(running, state, version=0, step=0)
    return state, stop, [e.key for e in pool.take()], g


def _same_stop(a, b) -> None:
    assert a.stopped == b.stopped
    for name in ("tokens", "lengths", "finished"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.finish_order == b.finish_order
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("group_size", [1, 2])
@pytest.mark.parametrize("sync_every", [3, 8, 64])
def test_the_stop_rule_in_blocks_stops_where_the_per_token_rule_stops(group_size, sync_every):
    """The pool's stop rule (B finished rows or groups, the forced ones among them) settled
    once a block: the block's tokens are kept up to the one at which the per-token rule
    stopped, so the state (tokens, lengths, which rows ended and in which order), the batch taken and
    the generator's state are the per-token loop's."""
    ref, ref_stop, ref_taken, ref_gen = _pool_rollout(1, group_size)
    out, stop, taken, gen = _pool_rollout(sync_every, group_size)
    assert ref.stopped and not ref.done  # the rule, not the end of every row, stopped it
    _same_stop(out, ref)
    assert taken == ref_taken
    assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=ref_gen))
    # the rolled-back rows hold nothing past their lengths
    cols = torch.arange(out.tokens.shape[1])[None, :]
    assert (out.tokens[cols >= out.lengths[:, None]] == PAD).all()


def _block_lockstep_rank(rank, world, out):
    """Rank 0 needs 1 finished row of 6, rank 1 needs 3: decoded per token, then in blocks of
    4 tokens, over the same gloo group."""
    prompts = _prompts(4, seed=rank + 1) + _prompts(2, seed=rank + 7)
    result = {}
    for sync_every in (1, 4):
        state, stop, taken, _ = _pool_rollout(sync_every, 1, seed=rank, stop_sync=True,
                                              batch=1 if rank == 0 else 3, prompts=prompts,
                                              forced=False)
        result[sync_every] = {"tokens": state.tokens.tolist(), "lengths": state.lengths.tolist(),
                              "order": state.finish_order, "calls": stop.calls, "taken": taken,
                              "stopped": state.stopped}
    out.put((rank, result))


def test_ranks_in_blocks_stop_at_the_token_the_per_token_protocol_does():
    """Two gloo ranks needing different numbers of finished rows: in blocks of 4 tokens each
    rank ends with the state the per-token protocol gives it (the rank done early keeps
    decoding until the other is), with one all-reduce a block instead of one a token, the
    same number on both ranks."""
    results = dict(spawn_gloo(_block_lockstep_rank, 2, join_s=120))
    for rank in (0, 1):
        per_token, blocks = results[rank][1], results[rank][4]
        for key in ("tokens", "lengths", "order", "taken"):
            assert blocks[key] == per_token[key], (rank, key)
    assert results[0][1]["calls"] == results[1][1]["calls"]
    assert results[0][4]["calls"] == results[1][4]["calls"]
    assert results[0][4]["calls"] < results[0][1]["calls"] / 2
    # the rule stopped both ranks before every row ended, inside a block (the per-token
    # protocol's calls: the start, then one a token)
    tokens = results[0][1]["calls"] - 1
    assert results[0][4]["stopped"] and results[1][4]["stopped"] and tokens % 4
    # rank 0 had its row before rank 1 had its three, and went on decoding the others
    assert min(results[0][4]["lengths"]) < max(results[0][4]["lengths"]) == tokens


def test_the_pools_tail_waste_is_over_the_ranks():
    """rollout/tail_waste_frac with the pool was rank 0's own; the ranks decode in lock-step,
    so each rank's rows count to the longest row anywhere, as the sequential figure pools
    every rank's lengths: ranks of 4 rows (10 tokens, longest 5) and 2 rows (2 tokens)."""
    from oppo_ds.pool_rollout import _tail_waste

    assert _tail_waste((10.0, 2.0), (4, 2), (5, 1)) == pytest.approx(1 - 12 / (6 * 5))
    assert _tail_waste((10.0,), (4,), (5,)) == pytest.approx(1 - 10 / 20)  # one rank
    assert _tail_waste((0.0, 0.0), (0, 0), (0, 0)) == 0.0  # nothing decoded



def test_overdue_names_the_first_steps_whose_forced_rows_outnumber_their_batches():
    """An entry deferred d times must be trained by step max(1, max_defer_steps - d + 1); the
    pool is overdue when more entries must be trained within k steps than k batches hold
    (what a resume with a smaller batch can leave), and never in a state a run reaches
    (at most Delta <= B rows carried)."""
    from oppo_ds.rollout.pool import PoolEntry

    def pool(batch, bound, deferrals):
        p = RolloutPool(batch_size=batch, max_defer_steps=bound)
        p.entries = [PoolEntry(uid=i, key=f"p{i}", prompt=[1], deferrals=d)
                     for i, d in enumerate(deferrals)]
        return p

    assert pool(8, 2, [1] * 8).overdue() is None  # Delta = B rows, all due in 2 steps
    assert pool(8, 2, [2] * 8).overdue() is None  # B rows forced next step: one batch
    assert pool(2, 2, [1] * 8).overdue() == (2, 8)  # 8 rows within 2 steps of 2
    assert pool(2, 2, [2, 2, 2, 1]).overdue() == (1, 3)  # 3 forced next step, a batch of 2
    assert pool(2, 3, [1] * 5).overdue() is None  # 3 steps of 2 hold them
    assert pool(2, 1, []).overdue() is None
    # the one deadline rule: forced means due in the step under way
    entries = pool(2, 2, [0, 1, 2, 5]).entries
    assert [e.deadline(2) for e in entries] == [3, 2, 1, 1]
    assert [e.forced(2) for e in entries] == [False, False, True, True]
