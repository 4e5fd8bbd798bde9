"""Held-out evaluation (``eval:``): the configuration's refusals, the built-in held-out set,
the figures, and whole runs in this process and over two gloo ranks: evaluation changes
nothing of training, a resumed run evaluates as an uninterrupted one, and two ranks
evaluate the same prompts as one."""
from __future__ import annotations

import json
import logging
import math
import shutil

import pytest

from oppo_ds import workload as wl
from oppo_ds.config import ConfigError, load_config
from oppo_ds.datafiles import DataError
from oppo_ds.evaluation import eval_metrics
from oppo_ds.telemetry import eval_summary, read_history
from test_trainer import SMALL, run  # the tiny settings of the in-process runs, crash_after

EVAL = ["eval.prompts=builtin", "eval.num_prompts=6", "eval.every=2"]
TRAINING = ("reward/mean", "gold/mean", "kl/mean", "loss/policy", "loss/value",
            "response/len_mean", "policy/clip_frac", "value/mean")


# ------------------------------------------------------------------ configuration

@pytest.mark.parametrize("overrides, key, words", [
    (["eval.prompts=builtin", "workload.kind=length_oracle"], "eval.prompts", "random weights"),
    (["eval.prompts=builtin", "eval.num_prompts=0"], "eval.num_prompts", ">= 1"),
    (["eval.every=-1"], "eval.every", ">= 0"),
    (["eval.temperature=-0.5"], "eval.temperature", ">= 0 or null"),
    (["eval.prompts=[builtin, a.jsonl]"], "eval.prompts", "cannot be listed"),
    (["eval.prompts=[]"], "eval.prompts", "null for no evaluation"),
])
def test_config_refusals_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(key) and words in str(err.value)


def test_evaluation_is_off_by_default_and_takes_a_list_of_files():
    assert not load_config(None, []).eval.enabled
    cfg = load_config(None, ["eval.prompts=[a.jsonl, b.parquet]", "eval.temperature=0"])
    assert cfg.eval.prompts == ["a.jsonl", "b.parquet"] and cfg.eval.temperature == 0.0


# ------------------------------------------------------------------ pure parts

def test_held_out_builtin_prompts_are_distinct_and_apart_from_training():
    train = {x["prompt"] for x in wl.make_prompts(2048, 1)}
    held = wl.held_out_prompts(500, 2, train)
    texts = [x["prompt"] for x in held]
    assert len(set(texts)) == 500 and not set(texts) & train
    assert [x["id"] for x in held[:2]] == ["builtin-eval-0", "builtin-eval-1"]
    assert held == wl.held_out_prompts(500, 2, train)  # seeded: the same set every run
    assert all(wl.parse_prompt(t.split()) is not None for t in texts)  # the gold rule reads them


def test_eval_metrics_by_hand():
    rows = [{"reward": 1.0, "gold": 0.5, "length": 4, "ended": True},
            {"reward": 3.0, "gold": None, "length": 8, "ended": False}]
    m = eval_metrics(rows, seconds=2.5)
    assert m == {"eval/prompts": 2, "eval/reward_mean": 2.0, "eval/reward_std": 1.0,
                 "eval/response_len_mean": 6.0, "eval/ended_frac": 0.5, "eval/time_s": 2.5,
                 "eval/gold_mean": 0.5}  # gold over the rows that have one
    assert "eval/gold_mean" not in eval_metrics([{**rows[1]}], 1.0)
    s = eval_summary([{"step": 0, "eval/reward_mean": 1.0}, {"step": 4, "eval/reward_mean": 2.0}])
    assert s == {"evaluations": 2, "first_step": 0, "last_step": 4, "reward_first": 1.0,
                 "reward_last": 2.0}


# ------------------------------------------------------------------ whole runs

def _trainer(cache_dir, out_dir, *overrides, base=SMALL):
    from oppo_ds.trainer import PPOTrainer

    return PPOTrainer(load_config(None, [*base, f"workload.cache_dir={cache_dir}",
                                         f"logging.output_dir={out_dir}", *overrides]))


def _by_step(path):
    return {r["step"]: r for r in read_history(str(path))}


