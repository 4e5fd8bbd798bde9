"""Tier 1/2: the ``stage`` placement in the trainer (``oppo.placement: stage``).

The main test launches a real run with DeepSpeed's own launcher on CPU, 2 processes: rank 0
is the actor rank (DeepSpeed engines in a torch.distributed world of the actor ranks alone),
rank 1 the scorer stage (reward and reference models, and a copy of the critic that takes the
actor rank's weights after every update), in no world, linked to the actor rank by a two-rank
group of their own. It must give the metrics of an in-process single-rank run with the
``inline`` placement and the same seed: the same sampled responses (sampling does not depend
on where scoring runs) and the same scores. Step 1 is compared at 1e-5 and later steps at
1e-4, the tolerances of ``test_streaming_gives_the_sequential_run``: the scores are the same
computation in another process (bit-identical in ``test_stage.py``), and later steps carry
float-rounding differences through Adam updates. The run checkpoints
every step and is resumed (the actor ranks' barriers never wait for the scorer process).
Other launches put two actor ranks on one scorer rank (3 processes) against a 2-rank inline
run, with overcommitment, and with ZeRO-3 under the hybrid engine, whose collectives run over
the actor ranks' world. Ports are chosen free, never fixed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from oppo_ds.config import ConfigError, load_config
from oppo_ds.engines.deepspeed_engine import find_free_port
from oppo_ds.telemetry import read_history

SMALL = ["workload.num_prompts=64", "workload.sft_steps=20", "workload.reward_steps=20",
         "generation.max_new_tokens=24", "ppo.batch_size=4", "ppo.mini_batch_size=4",
         "ppo.micro_batch_size=2", "logging.progress=false", "logging.log_every=0",
         "logging.tensorboard=false", "system.torch_threads=1", "oppo.streaming=true",
         "oppo.chunk_size=3"]
DETERMINISTIC = ("reward/mean", "gold/mean", "kl/mean", "loss/policy", "loss/value",
                 "response/len_mean", "policy/clip_frac", "value/mean")


def run_in_process(cache_dir, out_dir, *overrides):
    from oppo_ds.trainer import PPOTrainer

    threads = torch.get_num_threads()
    try:
        cfg = load_config(None, SMALL + [f"workload.cache_dir={cache_dir}",
                                         f"logging.output_dir={out_dir}", *overrides])
        return PPOTrainer(cfg).train()
    finally:
        torch.set_num_threads(threads)  # system.torch_threads=1 is process-wide


def launch(out_dir, cache_dir, *overrides, ranks=2, placement="stage"):
    launcher = shutil.which("deepspeed", path=os.path.dirname(sys.executable))
    assert launcher, "the deepspeed launcher is installed with deepspeed"
    cmd = [launcher, "--num_gpus", str(ranks), "--master_port", str(find_free_port()),
           "--module", "oppo_ds.train", *SMALL, f"oppo.placement={placement}",
           f"workload.cache_dir={cache_dir}", f"logging.output_dir={out_dir}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _by_step(path):
    return {r["step"]: r for r in read_history(str(path))}


def inline_and_stage(cache_dir, tmp_path, *overrides):
    """The same run in process with the inline placement and launched on the stage (an actor
    rank and a scorer rank): (the launch's process, each run's metrics by step)."""
    run_in_process(cache_dir, tmp_path / "inline", *overrides)
    proc = launch(tmp_path / "stage", cache_dir, *overrides)
    return proc, _by_step(tmp_path / "inline" / "metrics.jsonl"), _by_step(tmp_path / "stage" / "metrics.jsonl")


def test_stage_critic_free_with_the_group_pool_gives_the_inline_run(cache_dir, tmp_path):
    """GRPO's estimator with the group pool under the stage placement: no critic copy goes
    to the scorer rank, and the run repeats the inline one (1e-4, as below)."""
    grpo = ("steps=3", "checkpoint.export_hf=false", "ppo.advantage_estimator=group_norm",
            "data.samples_per_prompt=2", "oppo.overcommit=2")
    proc, a, b = inline_and_stage(cache_dir, tmp_path, *grpo)
    assert "scores (reward, reference)" in proc.stdout + proc.stderr
    assert "critic's weights" not in proc.stdout + proc.stderr
    for step in (1, 2, 3):
        assert b[step]["response/lengths"] == a[step]["response/lengths"], step
        assert b[step]["pool/deferrals"] == a[step]["pool/deferrals"], step
        for key in ("reward/mean", "gold/mean", "kl/mean", "loss/policy", "policy/clip_frac"):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-4), (step, key)
        assert "value/mean" not in b[step] and "stream/critic_weights_s" not in b[step]


def test_stage_with_the_kl_off_holds_no_reference_and_gives_the_inline_run(cache_dir, tmp_path):
    """ppo.kl_coef=0 under the stage placement: the scorer rank builds and streams the reward
    model and the critic only, and the run repeats the inline one (1e-4, as above)."""
    no_kl = ("steps=2", "checkpoint.export_hf=false", "ppo.kl_coef=0", "oppo.overcommit=2")
    proc, a, b = inline_and_stage(cache_dir, tmp_path, *no_kl)
    assert "scores (reward, critic)" in proc.stdout + proc.stderr
    for step in (1, 2):
        assert b[step]["response/lengths"] == a[step]["response/lengths"], step
        for key in ("reward/mean", "gold/mean", "loss/policy", "loss/value"):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-4), (step, key)
        assert "kl/mean" not in b[step]


def test_stage_in_bf16_gives_the_inline_runs_values(cache_dir, tmp_path):
    """system.dtype=bf16: the scorer rank's copy of the critic holds its buffers as the actor
    rank's DeepSpeed critic does (DeepSpeed casts parameters only: the rotary ``inv_freq``
    stays fp32), so its streamed values are the inline run's; cast to bf16 with the
    parameters, that buffer moved them by up to 4e-3. The reward and reference models are
    held alike under both placements."""
    proc, a, b = inline_and_stage(cache_dir, tmp_path, "steps=1", "checkpoint.export_hf=false",
                                  "system.dtype=bf16")
    assert b[1]["response/lengths"] == a[1]["response/lengths"]
    for key in ("reward/mean", "kl/mean", "value/mean", "loss/value"):
        assert b[1][key] == pytest.approx(a[1][key], abs=1e-6), key


def test_stage_run_gives_the_inline_run_and_resumes(cache_dir, tmp_path):
    run_in_process(cache_dir, tmp_path / "inline", "steps=3", "checkpoint.export_hf=false")
    out = tmp_path / "stage"
    # steps 1-2 with a checkpoint after each, then a second launch resumes for step 3
    launch(out, cache_dir, "steps=2", "checkpoint.every=1", "checkpoint.export_hf=false")
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step2"
    # only the actor rank has trainer state; the scorer rank has nothing to save
    assert sorted(os.listdir(ckpt / "trainer" / "step2")) == ["rank0.pt"]
    proc = launch(out, cache_dir, "steps=3")
    assert "resumed from step2 at step 2" in proc.stdout + proc.stderr
    assert "scores (reward, reference, critic)" in proc.stdout + proc.stderr
    assert "the critic's weights go to it from rank 0 after every update" in \
        proc.stdout + proc.stderr
    assert (ckpt / "latest").read_text().strip() == "step3"
    assert (out / "actor" / "model.safetensors").is_file()  # exported at the end
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 3  # the actor ranks only
    assert summary["samples"] == 3 * 4

    a, b = _by_step(tmp_path / "inline" / "metrics.jsonl"), _by_step(out / "metrics.jsonl")
    assert sorted(b) == [1, 2, 3]
    assert b[1]["response/lengths"] == a[1]["response/lengths"]
    for key in ("reward/mean", "kl/mean", "value/mean"):
        assert b[1][key] == pytest.approx(a[1][key], abs=1e-5), key
    for step in (2, 3):
        assert b[step]["response/lengths"] == a[step]["response/lengths"], step
        for key in DETERMINISTIC:
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-4), (step, key)
    for step in (1, 2, 3):
        assert 0.0 <= b[step]["stream/scoring_hidden_frac"] <= 1.0
        assert b[step]["stream/scorer_busy_s"] > 0
        assert b[step]["stream/chunks"] == a[step]["stream/chunks"]
        assert b[step]["stream/critic_weights_s"] > 0  # sent before every step (first: the initial)


def test_two_actor_ranks_share_one_scorer_rank(cache_dir, tmp_path):
    """3 processes: actor ranks 0 and 1, data parallel over their world, both served by
    scorer rank 2 (at once). Same metrics as a 2-rank inline run: the same prompt shards,
    responses, scores and all-reduced updates (tolerances as above). An evaluation of 9
    prompts after the last step: the shares, 5 and 4, take 2 batches and 1; the second rank
    sends the stage an empty rollout for the batch it lacks, and the answers are the inline
    run's, and those of ``--evaluate`` on the run's checkpoint after it."""
    evaluation = ("eval.prompts=builtin", "eval.num_prompts=9", "eval.at_start=false")
    launch(tmp_path / "inline", cache_dir, "steps=2", "checkpoint.export_hf=false", *evaluation,
           placement="inline")
    proc = launch(tmp_path / "stage", cache_dir, "steps=2", "checkpoint.export_hf=false",
                  *evaluation, ranks=3)
    assert "rank 2 scores (reward, reference, critic) for actor ranks [0, 1]; the critic's " \
        "weights go to it from rank 0" in proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "stage" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["samples"] == 2 * 2 * 4
    trainer_state = tmp_path / "stage" / "checkpoints" / "trainer" / "step2"
    assert sorted(os.listdir(trainer_state)) == ["rank0.pt", "rank1.pt"]
    a = _by_step(tmp_path / "inline" / "metrics.jsonl")
    b = _by_step(tmp_path / "stage" / "metrics.jsonl")
    for step, tol in ((1, 1e-5), (2, 1e-4)):
        assert len(b[step]["response/lengths"]) == 2 * 4  # gathered over both actor ranks
        assert b[step]["response/lengths"] == a[step]["response/lengths"], step
        for key in ("reward/mean", "kl/mean", "value/mean") if step == 1 else DETERMINISTIC:
            assert b[step][key] == pytest.approx(a[step][key], abs=tol), (step, key)
    inline, stage = ([json.loads(line) for line in (tmp_path / run / "eval_samples.jsonl").open()]
                     for run in ("inline", "stage"))
    assert len(stage) == 9 and len({r["prompt_id"] for r in stage}) == 9
    for x, y in zip(inline, stage):
        assert (y["prompt_id"], y["response"]) == (x["prompt_id"], x["response"])
        assert y["reward"] == pytest.approx(x["reward"], abs=1e-4)

    # oppo-train --evaluate on the same three processes: the step-2 checkpoint answers as the
    # run's own last evaluation did (the scorer rank serves it and stops when it ends), from
    # the actor's weights alone: the critic is not read
    shutil.rmtree(tmp_path / "stage" / "checkpoints" / "critic")
    proc = launch(tmp_path / "stage", cache_dir, "--evaluate", "steps=2", *evaluation, ranks=3)
    # and the scorer rank holds the reward model alone: no reference or critic copy, no
    # critic weights sent (the figures are the reward model's scores)
    log = proc.stdout + proc.stderr
    assert "rank 2 scores (reward) for actor ranks [0, 1]" in log, log[-3000:]
    assert "critic's weights go to it" not in log
    again = [json.loads(line) for line in
             (tmp_path / "stage" / "evaluations" / "step_2_samples.jsonl").open()]
    assert [(r["prompt_id"], r["response"]) for r in again] == \
        [(r["prompt_id"], r["response"]) for r in stage]
    assert [r["reward"] for r in again] == pytest.approx([r["reward"] for r in stage], abs=1e-5)
    assert sorted(os.listdir(tmp_path / "stage" / "checkpoints" / "trainer")) == ["step2"]


def test_stage_with_dynamic_sampling_serves_every_round_and_gives_the_inline_run(cache_dir, tmp_path):
    """ppo.filter_groups under the stage placement (no pool), with OpenRLHF's reward-range
    rule on the reward model's scores: each later round is one more rollout the scorer rank
    serves (it serves as many as the steps' rounds add up to), and the run repeats the inline
    one: the same rounds, drops and fallbacks, the same metrics (1e-4, as above)."""
    dapo = ("steps=3", "checkpoint.export_hf=false", "ppo.advantage_estimator=group_norm",
            "data.samples_per_prompt=2", "ppo.filter_groups=true",
            "ppo.filter_groups_reward_range=[0.5,1e9]")
    proc, a, b = inline_and_stage(cache_dir, tmp_path, *dapo)
    for step in (1, 2, 3):
        for key in ("filter/rounds", "filter/dropped_groups", "filter/fallback_groups",
                    "filter/prompts_drawn", "response/lengths"):
            assert b[step][key] == a[step][key], (step, key)
        for key in ("reward/mean", "gold/mean", "kl/mean", "loss/policy", "policy/clip_frac"):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-4), (step, key)
    rounds = sum(b[step]["filter/rounds"] for step in (1, 2, 3))
    assert rounds > 3 and sum(b[step]["filter/dropped_groups"] for step in (1, 2, 3)) > 0
    assert f"served {rounds} rollouts" in proc.stdout + proc.stderr


def test_stage_config_errors():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["oppo.placement=stage"])
    assert err.value.key == "oppo.placement"
    assert "stage needs streaming: true" in str(err.value)
    load_config(None, ["oppo.placement=stage", "oppo.streaming=true"])  # the valid forms
    load_config(None, ["oppo.placement=stage", "oppo.streaming=true", "oppo.overcommit=auto"])


POOL = ["oppo.overcommit=2", "oppo.max_defer_steps=2", "oppo.chunk_size=3"]
POOL_KEYS = ("pool/carried", "pool/deferred_frac", "pool/stale_token_frac", "pool/decoded_tokens")


def test_stage_with_overcommitment_gives_the_inline_pool_run_and_resumes(cache_dir, tmp_path):
    """Full OPPO on the stage placement: the rollout pool's rows, deferred ones with their
    responses so far, stream to the scorer rank, which re-prefills what it does not hold.
    Against the same pool run inline in one process: the same rows finish and are taken, the
    same metrics (1e-4); a checkpoint mid-run resumes with the pool on the actor rank and
    nothing on the scorer rank, and the prompt ledger shows every prompt trained once."""
    run_in_process(cache_dir, tmp_path / "inline", "steps=4", "checkpoint.export_hf=false",
                   "oppo.streaming=true", *POOL)
    out = tmp_path / "stage"
    launch(out, cache_dir, "steps=2", "checkpoint.every=1", "checkpoint.export_hf=false", *POOL)
    assert sorted(os.listdir(out / "checkpoints" / "trainer" / "step2")) == ["rank0.pt"]
    proc = launch(out, cache_dir, "steps=4", "checkpoint.export_hf=false", *POOL)
    assert "resumed from step2 at step 2" in proc.stdout + proc.stderr
    a, b = _by_step(tmp_path / "inline" / "metrics.jsonl"), _by_step(out / "metrics.jsonl")
    assert sorted(b) == [1, 2, 3, 4]
    assert any(b[step]["pool/carried"] > 0 for step in b)  # rows were deferred and continued
    for step in (1, 2, 3, 4):
        assert b[step]["response/lengths"] == a[step]["response/lengths"], step
        for key in DETERMINISTIC + POOL_KEYS:
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-4), (step, key)
        assert 0.0 <= b[step]["stream/scoring_hidden_frac"] <= 1.0
    state = torch.load(out / "checkpoints" / "trainer" / "step4" / "rank0.pt", weights_only=False)
    trained = state["pool"]["ledger"]["trained"]
    assert sum(trained.values()) == 4 * 4 and set(trained.values()) == {1}


@pytest.mark.parametrize("static", [False, True], ids=["", "static-cache"])
def test_stage_with_overcommitment_decoding_in_blocks_gives_the_inline_run(cache_dir, tmp_path,
                                                                           static):
    """``generation.sync_every`` 4 over chunks of 3 (blocks of 3): the actor rank's stop rule
    is settled once a block and the block kept up to its stop token; the scorer rank
    receives only what was kept: the same rows finish and are taken as in the inline pool
    run decoding in blocks, the same metrics (1e-4). With ``generation.static_cache`` on the
    actor rank only: the same again (the decode at one shape samples what the default one
    does)."""
    common = ("steps=3", "checkpoint.export_hf=false", "generation.sync_every=4", *POOL)
    run_in_process(cache_dir, tmp_path / "inline", "oppo.streaming=true", *common)
    launch(tmp_path / "stage", cache_dir, *common, *["generation.static_cache=true"] * static)
    a = _by_step(tmp_path / "inline" / "metrics.jsonl")
    b = _by_step(tmp_path / "stage" / "metrics.jsonl")
    assert any(b[step]["pool/carried"] > 0 for step in b)
    for step in (1, 2, 3):
        assert b[step]["response/lengths"] == a[step]["response/lengths"], step
        for key in DETERMINISTIC + POOL_KEYS:
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-4), (step, key)


def test_placement_changed_on_resume_keeps_every_deferred_row(cache_dir, tmp_path):
    """A pool checkpoint written inline holds the frozen scorers' caches of its deferred rows;
    resumed on the stage, the scorer rank has none of them and prefills those rows afresh (the
    caches are not loaded on the actor rank, which has no reward model: this crashed before),
    and a stage checkpoint, which holds no caches, resumes inline. Every prompt is trained
    exactly once or still waits in the pool."""
    from _builders import assert_trained_once

    out = tmp_path / "run"
    common = ("checkpoint.every=1", "checkpoint.export_hf=false", *POOL)
    run_in_process(cache_dir, out, "steps=2", *common)
    state = torch.load(out / "checkpoints" / "trainer" / "step2" / "rank0.pt", weights_only=False)
    assert state["pool"]["entries"] and state["scorers"]
    proc = launch(out, cache_dir, "steps=3", *common)
    assert "resumed from step2 at step 2" in proc.stdout + proc.stderr
    run_in_process(cache_dir, out, "steps=4", *common)
    assert sorted(_by_step(out / "metrics.jsonl")) == [1, 2, 3, 4]
    assert_trained_once(out / "checkpoints" / "trainer" / "step4" / "rank0.pt", 4, 4)


def test_stage_scores_the_finished_rows_a_resumed_pool_never_streamed(cache_dir, tmp_path):
    """A pool checkpoint written with streaming off holds finished rows, not taken yet, with
    no reward or reference scores; under the stage the actor rank holds neither model (the
    resumed step crashed calling the absent reference). At the resume the scorer rank scores
    them, one rollout more (those rows with their whole responses, ended at once), and the
    resumed step gives the inline resume's figures."""
    common = ("checkpoint.every=1", "checkpoint.export_hf=false", *POOL)
    out = tmp_path / "stage"
    run_in_process(cache_dir, out, "steps=2", "oppo.streaming=false", *common)
    state = torch.load(out / "checkpoints" / "trainer" / "step2" / "rank0.pt", weights_only=False)
    assert any(e["finished"] and "reward" not in e["results"] for e in state["pool"]["entries"])
    shutil.copytree(out, tmp_path / "inline")
    run_in_process(cache_dir, tmp_path / "inline", "steps=3", *common)
    proc = launch(out, cache_dir, "steps=3", *common)
    logs = proc.stdout + proc.stderr
    assert "had no reward / reference scores" in logs and "served 2 rollouts" in logs
    a, b = _by_step(tmp_path / "inline" / "metrics.jsonl"), _by_step(out / "metrics.jsonl")
    assert b[3]["response/lengths"] == a[3]["response/lengths"]
    for key in DETERMINISTIC + POOL_KEYS:
        assert b[3][key] == pytest.approx(a[3][key], abs=1e-5), key


def _run_ranks(args, ranks=2, timeout=300):
    """Each rank's (exit code, output) of a run started without a launcher, so that one
    failing process does not end the others: what each says on its own is seen."""
    from _builders import rank_process

    port = find_free_port()
    procs = [rank_process(rank, ranks, port, args) for rank in range(ranks)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, log) for p, log in zip(procs, logs)]


