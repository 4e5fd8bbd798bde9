"""Tier 1/2: data parallel with real processes, launched by DeepSpeed's own launcher
(`deepspeed --num_gpus 2 --module oppo_ds.train`); on a machine without GPUs it starts two
CPU ranks that talk over gloo. Ports are chosen free, never fixed."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from oppo_ds.engines.deepspeed_engine import find_free_port
from oppo_ds.telemetry import read_history

SMALL = ["workload.num_prompts=64", "workload.sft_steps=20", "workload.reward_steps=20",
         "generation.max_new_tokens=24", "ppo.batch_size=4", "ppo.mini_batch_size=4",
         "ppo.micro_batch_size=2", "logging.progress=false", "logging.log_every=0",
         "system.torch_threads=1"]


def launch(out_dir, cache_dir, *overrides, ranks=2, returncode=0):
    launcher = shutil.which("deepspeed", path=os.path.dirname(sys.executable))
    assert launcher, "the deepspeed launcher is installed with deepspeed"
    port = find_free_port()
    cmd = [launcher, "--num_gpus", str(ranks), "--master_port", str(port),
           "--module", "oppo_ds.train", *SMALL, f"workload.cache_dir={cache_dir}",
           f"logging.output_dir={out_dir}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == returncode, proc.stdout[-3000:] + proc.stderr[-3000:]
    # DeepSpeed's CPU all-reduce maps a ~66 MB /dev/shm buffer per rank and never removes it;
    # the ranks remove theirs once every rank has mapped them (init_distributed_if_needed)
    left = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")
    assert not left, f"shared-memory buffers left behind: {left}"
    return proc


@pytest.mark.parametrize("zero_stage", [2])
def test_two_ranks_train_and_resume(tmp_path, zero_stage):
    out, cache = tmp_path / "run", tmp_path / "cache"
    launch(out, cache, "steps=2", f"system.zero_stage={zero_stage}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["steps"] == 2
    assert summary["samples"] == 2 * 2 * 4  # steps x ranks x batch_size
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step2"
    assert sorted(os.listdir(ckpt / "trainer" / "step2")) == ["rank0.pt", "rank1.pt"]

    # each rank drew its own, disjoint shard of the prompts
    import torch

    cursors = [torch.load(ckpt / "trainer" / "step2" / f"rank{r}.pt", weights_only=False)["stream"]
               for r in (0, 1)]
    assert all(c["position"] == 2 * 4 for c in cursors)

    # one rank cannot continue two ranks' pools, prompt shards and random states: refused
    # in one line before any engine loads, the checkpoint left as it was
    proc = launch(out, cache, "steps=3", f"system.zero_stage={zero_stage}", ranks=1, returncode=2)
    assert ("oppo-train: error: checkpoint.resume: checkpoint step2 was written by 2 rank(s), "
            "this run has 1") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (ckpt / "latest").read_text().strip() == "step2"

    # resume with two ranks: continues at step 3, history stays one line per step, and step 3
    # is the one an uninterrupted run makes (both ranks' pools, streams and RNG states
    # restored; the metrics are averaged over the ranks)
    launch(out, cache, "steps=3", f"system.zero_stage={zero_stage}")
    resumed = read_history(str(out / "metrics.jsonl"))
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert (ckpt / "latest").read_text().strip() == "step3"
    whole = tmp_path / "whole"
    launch(whole, cache, "steps=3", f"system.zero_stage={zero_stage}")
    a, b = read_history(str(whole / "metrics.jsonl"))[2], resumed[2]
    assert b["response/lengths"] == a["response/lengths"]
    for key in ("reward/mean", "gold/mean", "kl/mean", "loss/policy", "loss/value",
                "response/len_mean", "policy/clip_frac", "value/mean"):
        assert b[key] == pytest.approx(a[key], abs=1e-6), key


@pytest.mark.parametrize("streaming,sync_every", [(False, 1), (True, 1), (True, 3)],
                         ids=["pool", "pool+streaming", "pool+streaming+blocks+score-tokens"])
def test_two_ranks_zero3_overcommit_decode_in_lock_step(tmp_path, streaming, sync_every):
    """ZeRO-3 with overcommitment on 2 ranks: each rank keeps its own pool and takes its own
    first B; decoding stops for both at the same token (one all-reduce per token: both ranks
    count the same number), and a rank that had its B early kept decoding its deferred
    sequences meanwhile. Every prompt drawn on a rank is trained once or still in its pool.

    With streaming (full OPPO) each rank also has its own rows left to score after the
    rollout (a row that finished in an earlier step has no log-probs of the current actor);
    the actor's and critic's ZeRO-3 forwards are collectives, so every rank makes as many
    scoring calls as the rank with the most (before, step 2 hung: one rank waited in a
    forward, the other in the next all-reduce).

    Decoding in blocks (``generation.sync_every`` 3, chunks of 4: blocks of 3 and 1), the
    stop rule is one all-reduce a block, whose tokens are kept up to where it held on both.
    That run also sizes the scoring forwards by tokens (``ppo.score_batch_tokens``), so the
    ranks' rows left to score are split by their lengths and the counts agreed on."""
    import torch

    from oppo_ds.rollout.pool import RolloutPool

    out, cache = tmp_path / "run", tmp_path / "cache"
    launch(out, cache, "steps=3", "system.zero_stage=3", "oppo.overcommit=3", "checkpoint.every=3",
           "checkpoint.export_hf=false",
           *(["oppo.streaming=true", "oppo.chunk_size=4"] if streaming else []),
           *(["ppo.score_batch_tokens=64"] if sync_every > 1 else []),
           f"generation.sync_every={sync_every}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["samples"] == 3 * 2 * 4
    states = [torch.load(out / "checkpoints" / "trainer" / "step3" / f"rank{r}.pt", weights_only=False)
              for r in (0, 1)]
    keys = []
    for state in states:
        pool = RolloutPool(batch_size=4, max_defer_steps=2)
        pool.load_state_dict(state["pool"])
        pool.check()
        assert sum(pool.ledger.trained.values()) == 3 * 4
        keys.append(set(pool.ledger.drawn))
    assert not keys[0] & keys[1]  # the ranks' prompt shards stay disjoint
    history = read_history(str(out / "metrics.jsonl"))
    assert all(r["pool/sync_calls"] >= 1 for r in history)
    assert all(len(r["pool/deferrals"]) == 2 * 4 for r in history)  # gathered over both ranks
    # (the trainer gathers every rank's count of stop checks each step and fails on a
    # mismatch, so reaching the end means both ranks made the same number)


def test_two_ranks_score_with_a_reward_function(tmp_path):
    """model.reward_function on 2 ranks under ZeRO-3, GRPO's group baseline in the rollout
    pool and the reference streaming: each rank scores its own rows with the function (the
    logged reward, all ranks together, is the gold rule's to the float) and both train every
    step's rows."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    launch(out, cache, "steps=2", "system.zero_stage=3", "checkpoint.export_hf=false",
           "model.reward_function=oppo_ds.workload:gold_reward", "ppo.advantage_estimator=group_norm",
           "data.samples_per_prompt=4", "oppo.overcommit=4", "oppo.streaming=true",
           "oppo.stream_to=[reference]", "oppo.chunk_size=4")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["samples"] == 2 * 2 * 4
    history = read_history(str(out / "metrics.jsonl"))
    # (a step whose rows all finished in the step before decodes nothing, and streams nothing)
    assert len(history) == 2 and any(r.get("stream/scorer_busy_s", 0) > 0 for r in history)
    for r in history:
        assert r["reward/mean"] == pytest.approx(r["gold/mean"], abs=1e-6)
        assert len(r["response/lengths"]) == 2 * 4


def _parity_rule(tmp_path):
    """A reward function file: a prompt's responses all score 0 when it has an even number of
    words (a group with nothing to learn), else their lengths."""
    rule = tmp_path / "rule.py"
    rule.write_text("def parity(prompts, completions, **fields):\n"
                    "    return [0.0 if len(p.split()) % 2 == 0 else float(len(c))"
                    " for p, c in zip(prompts, completions)]\n")
    return rule


def _rank_pools(out, step: int, max_defer_steps: int, group_size: int) -> list:
    """Both ranks' rollout pools from checkpoint ``step``, each ledger checked."""
    import torch

    from oppo_ds.rollout.pool import RolloutPool

    pools = []
    for r in (0, 1):
        state = torch.load(out / "checkpoints" / "trainer" / f"step{step}" / f"rank{r}.pt",
                           weights_only=False)
        pool = RolloutPool(batch_size=4, max_defer_steps=max_defer_steps, group_size=group_size)
        pool.load_state_dict(state["pool"])
        pool.check()
        pools.append(pool)
    return pools


@pytest.mark.parametrize("overcommit", [0, 4], ids=["rounds", "pool"])
def test_two_ranks_filter_groups_in_lock_step(tmp_path, overcommit):
    """ppo.filter_groups on 2 ZeRO-3 ranks whose prompts need different numbers of rounds (a
    prompt's responses all score 0 when it has an even number of words): every rank
    runs the rounds the neediest one asks for, so their collective forwards match (a rank
    running fewer would hang the other), and the prompts drawn on both ranks are each trained
    on, dropped by the rule or a rank's surplus. With the pool a later round is a take from it
    (the stop rule's all-reduces pair up across ranks), a rank's surplus goes back to it, and
    each rank's ledger balances with the drops counted."""
    rule = _parity_rule(tmp_path)
    out, cache = tmp_path / "run", tmp_path / "cache"
    # with the pool, 6 steps: step 5 leaves a rank's surplus in its pool, and in step 6's
    # second round that rank's pool is all finished while the other rank decodes (it joins
    # the other's ZeRO-3 gathers without decoding; before, the ranks' collectives diverged)
    steps = 6 if overcommit else 4
    launch(out, cache, f"steps={steps}", "system.zero_stage=3", "checkpoint.export_hf=false",
           f"model.reward_function={rule}:parity", "ppo.advantage_estimator=group_norm",
           "data.samples_per_prompt=4", "ppo.filter_groups=true", f"oppo.overcommit={overcommit}",
           f"checkpoint.every={steps}")
    history = read_history(str(out / "metrics.jsonl"))
    assert len(history) == steps
    if overcommit:
        pools = _rank_pools(out, steps, max_defer_steps=2, group_size=4)
        assert [sum(p.ledger.trained.values()) for p in pools] == [steps * 4] * 2
        dropped = sum(sum(p.ledger.dropped.values()) for p in pools)
        assert dropped == 4 * sum(r["filter/dropped_groups"] + r["filter/surplus_dropped_groups"]
                                  for r in history)
        assert sum(r["filter/surplus_groups"] for r in history[:5]) > 0
        assert all(r["pool/deferrals_max"] <= 2 for r in history)  # oppo.max_defer_steps
    assert sum(r["filter/dropped_groups"] for r in history) > 0
    for r in history:
        trained = r["samples"] // 4  # prompts, both ranks
        assert trained == 2 and 1 <= r["filter/rounds"] <= 4
        assert r["filter/prompts_drawn"] == trained + r["filter/dropped_groups"] + r["filter/surplus_groups"]
        # each rank draws one prompt in the first round and, in each later round, as many
        # as the neediest rank still lacks (one at most here): one per rank per round, less
        # a surplus group of the step taken again
        assert r["filter/prompts_drawn"] <= 2 * r["filter/rounds"]
    assert any(r["filter/rounds"] > 1 for r in history)


def test_two_ranks_filter_groups_keep_the_deferral_bound(tmp_path):
    """The audit's run: B one prompt, Delta one prompt, oppo.max_defer_steps 1, 2 ZeRO-3
    ranks. A rank that needs no more prompts still takes the neediest rank's number in a
    later round; the surplus it put back came on top of its Delta, more rows were due than a
    step takes, and steps 7 and 8 trained groups deferred twice. A surplus the pool cannot
    carry within the bound is dropped now: every step's deferrals stay at most 1 and both
    ledgers balance with those drops counted."""
    rule = _parity_rule(tmp_path)
    out, cache = tmp_path / "run", tmp_path / "cache"
    launch(out, cache, "steps=8", "system.zero_stage=3", "checkpoint.export_hf=false",
           f"model.reward_function={rule}:parity", "ppo.advantage_estimator=group_norm",
           "data.samples_per_prompt=4", "ppo.filter_groups=true", "oppo.overcommit=4",
           "oppo.max_defer_steps=1", "checkpoint.every=8")
    history = read_history(str(out / "metrics.jsonl"))
    assert all(r["pool/deferrals_max"] <= 1 for r in history)
    assert sum(r["filter/surplus_dropped_groups"] for r in history) > 0  # the case arose
    dropped = sum(sum(p.ledger.dropped.values())
                  for p in _rank_pools(out, 8, max_defer_steps=1, group_size=4))
    assert dropped == 4 * sum(r["filter/dropped_groups"] + r["filter/surplus_dropped_groups"]
                              for r in history)


def test_two_ranks_partitioned_offloaded_reference_gives_the_same_run(tmp_path):
    """system.partition_reference + offload_reference (DeepSpeed-Chat's
    --offload_reference_model) on 2 ZeRO-3 ranks: the reference lives as CPU-held ZeRO-3
    partitions and is gathered layer by layer, and the run's metrics are those of the same
    run with a full reference copy per rank (1e-6: the same numbers are gathered; the KL
    term is computed from the same logits). With system.packing_samples too, every forward
    over whole sequences of the actor, critic and partitioned reference takes packed rows
    (the start's check a collective forward of each on both ranks), and the scoring forwards
    are sized by tokens (ppo.score_batch_tokens=64), so the ranks agree on the partitioned
    reference's calls as on the actor's and critic's: the same run within 1e-4, the rounding
    of other shapes carried through two updates."""
    cache = tmp_path / "cache"
    runs = {}
    partitioned = ["system.partition_reference=true", "system.offload_reference=true"]
    for name, extra in (("full", []), ("partitioned", partitioned),
                        ("packed", partitioned + ["system.packing_samples=true",
                                                  "ppo.score_batch_tokens=64"])):
        out = tmp_path / name
        launch(out, cache, "steps=2", "system.zero_stage=3", "checkpoint.export_hf=false", *extra)
        runs[name] = read_history(str(out / "metrics.jsonl"))
    for name, tolerance in (("partitioned", 1e-6), ("packed", 1e-4)):
        for full, part in zip(runs["full"], runs[name], strict=True):
            assert full["response/lengths"] == part["response/lengths"]
            for key in ("kl/mean", "reward/mean", "loss/policy", "loss/value"):
                assert abs(full[key] - part[key]) <= tolerance * max(1.0, abs(full[key])), \
                    (name, key, full, part)


def test_two_zero3_ranks_agree_on_micro_batches_sized_by_tokens(tmp_path):
    """ppo.micro_batch_tokens=64 on 2 ZeRO-3 ranks: each rank splits its mini-batch of 4 by
    its own response lengths, the two make as many micro-batches as the one that needs more
    (ZeRO-3 gathers and reduce-scatters in every forward and backward: a rank with fewer would
    wait in the other's collective), and the run is the one in micro-batches of 2 (1e-5,
    summation order), with another count of micro-batches per update. The scoring forwards
    are sized by tokens too (ppo.score_batch_tokens=64), the ranks agreeing on their calls."""
    cache = tmp_path / "cache"
    runs = {}
    for name, extra in (("micro2", []), ("tokens", ["ppo.micro_batch_tokens=64",
                                                    "ppo.score_batch_tokens=64"])):
        out = tmp_path / name
        launch(out, cache, "steps=2", "system.zero_stage=3", "checkpoint.export_hf=false", *extra)
        runs[name] = read_history(str(out / "metrics.jsonl"))
    assert [r["train/micro_batches"] for r in runs["micro2"]] == [2, 2]
    assert any(r["train/micro_batches"] != 2 for r in runs["tokens"]), runs["tokens"]
    # the ranks' own splits differed (their mean below the count they agreed on): the
    # agreement was needed
    assert any(r["train/micro_batches_needed"] < r["train/micro_batches"]
               for r in runs["tokens"]), runs["tokens"]
    assert "train/micro_batches_needed" not in runs["micro2"][0]
    for fixed, tokens in zip(runs["micro2"], runs["tokens"], strict=True):
        assert fixed["response/lengths"] == tokens["response/lengths"]
        for key in ("kl/mean", "reward/mean", "loss/policy", "loss/value", "grad_norm/actor",
                    "grad_norm/critic"):
            assert tokens[key] == pytest.approx(fixed[key], abs=1e-5), (key, fixed, tokens)