def test_a_run_evaluates_before_every_nth_and_after_the_last_step(cache_dir, tmp_path):
    out = tmp_path / "eval"
    trainer, summary = run(cache_dir, out, "steps=3", *EVAL)
    evals = read_history(str(out / "eval.jsonl"))
    assert [r["step"] for r in evals] == [0, 2, 3]
    for r in evals:
        assert r["eval/prompts"] == 6
        assert -1.0 <= r["eval/gold_mean"] <= 1.0 and math.isfinite(r["eval/reward_mean"])
        assert 1 <= r["eval/response_len_mean"] <= 24 and 0.0 <= r["eval/ended_frac"] <= 1.0
    answers = read_history(str(out / "eval_samples.jsonl"))
    assert len(answers) == 3 * 6
    assert {a["prompt_id"] for a in answers} == {f"builtin-eval-{i}" for i in range(6)}
    train_texts = {json.loads(line)["prompt"] for line in open(trainer.sources.prompts)}
    assert not {a["prompt"] for a in answers} & train_texts  # held out
    # each evaluation's figures are its answers' own
    at2 = [a for a in answers if a["step"] == 2]
    assert evals[1]["eval/reward_mean"] == pytest.approx(sum(a["reward"] for a in at2) / 6, abs=1e-9)
    assert summary["eval"]["evaluations"] == 3 and summary["eval"]["last_step"] == 3
    assert summary["eval"]["gold_last"] == evals[-1]["eval/gold_mean"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/reward_mean")] == [0, 2, 3]
    assert [e.step for e in acc.Scalars("eval/gold_mean")] == [0, 2, 3]

    # evaluation draws none of training's random numbers: the run without it trains alike
    # (exact: the same ops in the same order)
    run(cache_dir, tmp_path / "plain", "steps=3")
    a, b = _by_step(out / "metrics.jsonl"), _by_step(tmp_path / "plain" / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        for key in TRAINING:
            assert a[step][key] == b[step][key], (step, key)
    assert not (tmp_path / "plain" / "eval.jsonl").exists()


def test_evaluations_pad_into_the_training_rollouts_static_buffers(cache_dir, tmp_path,
                                                                   monkeypatch):
    """With ``generation.static_cache`` an evaluation's batches (B = 8 prompts, then a short
    last one of 3) decode in the buffers the training rollouts use (kept as a CUDA graph
    keeps them; ``SamplingParams.static_rows`` sizes them for the run's widest rollout), so
    on a GPU evaluating captures no graph of its own, and the next training rollout none
    again. Before, the short batch took, and kept, a set of its own."""
    from _builders import record_static_buffers

    used = record_static_buffers(monkeypatch)
    out = tmp_path / "static"
    run(cache_dir, out, "steps=2", *EVAL, "eval.num_prompts=11", "generation.static_cache=true")
    assert [r["eval/prompts"] for r in read_history(str(out / "eval.jsonl"))] == [11, 11]
    # evaluations before step 1 and after step 2 (8 + 3 rows each), two rollouts of 8
    assert sorted(batch for batch, _ in used) == [3] * 2 + [8] * 4
    assert len({id(buffers) for _, buffers in used}) == 1 and used[0][1].batch == 8


def test_every_evaluation_repeats_its_draws(cache_dir, tmp_path, capsys):
    """Two evaluations of the same weights give the same answers: the figures move only when
    the policy does (the generator starts from the same seed each time)."""
    trainer = _trainer(cache_dir, tmp_path / "twice", *EVAL, "eval.num_prompts=5")
    first, second = trainer.evaluate(), trainer.evaluate()
    trainer.telemetry.log_every = 1
    trainer._evaluate_and_log()
    assert "eval before step 1: reward=" in capsys.readouterr().out
    assert first[1] == second[1]
    assert {k: v for k, v in first[0].items() if k != "eval/time_s"} == \
        {k: v for k, v in second[0].items() if k != "eval/time_s"}
    # and greedy, as asked
    greedy = _trainer(cache_dir, tmp_path / "greedy", *EVAL, "eval.temperature=0").evaluate()[1]
    assert [a["response"] for a in greedy] != [a["response"] for a in first[1][:len(greedy)]]


def test_a_resumed_run_evaluates_as_an_uninterrupted_one(cache_dir, tmp_path):
    """Killed during step 3 (after the step-2 evaluation and checkpoint) and resumed: the
    evaluations are those of the uninterrupted run, none repeated or missing (1e-6: the
    checkpoint round trip is exact, the rest is the same CPU ops)."""
    every = ("steps=4", "checkpoint.every=2", *EVAL)
    run(cache_dir, tmp_path / "full", *every)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cache_dir, tmp_path / "cut", *every, crash_after=2)
    assert [r["step"] for r in read_history(str(tmp_path / "cut" / "eval.jsonl"))] == [0, 2]
    run(cache_dir, tmp_path / "cut", *every)
    a = read_history(str(tmp_path / "full" / "eval.jsonl"))
    b = read_history(str(tmp_path / "cut" / "eval.jsonl"))
    assert [r["step"] for r in b] == [0, 2, 4]
    for x, y in zip(a, b):
        for key in ("eval/reward_mean", "eval/gold_mean", "eval/response_len_mean"):
            assert y[key] == pytest.approx(x[key], abs=1e-6), (x["step"], key)
    answers = read_history(str(tmp_path / "cut" / "eval_samples.jsonl"))
    assert [a["step"] for a in answers] == [0] * 6 + [2] * 6 + [4] * 6

    # a finished run started again trains nothing and evaluates nothing more
    run(cache_dir, tmp_path / "cut", *every)
    assert [r["step"] for r in read_history(str(tmp_path / "cut" / "eval.jsonl"))] == [0, 2, 4]
    # a fresh start in the same directory drops the old evaluations, step 0 included
    run(cache_dir, tmp_path / "cut", "steps=1", "checkpoint.resume=never", *EVAL)
    assert [r["step"] for r in read_history(str(tmp_path / "cut" / "eval.jsonl"))] == [0, 1]


def test_a_run_started_again_at_its_last_step_makes_the_final_evaluation_it_lost(cache_dir,
                                                                                  tmp_path):
    """The evaluation after the last step (3, between every 2nd) comes after that step's
    checkpoint: a kill while it ran, or a signal during the step (which checkpoints and
    stops), left none. The same command started again evaluates then, with the figures the
    first try would have given (1e-6), and a third start evaluates nothing more."""
    last = ("steps=3", "checkpoint.every=3", *EVAL)
    out = tmp_path / "last"
    run(cache_dir, out, *last)
    first = read_history(str(out / "eval.jsonl"))
    assert [r["step"] for r in first] == [0, 2, 3]
    for name in ("eval.jsonl", "eval_samples.jsonl"):  # as the kill left them
        rows = [r for r in read_history(str(out / name)) if r["step"] < 3]
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(cache_dir, out, *last)
    again = read_history(str(out / "eval.jsonl"))
    assert [r["step"] for r in again] == [0, 2, 3]
    for key in ("eval/reward_mean", "eval/gold_mean", "eval/response_len_mean"):
        assert again[-1][key] == pytest.approx(first[-1][key], abs=1e-6), key
    assert [a["step"] for a in read_history(str(out / "eval_samples.jsonl"))].count(3) == 6
    run(cache_dir, out, *last)
    assert [r["step"] for r in read_history(str(out / "eval.jsonl"))] == [0, 2, 3]


def _files(root):
    """Every file under ``root`` with its bytes."""
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_evaluate_only_scores_the_checkpoint_and_leaves_the_run_alone(cache_dir, tmp_path):
    """``oppo-train --evaluate`` (``PPOTrainer(evaluate_only=True).evaluate_only()``) on a
    finished run: the step-2 checkpoint's actor gives the figures and answers the run's own
    evaluation after step 2 gave (1e-6: the checkpoint round trip is exact, the draws repeat);
    ``checkpoint.resume=never`` evaluates the starting actor as the run's step-0 evaluation
    did; nothing of the run (logs, TensorBoard, config, checkpoints) changes."""
    from oppo_ds.trainer import PPOTrainer

    out = tmp_path / "run"
    settings = ("steps=2", "checkpoint.every=2", *EVAL)
    run(cache_dir, out, *settings)
    before = _files(out)
    evals = _by_step(out / "eval.jsonl")
    answers = read_history(str(out / "eval_samples.jsonl"))
    for resume, step in (("auto", 2), ("never", 0)):
        cfg = load_config(None, [*SMALL, f"workload.cache_dir={cache_dir}",
                                 f"logging.output_dir={out}", *settings,
                                 f"checkpoint.resume={resume}"])
        trainer = PPOTrainer(cfg, evaluate_only=True)
        # the actor and the reward model alone: no critic or reference is built for it, and
        # the actor's engine holds its weights alone
        assert trainer.critic is None and trainer.reference is None
        assert trainer.actor.weights_only and trainer.actor.optimizer_name == "none (weights only)"
        result = trainer.evaluate_only()
        trainer.close()
        assert result["step"] == step
        assert result["actor"] == ("checkpoint step2" if step else trainer.sources.actor)
        for key in ("eval/reward_mean", "eval/gold_mean", "eval/response_len_mean",
                    "eval/ended_frac", "eval/prompts"):
            assert result[key] == pytest.approx(evals[step][key], abs=1e-6), (step, key)
        written = out / "evaluations" / f"step_{step}.json"
        assert json.loads(written.read_text()) == result
        mine = read_history(str(out / "evaluations" / f"step_{step}_samples.jsonl"))
        theirs = [{k: v for k, v in a.items() if k != "step"} for a in answers if a["step"] == step]
        assert [a["response"] for a in mine] == [a["response"] for a in theirs]
        assert [a["reward"] for a in mine] == pytest.approx([a["reward"] for a in theirs], abs=1e-6)
        assert result["settings"] == {"eval.prompts": "builtin", "eval.num_prompts": 6,
                                      "eval.temperature": 1.0, "ppo.batch_size": 8, "seed": 0,
                                      "ranks": 1}
    # the step again, greedy and under another seed (which training's resume refuses: the
    # prompts' order follows it; an evaluation reads the weights alone): a file of its own
    cfg = load_config(None, [*SMALL, f"workload.cache_dir={cache_dir}", f"logging.output_dir={out}",
                             *settings, "eval.temperature=0", "seed=1"])
    trainer = PPOTrainer(cfg, evaluate_only=True)
    greedy = trainer.evaluate_only()
    trainer.close()
    assert greedy["step"] == 2 and greedy["settings"]["eval.temperature"] == 0.0
    assert json.loads((out / "evaluations" / "step_2-2.json").read_text()) == greedy
    after = _files(out)
    assert {k: v for k, v in after.items() if k.parts[0] != "evaluations"} == before
    assert sorted(str(k) for k in after if k.parts[0] == "evaluations") == [
        "evaluations/step_0.json", "evaluations/step_0_samples.jsonl",
        "evaluations/step_2-2.json", "evaluations/step_2-2_samples.jsonl",
        "evaluations/step_2.json", "evaluations/step_2_samples.jsonl"]


def test_evaluate_only_scores_with_another_reward_model(cache_dir, tmp_path):
    """An evaluation builds no critic, so the reward model the critic started from (with
    model.critic null) and the estimator (here a critic-free one) may differ from the
    checkpoint's, which a resume refuses: the step-2 actor answers as in the run's own
    evaluation (the same draws), another reward model scores the answers, the gold score (the
    task's own rule) stays."""
    from oppo_ds.trainer import PPOTrainer

    out = tmp_path / "run"
    settings = ("steps=2", "checkpoint.every=2", *EVAL, "eval.at_start=false")
    run(cache_dir, out, *settings)
    answers = [a for a in read_history(str(out / "eval_samples.jsonl")) if a["step"] == 2]
    other = ("model.reward=tiny-llama", "ppo.advantage_estimator=group_norm",
             "data.samples_per_prompt=2")
    base = [*SMALL, f"workload.cache_dir={cache_dir}", f"logging.output_dir={out}", *settings]
    with pytest.raises(ConfigError, match=r"^model\.reward: tiny-llama, but checkpoint step2 "
                                          r"was written with .*the critic started from"):
        PPOTrainer(load_config(None, [*base, other[0]]))  # a resume: refused
    trainer = PPOTrainer(load_config(None, [*base, *other]), evaluate_only=True)
    result = trainer.evaluate_only()
    trainer.close()
    mine = read_history(str(out / "evaluations" / "step_2_samples.jsonl"))
    assert [a["response"] for a in mine] == [a["response"] for a in answers]
    assert [a["gold"] for a in mine] == pytest.approx([a["gold"] for a in answers], abs=1e-6)
    assert [a["reward"] for a in mine] != pytest.approx([a["reward"] for a in answers], abs=1e-3)
    assert result["step"] == 2


def test_evaluate_only_reads_the_weights_of_a_pool_checkpoint_alone(cache_dir, tmp_path,
                                                                     monkeypatch):
    """A checkpoint holding deferred rows is evaluated without overcommitment and with a
    shorter answer limit (a training resume refuses both: it would drop or cut the rows), from
    the actor's weights alone (its critic removed first); other
    models than the checkpoint's are refused with the evaluation's way out; a tag that does
    not exist stops the run before any engine is built."""
    from oppo_ds.engines import factory
    from oppo_ds.trainer import PPOTrainer

    out = tmp_path / "pool"
    run(cache_dir, out, "steps=2", "checkpoint.every=2", "oppo.streaming=true",
        "oppo.overcommit=2", *EVAL)
    assert read_history(str(out / "metrics.jsonl"))[-1]["pool/carried"] > 0  # rows held
    # the actor's weights alone are read: an evaluation needs no critic
    shutil.rmtree(out / "checkpoints" / "critic")
    base = [*SMALL, f"workload.cache_dir={cache_dir}", f"logging.output_dir={out}", *EVAL]
    trainer = PPOTrainer(load_config(None, [*base, "generation.max_new_tokens=4"]),
                         evaluate_only=True)
    result = trainer.evaluate_only()
    trainer.close()
    assert result["step"] == 2 and result["eval/response_len_mean"] <= 4
    # other models than the checkpoint's: refused as a resume is, but the way out named is
    # the evaluation's (a fresh start would evaluate model.actor, not the checkpoint)
    with pytest.raises(ConfigError, match=r"^model\.actor_lora_dim: 2, but checkpoint step2 "
                                          r"was written with 0: .*evaluate it with the settings "
                                          r"it was written with \(checkpoint\.resume=never would "
                                          r"evaluate model\.actor itself\)$"):
        PPOTrainer(load_config(None, [*base, "model.actor_lora_dim=2"]), evaluate_only=True)

    def no_engines(*args, **kwargs):
        raise AssertionError("an engine was built")
    monkeypatch.setattr(factory, "build_models", no_engines)
    with pytest.raises(ConfigError, match=r"^checkpoint\.resume: no checkpoint step9 in .* \(it "
                                          r"holds: step2\)"):
        PPOTrainer(load_config(None, [*base, "checkpoint.resume=step9"]), evaluate_only=True)


def test_the_evaluate_flag_runs_from_the_command_line(cache_dir, tmp_path, capsys):
    """``oppo-train --evaluate`` as a user runs it (a process of its own): the figures printed
    and written; without ``eval.prompts`` an error naming that key, before anything is built."""
    import subprocess
    import sys

    from _builders import single_process_env
    from oppo_ds.cli.train import main as train_main

    out = tmp_path / "run"
    assert train_main(["--evaluate", *SMALL, f"logging.output_dir={out}"]) == 2
    assert capsys.readouterr().err.startswith("oppo-train: error: eval.prompts: null, and "
                                              "--evaluate evaluates on it")
    assert not out.exists()
    assert train_main(["--evaluate", "--print-config", *SMALL]) == 0  # prints, evaluates nothing
    assert "eval:" in capsys.readouterr().out
    proc = subprocess.run([sys.executable, "-m", "oppo_ds.train", "--evaluate", *SMALL, *EVAL,
                           f"workload.cache_dir={cache_dir}", f"logging.output_dir={out}",
                           "system.torch_threads=1"],
                          capture_output=True, text=True, env=single_process_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])
    assert printed["step"] == 0 and printed["eval/prompts"] == 6
    assert json.loads((out / "evaluations" / "step_0.json").read_text()) == printed
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_evaluation_prompts_from_a_file(cache_dir, tmp_path, caplog):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"warm {c} b ->"}) + "\n" for c in "cdefghij"))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"id": f"h{i}", "prompt": p}) + "\n" for i, p in
                            enumerate(["warm c b ->", "cool q r ->", "bold x ->", "calm a a a ->"])))
    with caplog.at_level(logging.WARNING, logger="oppo_ds.evaluation"):
        trainer = _trainer(cache_dir, tmp_path / "file", f"data.prompts={train}", f"eval.prompts={held}",
                           "eval.num_prompts=0", "eval.temperature=0")
    assert [p.id for p in trainer.eval_prompts] == ["h0", "h1", "h2", "h3"]
    assert "1 of 4 evaluation prompts are training prompts too" in caplog.text
    metrics, answers = trainer.evaluate()
    assert metrics["eval/prompts"] == 4 and [a["prompt_id"] for a in answers] == ["h0", "h1", "h2", "h3"]
    # the gold rule is the built-in set's: a file's prompts have none
    assert "eval/gold_mean" not in metrics and all(a["gold"] is None for a in answers)

    # a broken evaluation row stops the run at start, naming the file and line
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "warm a ->"}) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        _trainer(cache_dir, tmp_path / "bad", f"data.prompts={train}", f"eval.prompts={bad}")
    assert not (tmp_path / "bad" / "checkpoints").exists()
    # evaluation prompts all over the prompt length, skipped: nothing left to evaluate
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "warm " + "a " * 40 + "->"}) + "\n")
    with pytest.raises(DataError, match="no usable prompt"):
        _trainer(cache_dir, tmp_path / "long", f"data.prompts={train}", f"eval.prompts={long}",
                 "data.overlong=skip", "generation.max_prompt_len=16")