def test_an_actor_rank_ending_before_its_link_opened_stops_the_scorer_rank(cache_dir, tmp_path):
    """A bad model path stops the actor rank (exit 2) before it opens its link to the scorer
    rank, which waited 30 minutes for that link before; now the actor rank says so in the
    store at its exit and the scorer rank stops at once, naming it."""
    (actor_rc, actor_log), (scorer_rc, scorer_log) = _run_ranks(
        [*SMALL, f"workload.cache_dir={cache_dir}", f"logging.output_dir={tmp_path / 'run'}",
         "steps=1", "oppo.placement=stage", "model.reward=/nonexistent/dir"], timeout=120)
    assert actor_rc == 2 and "model.reward" in actor_log, actor_log[-2000:]
    assert scorer_rc == 1, scorer_log[-2000:]
    assert "oppo-train: error: actor rank 0 ended before its link to the scorer rank (rank 1) " \
        "opened" in scorer_log, scorer_log[-2000:]
    assert "Traceback" not in scorer_log, scorer_log[-2000:]  # the actor rank's log holds its own


def test_the_scorer_rank_failing_after_its_links_opened_is_named_by_the_actor_rank(cache_dir,
                                                                                    tmp_path):
    """The scorer rank alone loads the reward model, after its links opened. Before, a
    checkpoint it could not load stopped it with its traceback, and the actor rank with
    gloo's "Connection closed by peer" at its first message. Now the scorer rank says in the
    store what it failed on, and the actor rank's error names it. The reward checkpoint here
    is whole and its config.json names a known architecture (every rank's checks pass), but
    of another size than its weights: only loading them tells."""
    from oppo_ds.sources import resolve_sources

    base = [*SMALL, f"workload.cache_dir={cache_dir}", "steps=1", "oppo.placement=stage"]
    good = resolve_sources(load_config(None, base), rank=0).reward  # prepares the workload
    bad = tmp_path / "reward"
    shutil.copytree(good, bad)
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] *= 2
    (bad / "config.json").write_text(json.dumps(config))
    (actor_rc, actor_log), (scorer_rc, scorer_log) = _run_ranks(
        [*base, f"logging.output_dir={tmp_path / 'run'}", f"model.reward={bad}",
         f"model.critic={good}"])
    failure = f"ValueError: {bad}: weights of the checkpoint have other shapes"
    assert scorer_rc != 0 and failure in scorer_log, scorer_log[-3000:]
    assert actor_rc == 1, actor_log[-3000:]
    line = next((x for x in actor_log.splitlines() if x.startswith("oppo-train: error: ")), "")
    assert line.startswith("oppo-train: error: the scorer rank (rank 1, "), actor_log[-3000:]
    assert f"failed on {failure}" in line and line.endswith("; actor rank 0 stops too"), line
    assert "Traceback" not in actor_log, actor_log[-3000:]  # the scorer rank's log has it