def test_two_ranks_evaluate_the_prompts_one_rank_does(tmp_path):
    """Over two gloo ranks under ZeRO-3 each rank answers its share (5 prompts in two batches
    of 4 and 4 in one: the ranks generate a different number of times) and rank 0 writes all
    of them: greedy, the untrained actor's answers (step 0) are those of a one-process run of
    the same models (texts equal; rewards within 1e-4: the batches are padded differently).
    ``--evaluate`` on the two ranks then answers as the run's own evaluation after step 1 did,
    from the ZeRO-3 checkpoint each rank reads its own partitions of (weights-only engine),
    and so does one rank under ZeRO-0 (an evaluation reads any stage's files of any number of
    ranks; rewards within 1e-4 again)."""
    from test_distributed import SMALL as DIST_SMALL
    from test_distributed import launch

    cache = tmp_path / "cache"
    greedy = ["eval.prompts=builtin", "eval.num_prompts=9", "eval.temperature=0", "system.zero_stage=3"]
    launch(tmp_path / "two", cache, "steps=1", *greedy)
    two = [a for a in read_history(str(tmp_path / "two" / "eval_samples.jsonl")) if a["step"] == 0]
    assert sorted(a["prompt_id"] for a in two) == sorted(f"builtin-eval-{i}" for i in range(9))
    assert [r["step"] for r in read_history(str(tmp_path / "two" / "eval.jsonl"))] == [0, 1]

    launch(tmp_path / "two", cache, "--evaluate", "steps=1", *greedy)
    last = [a for a in read_history(str(tmp_path / "two" / "eval_samples.jsonl")) if a["step"] == 1]
    again = read_history(str(tmp_path / "two" / "evaluations" / "step_1_samples.jsonl"))
    assert sorted((a["prompt_id"], a["response"]) for a in again) == \
        sorted((a["prompt_id"], a["response"]) for a in last)
    rewards = {a["prompt_id"]: a["reward"] for a in last}
    assert [a["reward"] for a in again] == pytest.approx([rewards[a["prompt_id"]] for a in again],
                                                         abs=1e-6)
    launch(tmp_path / "two", cache, "--evaluate", "steps=1", *greedy[:-1], "system.zero_stage=0",
           ranks=1)
    alone = read_history(str(tmp_path / "two" / "evaluations" / "step_1-2_samples.jsonl"))
    assert sorted((a["prompt_id"], a["response"]) for a in alone) == \
        sorted((a["prompt_id"], a["response"]) for a in last)
    assert [a["reward"] for a in alone] == pytest.approx([rewards[a["prompt_id"]] for a in alone],
                                                         abs=1e-4)

    one = _trainer(str(cache), tmp_path / "one", *greedy, base=DIST_SMALL).evaluate()[1]
    by_id = {a["prompt_id"]: a for a in one}
    for a in two:
        b = by_id[a["prompt_id"]]
        assert a["response"] == b["response"], a["prompt_id"]
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-4)