def test_an_actor_rank_failing_after_its_link_opened_is_named_by_the_scorer_rank(cache_dir,
                                                                                  tmp_path):
    """The reverse: the actor rank's reward function fails at step 1. The scorer rank, then
    left with a closed link, says that actor rank 0 failed: with its error when actor rank
    0's store still answers, else that the store's host ended (its own report went with
    it); it no longer ends on gloo's bare error."""
    rule = tmp_path / "rule.py"
    rule.write_text("def score(prompts, completions, **fields):\n"
                    "    raise ValueError('no score for these rows')\n")
    results = _run_ranks([*SMALL, f"workload.cache_dir={cache_dir}", "steps=2",
                          f"logging.output_dir={tmp_path / 'run'}", "oppo.placement=stage",
                          f"model.reward_function={rule}:score"])
    (actor_rc, actor_log), (scorer_rc, scorer_log) = results
    assert actor_rc == 1 and "no score for these rows" in actor_log, actor_log[-3000:]
    assert scorer_rc == 1, scorer_log[-3000:]
    line = next((x for x in scorer_log.splitlines() if x.startswith("oppo-train: error: ")), "")
    assert line.startswith("oppo-train: error: actor rank 0"), scorer_log[-3000:]
    assert line.endswith("; the scorer rank stops too"), line


@pytest.mark.parametrize("signalled", [[1], [0, 1]], ids=["scorer-rank", "every-rank"])
def test_a_signal_to_the_scorer_rank_stops_the_run_with_a_checkpoint(cache_dir, tmp_path, signalled):
    """srun passes the job's USR1 to every task, the scorer rank included, which had no
    handler: it died of the signal (exit -10), so the job exited neither 75 nor with the
    scorer's work, and a signal that reached only the scorer rank was lost. Now the scorer
    rank records it, keeps serving, and sends it with its next reply; the actor ranks stop
    after that step with a checkpoint and tell the scorer rank when they shut it down:
    every process exits 75, and the same command resumes."""
    from _builders import rank_process, signal_after_steps
    from oppo_ds.preemption import PREEMPTED_EXIT

    out, port = tmp_path / "run", find_free_port()
    args = ["checkpoint.export_hf=false", "oppo.placement=stage", *POOL]
    procs = [rank_process(rank, 2, port, [*SMALL, f"workload.cache_dir={cache_dir}",
                                          f"logging.output_dir={out}", *args, "steps=400"])
             for rank in (0, 1)]
    metrics = out / "metrics.jsonl"
    logs = signal_after_steps(procs, metrics, 3, signalled)
    assert [p.returncode for p in procs] == [PREEMPTED_EXIT] * 2, logs[0][-2000:] + logs[1][-2000:]
    done = len(metrics.read_text().splitlines())
    assert 3 <= done < 400
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step{done}"
    if signalled == [1]:
        assert "SIGUSR1 received by the scorer rank (1)" in logs[0]
    proc = launch(out, cache_dir, *args, f"steps={done + 1}")
    assert f"resumed from step{done} at step {done}" in proc.stdout + proc.stderr
    assert sorted(_by_step(metrics)) == list(range(1, done + 2))


# sampled, as training samples: the same draws under both placements
EVAL = ("eval.prompts=builtin", "eval.num_prompts=5", "eval.every=1")


def test_two_actor_ranks_with_overcommitment_share_one_scorer_rank(cache_dir, tmp_path):
    """The pool's lock-step stop (one all-reduce per token) among the actor ranks only: the
    scorer process is in no world. Same metrics as 2 ranks inline.

    With a held-out evaluation before the first step and after every step: the answers stream
    to the scorer rank and are the inline run's, with its rewards (1e-5 before training, 1e-4
    after, as training's figures). The shares of 5 prompts, 3 and 2, take one batch each: the
    scorer rank serves both ranks one rollout each, with nothing added (the second rank
    answered its first prompt again before, which changed its sampled answers). The
    evaluation's rollouts make the stage drop the pool's carried rows, which the next step
    sends again: training's figures stay the inline run's."""
    launch(tmp_path / "inline", cache_dir, "steps=3", "checkpoint.export_hf=false", *POOL,
           *EVAL, placement="inline")
    launch(tmp_path / "stage", cache_dir, "steps=3", "checkpoint.export_hf=false", *POOL,
           *EVAL, ranks=3)
    a = _by_step(tmp_path / "inline" / "metrics.jsonl")
    b = _by_step(tmp_path / "stage" / "metrics.jsonl")
    for step in (1, 2, 3):
        assert b[step]["response/lengths"] == a[step]["response/lengths"], step
        assert b[step]["pool/sync_calls"] == a[step]["pool/sync_calls"] > 0
        for key in DETERMINISTIC + POOL_KEYS:
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-4), (step, key)
    assert any(b[step]["pool/carried"] > 0 for step in (2, 3))  # rows the evaluations dropped

    def answers(run):
        return [json.loads(line) for line in (tmp_path / run / "eval_samples.jsonl").open()]
    inline, stage = answers("inline"), answers("stage")
    assert [r["step"] for r in stage] == [s for s in range(4) for _ in range(5)]
    assert len({r["prompt_id"] for r in stage}) == 5
    for x, y in zip(inline, stage):
        assert (y["step"], y["prompt_id"], y["response"]) == (x["step"], x["prompt_id"], x["response"])
        assert y["reward"] == pytest.approx(x["reward"], abs=1e-5 if x["step"] == 0 else 1e-4)


def test_two_actor_ranks_with_dynamic_sampling_in_the_pool_give_the_inline_run(cache_dir, tmp_path):
    """ppo.filter_groups with the rollout pool on 2 actor ranks and a scorer rank: in step 2
    one rank's pool holds only finished rows (its surplus of step 1) while the other decodes;
    it sends the stage an empty rollout (the stage serves one rollout of each rank a round),
    and the run goes on as 2 ranks inline: the same rounds, drops, idle ranks and metrics
    (1e-4, as above)."""
    dapo = ("steps=3", "checkpoint.export_hf=false", "ppo.advantage_estimator=group_norm",
            "data.samples_per_prompt=2", "ppo.filter_groups=true", "oppo.overcommit=2",
            "ppo.filter_groups_reward_range=[0.9,1e9]")
    launch(tmp_path / "inline", cache_dir, *dapo, placement="inline")
    launch(tmp_path / "stage", cache_dir, *dapo, ranks=3)
    a = _by_step(tmp_path / "inline" / "metrics.jsonl")
    b = _by_step(tmp_path / "stage" / "metrics.jsonl")
    for step in (1, 2, 3):
        for key in ("filter/rounds", "filter/dropped_groups", "filter/surplus_groups",
                    "filter/fallback_groups", "pool/idle_ranks", "filter/idle_ranks",
                    "response/lengths"):
            assert b[step][key] == a[step][key], (step, key)
        for key in ("reward/mean", "gold/mean", "kl/mean", "loss/policy") + POOL_KEYS:
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-4), (step, key)
    assert sum(b[s]["pool/idle_ranks"] + b[s]["filter/idle_ranks"] for s in (1, 2, 3)) > 0


def test_stage_with_a_reward_function_scores_the_rest_and_gives_the_inline_run(cache_dir, tmp_path):
    """model.reward_function under the stage placement, with the rollout pool and a held-out
    evaluation: the scorer rank builds no reward model and streams the reference and the
    critic; the actor ranks score finished text with the function (the evaluation's answers
    too, without the stage). The run repeats the inline one (1e-4, as above), its reward the
    gold rule's."""
    rule = ("steps=2", "checkpoint.export_hf=false", "oppo.overcommit=2",
            "model.reward_function=oppo_ds.workload:gold_reward", *EVAL)
    proc, a, b = inline_and_stage(cache_dir, tmp_path, *rule)
    assert "scores (reference, critic)" in proc.stdout + proc.stderr
    for step in (1, 2):
        assert b[step]["response/lengths"] == a[step]["response/lengths"], step
        assert b[step]["reward/mean"] == pytest.approx(b[step]["gold/mean"], abs=1e-6)
        for key in DETERMINISTIC + POOL_KEYS:
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-4), (step, key)
    inline, stage = (read_history(str(tmp_path / run / "eval.jsonl")) for run in ("inline", "stage"))
    assert [r["step"] for r in stage] == [0, 1, 2]
    for x, y in zip(inline, stage):
        assert y["eval/reward_mean"] == pytest.approx(x["eval/reward_mean"], abs=1e-4)


ZERO3_HYBRID = ["system.zero_stage=3", "system.hybrid_engine=true"]


def test_stage_with_zero3_and_the_hybrid_engine_gives_the_inline_run(cache_dir, tmp_path):
    """DeepSpeed-Chat's large-model setup, ZeRO-3 under the hybrid engine (CPU: its no-kernel
    path), with full OPPO on the stage placement: 2 actor ranks and the scorer rank. ZeRO-3
    gathers and checks its trace in every forward and the hybrid engine broadcasts its RNG
    state, all over the actor ranks' world, which the scorer process is not in (before, this
    was refused). Checkpoints every step. Same responses and metrics (1e-4) as the same
    settings on 2 ranks inline."""
    common = ["steps=2", "checkpoint.every=1", "checkpoint.export_hf=false", *POOL,
              *ZERO3_HYBRID]
    launch(tmp_path / "inline", cache_dir, *common, placement="inline")
    launch(tmp_path / "stage", cache_dir, *common, ranks=3)
    summary = json.loads((tmp_path / "stage" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["hybrid_engine"].startswith("no-kernels")
    a = _by_step(tmp_path / "inline" / "metrics.jsonl")
    b = _by_step(tmp_path / "stage" / "metrics.jsonl")
    assert sorted(b) == [1, 2]
    for step in (1, 2):
        assert b[step]["response/lengths"] == a[step]["response/lengths"], step
        for key in DETERMINISTIC + POOL_KEYS:
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-4), (step, key)
        assert b[step]["stream/scorer_busy_s"] > 0
    assert (tmp_path / "stage" / "checkpoints" / "latest").read_text().strip() == "step2"


def test_stage_refused_without_a_scorer_rank(cache_dir, tmp_path):
    """One process: no rank is left for the scorers. The error names the key, before any
    model is built."""
    with pytest.raises(ConfigError) as err:
        run_in_process(cache_dir, tmp_path / "run", "steps=1", "oppo.placement=stage")
    assert err.value.key == "oppo.placement" and "got WORLD_SIZE=1" in str(err.value)
