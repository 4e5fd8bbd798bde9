"""Tier 2: whole PPO runs on the built-in workload with tiny settings, in this process.

A small prepare (few SFT / reward steps) is shared by the module; the assertions are on
invariants (resume continues exactly, micro-batch size does not change the math, outputs
are real and loadable), not on learning quality, which `make demo` shows.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys

import pytest
import torch

from oppo_ds.config import ConfigError, load_config
from oppo_ds.telemetry import read_history

SMALL = ["workload.num_prompts=64", "workload.sft_steps=20", "workload.reward_steps=20",
         "generation.max_new_tokens=24", "ppo.batch_size=8", "ppo.mini_batch_size=4",
         "ppo.micro_batch_size=4", "logging.progress=false", "logging.log_every=0"]


def run(cache_dir, out_dir, *overrides, crash_after=None):
    from oppo_ds.trainer import PPOTrainer

    cfg = load_config(None, SMALL + [f"workload.cache_dir={cache_dir}",
                                     f"logging.output_dir={out_dir}", *overrides])
    trainer = PPOTrainer(cfg)
    if crash_after is not None:
        real_step = trainer.step

        def step():
            if trainer.step_count >= crash_after:
                raise RuntimeError("simulated crash")
            return real_step()
        trainer.step = step
    return trainer, trainer.train()


def test_run_writes_real_outputs(cache_dir, tmp_path):
    out = tmp_path / "run"
    trainer, summary = run(cache_dir, out, "steps=4", "checkpoint.every=2",
                           "logging.samples=3", "logging.samples_every=2")
    for key in ("steps", "wall_s", "reward_first10", "reward_last10", "gold_first10", "gold_last10"):
        assert key in summary and summary[key] is not None and summary[key] == summary[key]
    assert summary["steps"] == 4
    assert json.loads((out / "summary.json").read_text()) == summary
    history = read_history(str(out / "metrics.jsonl"))
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    for row in history:
        assert -1.0 <= row["gold/mean"] <= 1.0
        assert 1 <= row["response/len_mean"] <= 24
        assert row["time/phase/generate"] > 0 and row["time/phase/train"] > 0

    # TensorBoard events hold the scalars (read back with TensorBoard's own reader)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("reward/mean", "gold/mean", "kl/mean", "loss/policy", "loss/value",
                "policy/clip_frac", "policy/entropy", "response/len_mean", "time/phase/generate"):
        assert tag in tags, tag
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2, 3, 4]
    assert "response/lengths" in acc.Tags()["histograms"]
    lengths = sorted(x for row in history for x in row["response/lengths"])
    assert len(lengths) == 4 * 8
    assert summary["response_len_p50"] == lengths[16] and summary["response_len_p99"] == lengths[-1]

    # sample responses as text, with their prompts as the data file has them
    from oppo_ds.datafiles import read_prompt_rows

    texts = {r.id: r.text_or_messages for r in read_prompt_rows(trainer.sources.prompts)}
    samples = read_history(str(out / "samples.jsonl"))
    assert [x["step"] for x in samples] == [2, 2, 2, 4, 4, 4]
    for x in samples:
        assert x["prompt"] == texts[x["prompt_id"]]
        assert 1 <= x["length"] <= 24 and (x["ended"] or x["length"] == 24)
        assert len(x["response"].split()) <= x["length"]  # the end id is not shown
        assert -1.0 <= x["gold"] <= 1.0 and x["reward"] == x["reward"]
    assert "samples/text_summary" in acc.Tags()["tensors"]
    shown = acc.Tensors("samples/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert samples[-1]["prompt"] in shown and f"reward={samples[-1]['reward']:.4g}" in shown

    # the exported actor is a loadable HF checkpoint equal to the trained weights
    from oppo_ds.models import build_causal_lm, load_tokenizer

    exported = build_causal_lm(str(out / "actor"))
    assert os.path.isfile(out / "actor" / "model.safetensors")
    trained = trainer.actor.module.state_dict()
    for name, tensor in exported.state_dict().items():
        torch.testing.assert_close(tensor, trained[name].cpu(), rtol=0, atol=0)
    tok = load_tokenizer(str(out / "actor"))
    assert tok.eos_token_id is not None
    assert (out / "checkpoints" / "latest").read_text().strip() == "step4"


@pytest.mark.parametrize("arch", ["tiny-qwen2", "tiny-gpt2"])
def test_builtin_workload_on_the_other_architectures(arch, tmp_path):
    """The built-in task on every tiny architecture: the prompts come back as tasks (gold is
    a number in [-1, 1] at every step; under tiny-qwen2 transformers once loaded the saved
    tokenizer as Qwen2's byte-level BPE, every prompt lost its "->" and gold was NaN)."""
    _, summary = run(str(tmp_path / "cache"), tmp_path / "run", "steps=2", f"model.builtin_arch={arch}")
    for row in read_history(str(tmp_path / "run" / "metrics.jsonl")):
        assert -1.0 <= row["gold/mean"] <= 1.0, row["gold/mean"]
    assert -1.0 <= summary["gold_last10"] <= 1.0


def test_printed_samples(tmp_path, capsys):
    """logging.print_samples (DeepSpeed-Chat's --print_answers): each sample's scores, then
    its prompt and response, multi-line texts kept under their labels."""
    from oppo_ds.telemetry import Telemetry

    tel = Telemetry(str(tmp_path), enabled=True, tensorboard=False, progress=False, total_steps=9,
                    start_step=0, log_every=0)
    samples = [{"prompt_id": "p:1", "prompt": "Human: hi\nthere", "response": "hello",
                "reward": 1.23456, "gold": None, "length": 1, "ended": True},
               {"prompt_id": "p:2", "prompt": "q", "response": "a b", "reward": -2.0,
                "gold": 0.5, "length": 8, "ended": False}]
    tel.log_samples(3, samples, show=True)
    assert capsys.readouterr().out == (
        "step 3 sample 0: reward=1.235 (1 token; p:1)\n"
        "  prompt:   Human: hi\n"
        "            there\n"
        "  response: hello\n"
        "step 3 sample 1: reward=-2 gold=0.5 (8 tokens, cut at max_new_tokens; p:2)\n"
        "  prompt:   q\n"
        "  response: a b\n")
    tel.log_samples(4, samples[:1], show=False)
    assert capsys.readouterr().out == ""
    assert [x["step"] for x in read_history(str(tmp_path / "samples.jsonl"))] == [3, 3, 4]
    Telemetry(str(tmp_path), enabled=True, tensorboard=False, progress=False, total_steps=9,
              start_step=3, log_every=0)  # a resume from step 3
    assert [x["step"] for x in read_history(str(tmp_path / "samples.jsonl"))] == [3, 3]


def _wandb_records(path) -> list:
    """The records of a wandb run file (``run-ID.wandb``), read as wandb-core writes it: a
    7-byte header (":W&B", magic, version), then LevelDB's log format (32 KiB blocks; each
    piece a 7-byte header of checksum, length, type: 1 whole, 2 first, 3 middle, 4 last) of
    protobuf ``Record``s. wandb 0.31 keeps no Python reader of its own."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: zeros
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_history(run_dir, *paths) -> dict[int, dict]:
    """Every step's logged values in a wandb run's files (``paths``, or all of them), by
    step."""
    steps = {}
    for path in paths or sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in _wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                items = {}
                for item in record.history.item:  # a histogram's parts under its key
                    *parents, last = [item.key] if item.key else item.nested_key
                    node = items
                    for part in parents:
                        node = node.setdefault(part, {})
                    node[last] = json.loads(item.value_json)
                steps.setdefault(items.pop("_step"), {}).update(items)
    return steps


@pytest.fixture
def wandb_settings():
    """wandb keeps its settings per process: each test's environment applies, and none is
    left behind for the next (a failed assertion included)."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


def test_a_run_logs_to_wandb_and_a_resume_continues_its_run(cache_dir, tmp_path, monkeypatch,
                                                            wandb_settings):
    """logging.wandb_project, with wandb offline (no network here; its files under
    output_dir/wandb, as on a cluster's nodes before a ``wandb sync``): each step's metrics
    as metrics.jsonl holds them (lists as histograms), the step-0 evaluation, the config, the
    summary. A run crashed after step 3 and resumed from its step-2 checkpoint continues the
    same wandb run; its step 3 again is not sent (wandb's steps only go forward: step 3 keeps
    the first sitting's values), step 4 is."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    settings = ("steps=4", "checkpoint.every=2", "logging.wandb_project=oppo-test",
                "eval.prompts=builtin", "eval.num_prompts=4", "eval.every=0")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cache_dir, out, *settings, crash_after=3)
    first_sitting = read_history(str(out / "metrics.jsonl"))
    assert [r["step"] for r in first_sitting] == [1, 2, 3]
    first = (out / "wandb-run-id").read_text().split()[0]
    run(cache_dir, out, *settings)
    assert (out / "wandb-run-id").read_text().split() == [first, "4"]
    # wandb's service process writes the run's files: its end (teardown waits for it) has them
    # whole (once, in a CI under load, the second sitting's file was read without step 4)
    import wandb

    wandb.teardown()
    files = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert [p.name for p in files] == [f"run-{first}.wandb"] * 2  # two sittings, one run
    by_file = [sorted(_wandb_history(p.parent.parent.parent, p)) for p in files]
    assert by_file == [[0, 1, 2, 3], [4]]  # each step sent once
    logged = _wandb_history(out)
    assert logged[0]["eval/reward_mean"] == pytest.approx(
        read_history(str(out / "eval.jsonl"))[0]["eval/reward_mean"])
    resumed = read_history(str(out / "metrics.jsonl"))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for row in first_sitting[:3] + resumed[3:]:
        mine = logged[row["step"]]
        for key in ("reward/mean", "gold/mean", "kl/mean", "loss/policy", "time/step_s"):
            assert mine[key] == pytest.approx(row[key]), (row["step"], key)
        assert mine["response/lengths"]["_type"] == "histogram"
    records = [r for p in sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
               for r in _wandb_records(p)]
    config = {i.key: json.loads(i.value_json) for r in records
              if r.WhichOneof("record_type") == "run" for i in r.run.config.update}
    assert config["ppo"]["batch_size"] == 8 and config["steps"] == 4  # the run's whole config
    summary = {i.key or i.nested_key[0]: json.loads(i.value_json) for r in records
               if r.WhichOneof("record_type") == "summary" for i in r.summary.update}
    assert summary["steps"] == 4 and summary["reward_last10"] == pytest.approx(
        json.loads((out / "summary.json").read_text())["reward_last10"])
    # the crashed sitting ended failed, the resumed one finished
    exits = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
    assert exits == [1, 0]


def test_wandb_logging_without_the_package_or_a_login_is_refused(cache_dir, tmp_path,
                                                                 monkeypatch, wandb_settings):
    """The wandb package missing: the run stops before any model is built, naming the key and
    how to install it (a folder named wandb, such as wandb's own runs in the working
    directory, is no package; an evaluation, which logs to no wandb run, goes on). wandb
    unable to start (online, no key): the run stops before its history is touched, with the
    key and the ways out (log in, WANDB_MODE=offline)."""
    import importlib.machinery
    import importlib.util

    from oppo_ds.engines import factory
    from oppo_ds.telemetry import check_wandb_installed
    from oppo_ds.trainer import PPOTrainer

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))

    def no_engines(*args, **kwargs):
        raise AssertionError("an engine was built")
    monkeypatch.setattr(factory, "build_models", no_engines)
    cfg = load_config(None, [*SMALL, f"workload.cache_dir={cache_dir}", "logging.wandb_project=p",
                             f"logging.output_dir={tmp_path / 'run'}"])  # the config takes it
    with pytest.raises(ConfigError, match=r"^logging\.wandb_project: 'p' asks for wandb logging, "
                                          r"but the wandb package is not installed: pip install"):
        PPOTrainer(cfg)
    evaluation = load_config(None, [*SMALL, f"workload.cache_dir={cache_dir}",
                                    "logging.wandb_project=p", "eval.prompts=builtin",
                                    f"logging.output_dir={tmp_path / 'run'}"])
    with pytest.raises(AssertionError, match="an engine was built"):  # past the check
        PPOTrainer(evaluation, evaluate_only=True)
    # without the package, a folder wandb/ in the working directory is found as a namespace
    # package: a spec without an origin
    namespace = importlib.machinery.ModuleSpec("wandb", None, is_package=True)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: namespace if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="the wandb package is not installed"):
        check_wandb_installed("p")
    monkeypatch.undo()
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "no-login"))  # no stored key,
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # no ~/.netrc login
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # and nowhere to reach
    monkeypatch.setenv("WANDB_SILENT", "true")
    with pytest.raises(ConfigError, match=r"^logging\.wandb_project: wandb could not start the "
                                          r"run .*WANDB_MODE=offline"):
        run(cache_dir, tmp_path / "run", "steps=1", "logging.wandb_project=p")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_fresh_start_over_an_old_run_hides_its_tensorboard_steps_and_traces(tmp_path):
    """Starting afresh (or resuming) in an output directory that holds another run: TensorBoard
    (its own reader) shows each step once, the new run's (a fresh start's step-0 evaluation
    included), and the old run's traces after the start are gone."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from oppo_ds.telemetry import Telemetry

    def start(at, value, steps):
        tel = Telemetry(str(tmp_path), enabled=True, tensorboard=True, progress=False,
                        total_steps=9, start_step=at, log_every=0)
        tel.log_eval(at, {"eval/reward_mean": value}, [])
        for step in steps:
            tel.log_step(step, {"reward/mean": value + step})
        tel.writer.close()  # as close(), without the summary

    traces = tmp_path / "traces"
    traces.mkdir()

    def traced(*steps):  # the trainer's step traces, written by the run
        for step in steps:
            (traces / f"step{step}.json").write_text("{}")

    start(0, 1.0, [1, 2, 3])
    traced(1, 2, 3)
    start(0, 2.0, [1, 2])  # afresh: step 0 and steps 1-2 anew, step 3 gone
    assert not list(traces.iterdir())
    traced(1, 2, 3)
    start(1, 3.0, [2])  # a resume after step 1

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    seen = {tag: [(e.step, e.tensor_proto.float_val[0]) for e in acc.Tensors(tag)]
            for tag in ("eval/reward_mean", "reward/mean")}
    assert seen == {"eval/reward_mean": [(0, 2.0), (1, 3.0)],
                    "reward/mean": [(1, 3.0), (2, 5.0)]}
    assert sorted(p.name for p in traces.iterdir()) == ["step1.json"]


def test_a_fresh_start_beside_an_earlier_runs_checkpoints(cache_dir, tmp_path, caplog):
    """checkpoint.resume=never where a finished run left step2 and step4: they move aside whole
    (said once), so that a crash before the first save and a restart under auto (the Slurm
    scripts' requeue) start afresh again; it resumed step4, the earlier run, into the new
    run's truncated logs. The new run's checkpoints are its own alone."""
    from oppo_ds.checkpoint import checkpoint_tags

    out = tmp_path / "run"
    root = str(out / "checkpoints")
    common = ("checkpoint.every=2", "checkpoint.export_hf=false")
    run(cache_dir, out, "steps=4", *common)
    assert checkpoint_tags(root) == ["step2", "step4"]
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cache_dir, out, "steps=2", *common, "checkpoint.resume=never", crash_after=0)
    [aside] = [p for p in out.iterdir() if p.name.startswith("checkpoints.earlier-")]
    assert f"held an earlier run's checkpoints (step2, step4); moved to {aside}" in caplog.text
    assert checkpoint_tags(str(aside)) == ["step2", "step4"]
    assert (aside / "latest").read_text() == "step4" and not os.path.exists(root)
    run(cache_dir, out, "steps=2", *common)  # auto: nothing of this run's to resume
    assert [r["step"] for r in read_history(str(out / "metrics.jsonl"))] == [1, 2]
    assert checkpoint_tags(root) == ["step2"]
    assert (out / "checkpoints" / "latest").read_text() == "step2"


def test_summary_of_a_diverged_run_is_still_written():
    """A NaN reward (a run that diverged) gives NaN figures in the summary, not a crash at
    the end of the run (statistics.stdev raises AttributeError on NaN)."""
    from oppo_ds.telemetry import summarize

    history = [{"reward/mean": r, "time/step_s": 1.0, "samples": 8} for r in (1.0, float("nan"), 2.0)]
    out = summarize(history)
    assert out["reward_noise_std"] != out["reward_noise_std"]  # NaN
    assert out["reward_first10"] != out["reward_first10"]
    assert out["samples"] == 24 and out["wall_s"] == 3.0
    assert summarize(history[:1])["reward_noise_std"] is None
    assert summarize([history[0], history[2]])["reward_noise_std"] == pytest.approx(2 ** -0.5)


def test_summary_length_quantiles_by_nearest_rank():
    """response_len_p99 is the smallest length at or above 99% of them (nearest rank, as
    numpy's 'inverted_cdf'): of 1..200, 198; it was one rank above (199), and for 100 lengths
    or fewer the longest."""
    from oppo_ds.telemetry import summarize

    history = [{"response/lengths": list(range(1 + 50 * i, 51 + 50 * i))} for i in range(4)]
    assert summarize(history)["response_len_p99"] == 198
    assert summarize(history[:2])["response_len_p99"] == 99  # of 1..100: not the longest


def _metrics_by_step(path):
    return {r["step"]: r for r in read_history(str(path))}


DETERMINISTIC = ("reward/mean", "gold/mean", "kl/mean", "loss/policy", "loss/value",
                 "response/len_mean", "policy/clip_frac", "value/mean")


def _assert_same_training(a: dict, b: dict, steps) -> None:
    """Runs ``a`` and ``b`` (metrics by step) scored the same at step 1 (1e-5: streamed
    prefill and whole-sequence forwards differ by float summation order, measured <= 1.4e-6)
    and trained the same over ``steps``: the same response lengths, the deterministic metrics
    within 1e-4 (those tiny differences pass through Adam updates)."""
    for key in ("reward/mean", "kl/mean", "value/mean"):
        assert b[1][key] == pytest.approx(a[1][key], abs=1e-5), key
    for step in steps:
        assert b[step]["response/lengths"] == a[step]["response/lengths"], step
        for key in DETERMINISTIC:
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-4), (step, key)


def test_crash_then_resume_continues_exactly(cache_dir, tmp_path):
    """A run killed after its step-3 checkpoint and resumed gives the same later metrics as
    an uninterrupted run. Tolerance 1e-6 absolute: same ops on CPU, fp32, fixed seeds; only
    the checkpoint round trip is in between, which is exact."""
    every = ("steps=6", "checkpoint.every=3", "logging.samples_every=2")
    _, full = run(cache_dir, tmp_path / "full", *every)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cache_dir, tmp_path / "cut", *every, crash_after=4)
    # the crash left step 3 as the latest complete checkpoint, and it loads
    assert (tmp_path / "cut" / "checkpoints" / "latest").read_text().strip() == "step3"
    assert [x["step"] for x in read_history(str(tmp_path / "cut" / "samples.jsonl"))] == [2, 2, 4, 4]
    trainer, resumed = run(cache_dir, tmp_path / "cut", *every)
    # the step-4 samples of the crashed run are dropped with its metrics, and written again
    a, b = (read_history(str(tmp_path / run_dir / "samples.jsonl")) for run_dir in ("full", "cut"))
    assert [x["step"] for x in b] == [2, 2, 4, 4, 6, 6]
    for x, y in zip(a, b):
        assert {**x, "reward": None} == {**y, "reward": None}
        assert x["reward"] == pytest.approx(y["reward"], abs=1e-6)
    a, b = _metrics_by_step(tmp_path / "full" / "metrics.jsonl"), _metrics_by_step(tmp_path / "cut" / "metrics.jsonl")
    assert sorted(b) == [1, 2, 3, 4, 5, 6]  # step 4 of the crashed run was not logged twice
    for step in (4, 5, 6):
        for key in DETERMINISTIC:
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-6), (step, key)
    assert resumed["reward_last10"] == pytest.approx(full["reward_last10"], abs=1e-6)


@contextlib.contextmanager
def _dying_at_step4(monkeypatch, dies):
    """Within: the step-4 checkpoint's ``torch.save`` of a file for which ``dies(path)`` is
    true raises KeyboardInterrupt, as a process killed there stops writing."""
    from oppo_ds.trainer import PPOTrainer

    real_save, real_checkpoint = torch.save, PPOTrainer.save_checkpoint

    def save_checkpoint(self):
        if self.step_count != 4:
            return real_checkpoint(self)

        def dying_save(obj, f, *args, **kwargs):
            if dies(str(f)):
                raise KeyboardInterrupt("killed mid-save")
            return real_save(obj, f, *args, **kwargs)
        with monkeypatch.context() as m:
            m.setattr(torch, "save", dying_save)
            return real_checkpoint(self)
    with monkeypatch.context() as m:
        m.setattr(PPOTrainer, "save_checkpoint", save_checkpoint)
        yield


@pytest.mark.parametrize("crash_at", [1, 2, 3], ids=["actor", "critic", "trainer-state"])
def test_crash_in_the_middle_of_a_save_resumes_from_the_previous_checkpoint(cache_dir, tmp_path,
                                                                             monkeypatch, crash_at):
    """A process killed while writing its step-4 checkpoint (here: the n-th file it writes
    raises: the actor's engine file, the critic's, or the trainer state) leaves `latest` at
    step 2, whose files are whole: the same command resumes there, with the pool, and gives
    the uninterrupted run's metrics for steps 3-6 (1e-6, as above); step 4 is written again
    over what the crash left of it."""
    over = ("steps=6", "checkpoint.every=2", "checkpoint.export_hf=false", "oppo.overcommit=4")
    run(cache_dir, tmp_path / "full", *over)

    writes = []
    with pytest.raises(KeyboardInterrupt, match="killed mid-save"), \
            _dying_at_step4(monkeypatch, lambda f: writes.append(f) or len(writes) == crash_at):
        run(cache_dir, tmp_path / "cut", *over)
    ckpt = tmp_path / "cut" / "checkpoints"
    assert len(writes) == crash_at and "/actor/step4/" in writes[0]
    assert (ckpt / "latest").read_text().strip() == "step2"
    assert not list((ckpt / "trainer" / "step4").glob("rank*.pt"))  # its own file never landed
    run(cache_dir, tmp_path / "cut", *over)
    a, b = _metrics_by_step(tmp_path / "full" / "metrics.jsonl"), _metrics_by_step(tmp_path / "cut" / "metrics.jsonl")
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        assert b[step]["response/lengths"] == a[step]["response/lengths"]
        for key in DETERMINISTIC:
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-6), (step, key)
    assert (ckpt / "latest").read_text().strip() == "step6"


def test_a_crash_while_saving_a_tag_again_leaves_latest_on_a_whole_checkpoint(cache_dir, tmp_path,
                                                                            monkeypatch, caplog):
    """Resumed from an older tag (step 2, as the NaN message suggests) with another learning
    rate, a run saves step 4 again, the tag `latest` names. It was written in place: killed
    between the actor's and the critic's files, `latest` still named step 4, and the next
    start resumed from an actor of the new run and a critic, optimizer and data cursor of the
    old one. Now the tag is cleared and `latest` moved back to step 2 first: the next start
    resumes at step 2."""

    over = ("checkpoint.every=2", "checkpoint.export_hf=false")
    run(cache_dir, tmp_path / "r", "steps=4", *over)
    ckpt = tmp_path / "r" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step4"
    with pytest.raises(KeyboardInterrupt, match="killed mid-save"), \
            _dying_at_step4(monkeypatch, lambda f: "/critic/step4/" in f):
        run(cache_dir, tmp_path / "r", "steps=4", *over, "checkpoint.resume=step2",
            "ppo.actor_lr=1e-4")
    assert (ckpt / "latest").read_text().strip() == "step2"
    assert not (ckpt / "trainer" / "step4").exists()
    with caplog.at_level("INFO", logger="oppo_ds.resume"):
        run(cache_dir, tmp_path / "r", "steps=4", *over)
    assert "resumed from step2 at step 2" in caplog.text
    assert (ckpt / "latest").read_text().strip() == "step4"

    # the finished run started again (with a final save due: checkpoint.every 0) trains
    # nothing and saves nothing: re-saving step 4 cleared it first, and a kill in that save
    # left no checkpoint at all
    from oppo_ds.checkpoint import CheckpointManager

    def no_save(*args):
        raise AssertionError("a finished run started again saved its checkpoint again")
    monkeypatch.setattr(CheckpointManager, "save", no_save)
    run(cache_dir, tmp_path / "r", "steps=4", "checkpoint.every=0", "checkpoint.export_hf=false")
    assert (ckpt / "latest").read_text().strip() == "step4"


@pytest.mark.parametrize("mode, level", [("token_mean", "token"), ("seq_mean_token_mean", "token"),
                                         ("seq_mean_token_mean", "sequence")])
def test_micro_batch_size_does_not_change_the_math(cache_dir, tmp_path, mode, level):
    """Token- and sequence-level loss aggregation (ppo.loss_agg_mode), and GSPO's ratio per
    response (ppo.importance_sampling_level): micro-batches of 4 or 2 inside a mini-batch of 4
    give the same updates (1e-5: only floating-point summation order differs), and another
    update than the token mean's (the token ratios', with GSPO's). So do the logged update
    statistics: a maximum is the largest over the micro-batches, not a mean of theirs."""
    both = (f"ppo.loss_agg_mode={mode}", f"ppo.importance_sampling_level={level}")
    run(cache_dir, tmp_path / "m4", "steps=3", "ppo.micro_batch_size=4", *both)
    run(cache_dir, tmp_path / "m2", "steps=3", "ppo.micro_batch_size=2", *both)
    a, b = _metrics_by_step(tmp_path / "m4" / "metrics.jsonl"), _metrics_by_step(tmp_path / "m2" / "metrics.jsonl")
    for step in (1, 2, 3):
        for key in ("reward/mean", "gold/mean", "loss/policy", "kl/mean", "response/len_mean",
                    "grad_norm/actor", "loss/value", "policy/clip_frac", "policy/entropy",
                    "train/ratio_max", "train/explained_variance"):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-5), (step, key)
    if (mode, level) != ("token_mean", "token"):  # and not the default's: another gradient
        other = f"ppo.loss_agg_mode={mode}" if level != "token" else "ppo.loss_agg_mode=token_mean"
        run(cache_dir, tmp_path / "tm", "steps=1", "ppo.micro_batch_size=4", other)
        token = _metrics_by_step(tmp_path / "tm" / "metrics.jsonl")[1]
        assert token["response/lengths"] == a[1]["response/lengths"]
        assert abs(token["grad_norm/actor"] - a[1]["grad_norm/actor"]) > 1e-3


@pytest.mark.parametrize("packing", [False, True])
def test_micro_batches_sized_by_tokens_do_not_change_the_math(cache_dir, tmp_path, monkeypatch,
                                                              packing):
    """ppo.micro_batch_tokens=64 (the least these lengths allow is 32 + 24): each mini-batch of
    4 is split into micro-batches of at most 64 token positions, padding included (packed rows
    under system.packing_samples), their number varying from one mini-batch to the next, and
    the run is the one in micro-batches of 4 (1e-5, summation order); train/micro_batches logs
    the count (1 for micro-batches of 4). ppo.score_batch_tokens=64 splits the scoring
    forwards alike, their results put back in the rows' order."""
    from oppo_ds import ppo_update
    from oppo_ds.micro_batches import forward_tokens

    costs, counts = [], []
    real = ppo_update.PPOUpdate._micro_batch_rows

    def rows(self, exp, mini):
        groups, fewest = real(self, exp, mini)
        if self.cfg.ppo.micro_batch_tokens is not None:
            counts.append(len(groups))
            costs.extend(forward_tokens(exp.prompt_mask[g].sum(1).tolist(),
                                        exp.response_mask[g].sum(1).tolist(), packing)
                         for g in groups)
        return groups, fewest
    monkeypatch.setattr(ppo_update.PPOUpdate, "_micro_batch_rows", rows)
    packed = f"system.packing_samples={str(packing).lower()}"
    run(cache_dir, tmp_path / "m4", "steps=3", packed)
    run(cache_dir, tmp_path / "t64", "steps=3", packed, "ppo.micro_batch_tokens=64",
        "ppo.score_batch_tokens=64")
    a = _metrics_by_step(tmp_path / "m4" / "metrics.jsonl")
    b = _metrics_by_step(tmp_path / "t64" / "metrics.jsonl")
    assert 0 < max(costs) <= 64 and len(counts) == 3 * 2  # steps x mini-batches
    assert len(set(counts)) > 1 and max(counts) > 1, counts
    for step in (1, 2, 3):
        for key in ("reward/mean", "gold/mean", "loss/policy", "kl/mean", "response/len_mean",
                    "grad_norm/actor", "grad_norm/critic", "loss/value", "policy/clip_frac",
                    "policy/entropy", "train/ratio_max", "train/explained_variance"):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-5), (step, key)
        assert a[step]["train/micro_batches"] == 1
        assert b[step]["train/micro_batches"] == sum(counts[2 * step - 2:2 * step]) / 2


def test_explained_variance_and_the_largest_ratio_are_the_batchs(cache_dir, tmp_path,
                                                                 monkeypatch):
    """``train/explained_variance`` is ``1 - Var(R - V) / Var(R)`` over the step's response
    tokens (V the rollout's values, R the returns), computed here by hand from the experience
    the update got (1e-9); ``train/ratio_max`` is at least 1 (the first mini-batch's ratios
    are 1) and the largest of the update's."""
    from oppo_ds import ppo_update

    seen = []
    real = ppo_update.PPOUpdate.update

    def update(self, exp):
        mask = exp.response_mask.bool()
        returns, values = exp.returns[mask].double(), exp.old_values[mask].double()
        stats = real(self, exp)
        seen.append((returns, values, stats))
        return stats
    monkeypatch.setattr(ppo_update.PPOUpdate, "update", update)
    run(cache_dir, tmp_path / "r", "steps=2")
    logged = _metrics_by_step(tmp_path / "r" / "metrics.jsonl")
    for step, (returns, values, stats) in enumerate(seen, start=1):
        by_hand = 1 - (returns - values).var(unbiased=False) / returns.var(unbiased=False)
        assert logged[step]["train/explained_variance"] == pytest.approx(by_hand.item(), abs=1e-9)
        assert logged[step]["train/ratio_max"] == stats["ratio_max"] >= 1.0


def test_a_negative_entropy_coef_penalises_entropy(cache_dir, tmp_path):
    """``ppo.entropy_coef`` below 0 is an entropy penalty: it changes the actor's gradient
    as a bonus does (it was taken without a gradient, so it changed only the logged loss)."""
    grads = {}
    for coef in ("0.0", "-0.05", "0.05"):
        run(cache_dir, tmp_path / coef, "steps=1", f"ppo.entropy_coef={coef}")
        grads[coef] = _metrics_by_step(tmp_path / coef / "metrics.jsonl")[1]["grad_norm/actor"]
    assert abs(grads["-0.05"] - grads["0.0"]) > 1e-4
    assert abs(grads["0.05"] - grads["0.0"]) > 1e-4


def test_user_prompts_file_and_tiny_random_models(tmp_path):
    """Models built from config (no checkpoint) and a user's jsonl prompts with a tokenizer
    directory: the path a user with their own data takes; no gold score without the rule.
    The prompts go into data.input_template (its text before and after each prompt)."""
    from oppo_ds.workload import build_tokenizer

    tok_dir = tmp_path / "tok"
    build_tokenizer().save_pretrained(str(tok_dir))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"a b c -> {x}"}) + "\n" for x in "abcdefgh"))
    _, summary = run(str(tmp_path / "unused-cache"), tmp_path / "run", "steps=2",
                     "model.actor=tiny-qwen2", "model.reward=tiny-qwen2",
                     f"model.tokenizer={tok_dir}", f"data.prompts={prompts}",
                     "checkpoint.export_hf=false", "data.input_template='warm {} cool'",
                     "logging.samples=8", "logging.samples_every=1")
    assert summary["steps"] == 2
    assert "gold_first10" not in summary
    samples = read_history(str(tmp_path / "run" / "samples.jsonl"))
    assert len(samples) == 16
    assert all(re.fullmatch(r"warm a b c -> [a-h] cool", s["prompt"]) for s in samples), samples[0]
    assert not os.path.exists(tmp_path / "unused-cache")  # nothing was prepared


def test_max_samples_trains_on_the_first_prompts_read(tmp_path):
    """data.max_samples=4 (OpenRLHF's --max_samples) of two files of 6 prompts: the run draws
    the first file's first 4 and no other, and counts 4 prompts; a malformed row past them
    still stops the run naming file and line, before any engine."""
    from oppo_ds.datafiles import DataError
    from oppo_ds.workload import build_tokenizer

    tok_dir = tmp_path / "tok"
    build_tokenizer().save_pretrained(str(tok_dir))
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(json.dumps({"prompt": f"a b c -> {x}"}) + "\n" for x in "abcdef"))
    second.write_text("".join(json.dumps({"prompt": f"a b c -> {x}"}) + "\n" for x in "ghijkl"))
    common = ["model.actor=tiny-qwen2", "model.reward=tiny-qwen2", f"model.tokenizer={tok_dir}",
              f"data.prompts=[{first},{second}]", "data.max_samples=4", "checkpoint.export_hf=false"]
    trainer, _ = run(str(tmp_path / "unused-cache"), tmp_path / "run", "steps=2", *common,
                     "logging.samples=8", "logging.samples_every=1")
    assert len(trainer.prompts) == 4
    samples = read_history(str(tmp_path / "run" / "samples.jsonl"))
    assert len(samples) == 16 and {s["prompt"][-1] for s in samples} == set("abcd")
    second.write_text(second.read_text() + "{not json\n")
    with pytest.raises(DataError, match=r"second.jsonl:7: invalid JSON"):
        run(str(tmp_path / "unused-cache"), tmp_path / "bad", "steps=1", *common)


def test_a_reward_function_scores_in_place_of_the_reward_model(cache_dir, tmp_path):
    """model.reward_function=oppo_ds.workload:gold_reward: no reward model is built, every
    step's reward is the gold rule's score (to the float), the held-out evaluation's too; with
    the reference and critic streaming (colocated) the run is the sequential one (1e-5: the
    streamed prefill's summation order), and the rollout pool under GRPO's group baseline
    carries rows and scores what it takes by the rule."""
    fn = "model.reward_function=oppo_ds.workload:gold_reward"
    trainer, _ = run(cache_dir, tmp_path / "seq", "steps=2", "checkpoint.export_hf=false", fn,
                     "eval.prompts=builtin", "eval.num_prompts=8")
    assert trainer.reward is None and trainer.reward_fn is not None
    seq = _metrics_by_step(tmp_path / "seq" / "metrics.jsonl")
    assert all(r["reward/mean"] == pytest.approx(r["gold/mean"], abs=1e-6) for r in seq.values())
    evals = read_history(str(tmp_path / "seq" / "eval.jsonl"))
    assert len(evals) == 2 and all(e["eval/reward_mean"] == pytest.approx(e["eval/gold_mean"], abs=1e-6)
                                   for e in evals)
    run(cache_dir, tmp_path / "stream", "steps=2", "checkpoint.export_hf=false", fn,
        "oppo.streaming=true", "oppo.chunk_size=3", "oppo.placement=colocated",
        "oppo.stream_to=[reference,critic]")
    stream = _metrics_by_step(tmp_path / "stream" / "metrics.jsonl")
    for step in (1, 2):
        assert stream[step]["response/lengths"] == seq[step]["response/lengths"]
        for key in ("reward/mean", "kl/mean", "value/mean", "loss/policy"):
            assert stream[step][key] == pytest.approx(seq[step][key], abs=1e-5), (step, key)
        assert stream[step]["stream/scorer_busy_s"] > 0
    run(cache_dir, tmp_path / "pool", "steps=3", "checkpoint.export_hf=false", fn,
        "ppo.advantage_estimator=group_norm", "data.samples_per_prompt=4", "oppo.overcommit=4")
    pool = _metrics_by_step(tmp_path / "pool" / "metrics.jsonl")
    assert any(r["pool/carried"] > 0 for r in pool.values())
    assert all(r["reward/mean"] == pytest.approx(r["gold/mean"], abs=1e-6) for r in pool.values())


def test_a_reward_function_file_gets_each_prompts_fields(tmp_path):
    """A reward function in a file of the user's, on their jsonl prompts with an `answer`
    field (missing from one row) and random tiny models, critic-free: every logged sample's
    reward is what the function makes of its own prompt's answer (its length, 0 without one),
    under data.samples_per_prompt rows `<id>#k`, also where another row's own id is such a
    sample's (`a#1`: the second sample of row `a` took that row's answer); nothing is
    prepared (no reward model of the built-in task is trained)."""
    from oppo_ds.workload import build_tokenizer

    tok_dir = tmp_path / "tok"
    build_tokenizer().save_pretrained(str(tok_dir))
    answers = {"a": "xy", "b": "xyz", "c": None, "d": "w"}
    ids = {"a": "a", "b": "a#1", "c": "c", "d": "d"}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": ids[x], "prompt": f"a b c -> {x}",
                                           **({"answer": a} if a else {})}) + "\n"
                               for x, a in answers.items()))
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def answer_length(prompts, completions, answer, **_):\n"
                       "    return [len(a or '') for a in answer]\n")
    run(str(tmp_path / "unused-cache"), tmp_path / "run", "steps=2", "model.actor=tiny-qwen2",
        f"model.tokenizer={tok_dir}", f"data.prompts={prompts}", "checkpoint.export_hf=false",
        f"model.reward_function={rewards}:answer_length", "ppo.advantage_estimator=rloo",
        "data.samples_per_prompt=2", "logging.samples=8", "logging.samples_every=1")
    samples = read_history(str(tmp_path / "run" / "samples.jsonl"))
    assert len(samples) == 16 and {s["prompt_id"][-2:] for s in samples} == {"#0", "#1"}
    for s in samples:
        assert s["reward"] == len(answers[s["prompt"][-1]] or "")
    assert not os.path.exists(tmp_path / "unused-cache")


@pytest.mark.parametrize("overrides", [
    ("system.zero_stage=3", "system.hybrid_engine=true"),
    ("system.zero_stage=2", "system.dtype=bf16"),
    ("system.zero_stage=1", "system.dtype=bf16"),
], ids=["zero3-hybrid-engine", "zero2-bf16", "zero1-bf16-fp32-gradients"])
def test_engine_settings_run_the_same_step(cache_dir, tmp_path, overrides):
    """ZeRO-3 under the hybrid engine (CPU: its no-kernel path) and bf16 under ZeRO-2 and
    ZeRO-1 (gradients in fp32: DeepSpeed's BF16 optimizer, for actor and critic) run whole
    steps; fp32 ZeRO-3 must track the ZeRO-0 run closely (partitioning changes only
    summation order), bf16 only loosely (8-bit mantissa)."""
    trainer, summary = run(cache_dir, tmp_path / "run", "steps=2", "checkpoint.export_hf=false", *overrides)
    assert summary["steps"] == 2
    if "system.zero_stage=1" in overrides:
        for engine in (trainer.actor, trainer.critic):
            assert (engine.optimizer_wrapper, engine.grad_accum_dtype) == ("BF16_Optimizer", "fp32")
    history = read_history(str(tmp_path / "run" / "metrics.jsonl"))
    for row in history:
        for key in DETERMINISTIC:
            assert row[key] == row[key], key  # no NaN
    if "system.hybrid_engine=true" in overrides:
        assert summary["hybrid_engine"].startswith("no-kernels")
        _, base = run(cache_dir, tmp_path / "base", "steps=2", "checkpoint.export_hf=false")
        ref = read_history(str(tmp_path / "base" / "metrics.jsonl"))
        for a, b in zip(ref, history):
            assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-4)


def test_close_destroys_the_trainers_engines_and_no_other(cache_dir, tmp_path):
    """PPOTrainer.close() destroys the DeepSpeed engines of its actor, critic and partitioned
    reference (DeepSpeed would keep them for the rest of the process); an engine it did not
    start stays open. A second close() is a no-op."""
    from oppo_ds.engines import open_engines

    first, _ = run(cache_dir, tmp_path / "first", "steps=1", "checkpoint.export_hf=false")
    trainer, summary = run(cache_dir, tmp_path / "run", "steps=1", "checkpoint.export_hf=false",
                           "system.zero_stage=3", "system.partition_reference=true")
    assert summary["steps"] == 1
    own = [trainer.actor.ds_engine, trainer.critic.ds_engine,
           trainer.reference._oppo_zero3_engine]
    assert set(own) <= set(open_engines())
    trainer.close()
    trainer.close()
    assert not set(own) & set(open_engines())
    assert first.actor.ds_engine in open_engines()
    first.close()
    assert first.actor.ds_engine not in open_engines()


def test_deepspeed_config_entries_reach_every_engine(cache_dir, tmp_path):
    """system.deepspeed_config is merged into the DeepSpeed config of the actor, the critic
    and the partitioned reference: DeepSpeed's engines report the values given (ZeRO's bucket
    sizes, its parameter persistence threshold, the gradients' communication dtype), not the
    ones built here."""
    import torch

    trainer, summary = run(
        cache_dir, tmp_path / "run", "steps=1", "checkpoint.export_hf=false",
        "system.zero_stage=3", "system.partition_reference=true",
        "system.deepspeed_config={zero_optimization: {reduce_bucket_size: 12345, "
        "stage3_param_persistence_threshold: 77}, communication_data_type: fp32}")
    assert summary["steps"] == 1
    engines = [trainer.actor.ds_engine, trainer.critic.ds_engine,
               trainer.reference._oppo_zero3_engine]
    for engine in engines:
        assert engine.zero_param_persistence_threshold() == 77
        assert engine.communication_data_type == torch.float32
    assert [e.zero_reduce_bucket_size() for e in engines[:2]] == [12345, 12345]
    trainer.close()


@pytest.mark.parametrize("placement, extra", [
    ("inline", []), ("colocated", []), ("colocated", ["system.switch_interval_ms=0.2"])],
    ids=["inline", "colocated", "colocated-switch-interval"])
def test_streaming_gives_the_sequential_run(cache_dir, tmp_path, placement, extra, monkeypatch):
    """Intra-step overlap changes when scoring happens, not what it computes: with the same
    seed a streamed run samples the same tokens and gets the same scores. Step 1 is compared
    at 1e-5 (scores only; streamed prefill differs from a whole-sequence forward by float
    summation order, measured <= 1.4e-6); later steps at 1e-4, since those tiny differences
    pass through Adam updates. A shorter thread switch interval only changes when the two
    threads take turns: it holds inside each step, and Python's own is back after the run."""
    from oppo_ds.trainer import PPOTrainer

    before, inside, real_step = sys.getswitchinterval(), [], PPOTrainer._step

    def step(trainer):
        inside.append(sys.getswitchinterval())
        return real_step(trainer)
    run(cache_dir, tmp_path / "seq", "steps=3", "checkpoint.export_hf=false")
    monkeypatch.setattr(PPOTrainer, "_step", step)
    run(cache_dir, tmp_path / "stream", "steps=3", "checkpoint.export_hf=false",
        "oppo.streaming=true", "oppo.chunk_size=3", f"oppo.placement={placement}", *extra)
    assert inside == pytest.approx([0.2e-3 if extra else before] * 3)
    assert sys.getswitchinterval() == before
    a = _metrics_by_step(tmp_path / "seq" / "metrics.jsonl")
    b = _metrics_by_step(tmp_path / "stream" / "metrics.jsonl")
    assert b[1]["response/lengths"] == a[1]["response/lengths"]
    _assert_same_training(a, b, steps=(2, 3))
    for step in (1, 2, 3):
        assert 0.0 <= b[step]["stream/scoring_hidden_frac"] <= 1.0
        assert b[step]["stream/scorer_busy_s"] > 0
        assert "stream/scoring_hidden_frac" not in a[step]
        # inline: the scoring before the last token ran between chunks while the actor waited
        between = b[step]["stream/scoring_between_chunks_s"]
        assert between == (pytest.approx(b[step]["stream/scorer_busy_s"]
                                         * b[step]["stream/scoring_hidden_frac"])
                           if placement == "inline" else 0.0)


def test_streaming_only_the_reward_model(cache_dir, tmp_path):
    """oppo.stream_to=[]: the reward model streams, reference and critic score afterwards."""
    run(cache_dir, tmp_path / "seq", "steps=1", "checkpoint.export_hf=false")
    run(cache_dir, tmp_path / "stream", "steps=1", "checkpoint.export_hf=false",
        "oppo.streaming=true", "oppo.stream_to=[]", "oppo.chunk_size=5")
    a = _metrics_by_step(tmp_path / "seq" / "metrics.jsonl")[1]
    b = _metrics_by_step(tmp_path / "stream" / "metrics.jsonl")[1]
    for key in ("reward/mean", "kl/mean", "value/mean", "loss/policy"):
        assert b[key] == pytest.approx(a[key], abs=1e-5), key


def test_chunk_size_auto_and_step_trace(cache_dir, tmp_path):
    """chunk_size=auto calibrates at the smallest and largest candidate, then uses the cost
    model's choice; the trace of a step holds phases, decode chunks and scorer prefills."""
    _, summary = run(cache_dir, tmp_path / "run", "steps=4", "checkpoint.export_hf=false",
                     "oppo.streaming=true", "oppo.chunk_size=auto", "oppo.chunk_candidates=[2,4,8]",
                     "oppo.chunk_explore_every=0", "logging.trace_every=2")
    used = [r["oppo/chunk_size"] for r in read_history(str(tmp_path / "run" / "metrics.jsonl"))]
    assert used[:2] == [2, 8] and used[2] in (2, 4, 8) and used[3] == used[2]
    trace = json.loads((tmp_path / "run" / "traces" / "step2.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"phases", "actor", "reward", "reference", "critic"} <= lanes
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {"generate", "score", "train"} <= {e["name"] for e in spans}
    assert all(e["dur"] >= 0 for e in spans)


# ---- inter-step overlap: the rollout pool -----------------------------------------------


def _record_takes(trainer):
    """Wrap the pool's take to record the sequence ids each step trains on."""
    taken, real_take = [], trainer.pool.take

    def take(*args, **kwargs):
        batch = real_take(*args, **kwargs)
        taken.append([e.uid for e in batch])
        return batch
    trainer.pool.take = take
    return taken


def test_overcommit_loses_nothing_and_trains_nothing_twice(cache_dir, tmp_path):
    """6 steps of B=8 with Delta=4: every sequence drawn is trained exactly once or is still
    in the pool at the end; deferrals happen and stay within max_defer_steps."""
    from oppo_ds.trainer import PPOTrainer

    cfg = load_config(None, SMALL + [f"workload.cache_dir={cache_dir}",
                                     f"logging.output_dir={tmp_path / 'run'}", "steps=6",
                                     "checkpoint.export_hf=false", "oppo.overcommit=4",
                                     "oppo.max_defer_steps=2"])
    trainer = PPOTrainer(cfg)
    taken = _record_takes(trainer)
    summary = trainer.train()
    flat = [uid for step in taken for uid in step]
    assert [len(step) for step in taken] == [8] * 6
    assert len(flat) == len(set(flat))  # nothing twice
    in_pool = [e.uid for e in trainer.pool.entries]
    assert len(in_pool) == 4 and not set(in_pool) & set(flat)
    assert sorted(flat + in_pool) == list(range(trainer.pool.next_uid))  # nothing lost
    trainer.pool.check()
    history = read_history(str(tmp_path / "run" / "metrics.jsonl"))
    assert all(r["pool/size"] == 12 and r["samples"] == 8 for r in history)
    assert max(r["pool/deferred_frac"] for r in history) > 0  # overcommitment did defer
    assert all(r["pool/deferrals_max"] <= 2 for r in history)
    assert all(0.0 <= r["pool/stale_token_frac"] <= 1.0 for r in history)
    deferrals = summary["deferrals"]  # the run's summary counts what the steps logged
    assert deferrals["trained"] == 48 and 0 < deferrals["deferred"] < 48
    assert deferrals["deferred"] == sum(1 for r in history for d in r["pool/deferrals"] if d > 0)


def test_samples_per_prompt_in_rows_trained_once_each(cache_dir, tmp_path):
    """data.samples_per_prompt=2: a step's 8 rows are 4 prompts twice over, as rows `<id>#0`
    and `<id>#1` with different responses; with the rollout pool (B=8, Delta=3: whole prompts
    top it up past B + Delta) every row drawn is trained once or still in the pool, both rows of
    every prompt are drawn, and the ledger balances."""
    from oppo_ds.trainer import PPOTrainer

    run(cache_dir, tmp_path / "plain", "steps=2", "checkpoint.export_hf=false", "data.samples_per_prompt=2",
        "logging.samples=8", "logging.samples_every=1")
    samples = read_history(str(tmp_path / "plain" / "samples.jsonl"))
    assert [s["step"] for s in samples] == [1] * 8 + [2] * 8
    for first, second in zip(samples[::2], samples[1::2]):
        base = first["prompt_id"][:-2]
        assert (first["prompt_id"], second["prompt_id"]) == (base + "#0", base + "#1")
        assert first["prompt"] == second["prompt"]
    assert any(a["response"] != b["response"] for a, b in zip(samples[::2], samples[1::2]))
    assert len({s["prompt_id"][:-2] for s in samples}) == 8  # 4 prompts a step, none again

    cfg = load_config(None, SMALL + [f"workload.cache_dir={cache_dir}", f"logging.output_dir={tmp_path / 'pool'}",
                                     "steps=5", "checkpoint.export_hf=false", "oppo.overcommit=3",
                                     "data.samples_per_prompt=2"])
    trainer = PPOTrainer(cfg)
    taken = _record_takes(trainer)
    trainer.train()
    flat = [uid for step in taken for uid in step]
    assert [len(step) for step in taken] == [8] * 5 and len(flat) == len(set(flat))
    in_pool = [e.uid for e in trainer.pool.entries]
    assert sorted(flat + in_pool) == list(range(trainer.pool.next_uid))
    trainer.pool.check()
    drawn = trainer.pool.ledger.drawn
    assert all(n == 1 for n in drawn.values())
    prompts = {key[:-2] for key in drawn}
    assert all(drawn[p + "#0"] == drawn[p + "#1"] == 1 for p in prompts)
    assert all(r["pool/size"] >= 11 for r in read_history(str(tmp_path / "pool" / "metrics.jsonl")))


def test_resume_refuses_to_drop_or_invent_a_pool(cache_dir, tmp_path):
    """A checkpoint with deferred sequences resumed without overcommitment would drop them:
    refused, naming the key, the checkpoint left as it was; so is a length limit that a
    deferred row already reached, and the reverse (a pool cannot continue a run written
    without one)."""
    from oppo_ds.config import ConfigError

    out = tmp_path / "pool"
    run(cache_dir, out, "steps=2", "checkpoint.every=2", "checkpoint.export_hf=false", "oppo.overcommit=4")
    with pytest.raises(ConfigError, match=r"oppo.overcommit: 0, but checkpoint step2 holds 4 deferred"):
        run(cache_dir, out, "steps=3", "checkpoint.export_hf=false")
    assert (out / "checkpoints" / "latest").read_text().strip() == "step2"
    assert len(read_history(str(out / "metrics.jsonl"))) == 2
    # a deferred row longer than a lowered length limit could not continue: refused too
    longest = max(len(e["tokens"]) for e in torch.load(
        out / "checkpoints" / "trainer" / "step2" / "rank0.pt", weights_only=False)["pool"]["entries"]
        if not e["finished"])
    with pytest.raises(ConfigError, match=rf"generation.max_new_tokens: {longest}, but checkpoint "
                                          rf"step2 holds a deferred sequence of {longest} tokens"):
        run(cache_dir, out, "steps=3", "checkpoint.export_hf=false", "oppo.overcommit=4",
            f"generation.max_new_tokens={longest}")
    assert (out / "checkpoints" / "latest").read_text().strip() == "step2"
    plain = tmp_path / "plain"
    run(cache_dir, plain, "steps=2", "checkpoint.every=2", "checkpoint.export_hf=false")
    with pytest.raises(ConfigError, match=r"oppo.overcommit: 4, but checkpoint step2 has no rollout pool"):
        run(cache_dir, plain, "steps=3", "checkpoint.export_hf=false", "oppo.overcommit=4")


def test_resume_refuses_a_batch_or_bound_that_would_overrun_the_deferral_bound(cache_dir,
                                                                              tmp_path):
    """A checkpoint carrying Delta = 8 deferred rows resumed with a batch of 2 (found by the
    29th session's audit: accepted, then rows trained 4 steps late, `pool/deferrals_max` 4
    with oppo.max_defer_steps 2), or with a bound below what a row was deferred already:
    refused, naming the key; the same settings resume."""
    from oppo_ds.config import ConfigError

    out = tmp_path / "run"
    run(cache_dir, out, "steps=2", "checkpoint.every=2", "checkpoint.export_hf=false",
        "oppo.overcommit=8")
    entries = torch.load(out / "checkpoints" / "trainer" / "step2" / "rank0.pt",
                         weights_only=False)["pool"]["entries"]
    assert len(entries) == 8
    smaller = ["ppo.batch_size=2", "ppo.mini_batch_size=2", "ppo.micro_batch_size=2",
               "oppo.overcommit=1"]
    with pytest.raises(ConfigError, match=r"ppo.batch_size: 2, but checkpoint step2 holds \d+ "
                                          r"deferred sequence\(s\) on a rank that "
                                          r"oppo.max_defer_steps=2 requires trained within the "
                                          r"next \d step\(s\), more than \d step\(s\) of 2 rows "
                                          r"a rank train; resume with the ppo.batch_size it was "
                                          r"written with \(8 a rank\)"):
        run(cache_dir, out, "steps=4", "checkpoint.export_hf=false", *smaller)
    most = max(e["deferrals"] for e in entries)
    with pytest.raises(ConfigError, match=rf"oppo.max_defer_steps: {most - 1}, but checkpoint "
                                          rf"step2 holds a sequence deferred {most} times"):
        run(cache_dir, out, "steps=4", "checkpoint.export_hf=false", "oppo.overcommit=8",
            f"oppo.max_defer_steps={most - 1}")
    assert (out / "checkpoints" / "latest").read_text().strip() == "step2"
    run(cache_dir, out, "steps=3", "checkpoint.export_hf=false", "oppo.overcommit=8")
    history = read_history(str(out / "metrics.jsonl"))
    assert [r["step"] for r in history] == [1, 2, 3]
    assert all(r["pool/deferrals_max"] <= 2 for r in history if "pool/deferrals_max" in r)


def test_a_placement_without_streaming_is_named_in_a_warning(cache_dir, tmp_path, caplog):
    """`oppo.placement: colocated` with streaming off runs the sequential baseline: said once
    at the start (accepted, not refused, so that one set of oppo-bench overrides serves its
    non-streaming modes and the TRL peer; stage without streaming is refused)."""
    with caplog.at_level("WARNING", logger="oppo_ds.trainer"):
        run(cache_dir, tmp_path / "run", "steps=1", "checkpoint.final=false",
            "oppo.placement=colocated")
    assert "oppo.placement=colocated has no effect with oppo.streaming=false" in caplog.text


def test_checkpoint_final_false_saves_only_the_periodic_checkpoints(cache_dir, tmp_path):
    """`checkpoint.final: false` (oppo-bench's timed runs) skips the save after the last step,
    not the ones `every` asks for."""
    out = tmp_path / "periodic"
    run(cache_dir, out, "steps=3", "checkpoint.every=2", "checkpoint.final=false",
        "checkpoint.export_hf=false")
    assert (out / "checkpoints" / "latest").read_text().strip() == "step2"
    assert not (out / "checkpoints" / "trainer" / "step3").exists()
    none = tmp_path / "none"
    run(cache_dir, none, "steps=2", "checkpoint.final=false", "checkpoint.export_hf=false")
    assert len(read_history(str(none / "metrics.jsonl"))) == 2 and not (none / "checkpoints").exists()


def test_resume_refuses_a_checkpoint_written_with_another_prompt_order(cache_dir, tmp_path):
    """The prompt stream's order follows the seed, the prompts and the shuffle setting: a
    resume with another of these would train some prompts twice and skip others, so it is
    refused in one line naming the settings, and the checkpoint is left as it was."""
    from oppo_ds.config import ConfigError

    out = tmp_path / "run"
    run(cache_dir, out, "steps=2", "checkpoint.every=2", "checkpoint.export_hf=false")
    # (the built-in workload draws its prompts with the seed: they differ too)
    with pytest.raises(ConfigError, match=r"checkpoint.resume: checkpoint step2 was written with "
                                          r"seed=0, data.shuffle=True, prompts of fingerprint "
                                          r"[0-9a-f]{16}, this run has seed=3, data.shuffle=False, "
                                          r"prompts of fingerprint [0-9a-f]{16}: the prompts "
                                          r"handed out, and their order, follow them.*; the "
                                          r"same files give other prompts where oppo-ds reads "
                                          r"them otherwise"):
        run(cache_dir, out, "steps=3", "checkpoint.export_hf=false", "seed=3", "data.shuffle=false")
    assert (out / "checkpoints" / "latest").read_text().strip() == "step2"
    run(cache_dir, out, "steps=3", "checkpoint.export_hf=false")  # as written: continues
    assert [r["step"] for r in read_history(str(out / "metrics.jsonl"))] == [1, 2, 3]


def test_resume_refuses_other_prompts_of_the_same_number(tmp_path):
    """A prompt file edited between a run and its resume (as many prompts, one of them
    changed) would hand out other prompts at the saved cursor: refused, naming the prompts'
    fingerprints; the same file moved elsewhere resumes."""
    from oppo_ds.config import ConfigError
    from oppo_ds.workload import build_tokenizer

    tok_dir = tmp_path / "tok"
    build_tokenizer().save_pretrained(str(tok_dir))
    lines = [json.dumps({"prompt": f"a b c -> {x}"}) + "\n" for x in "abcdefgh"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(lines))
    models = ("model.actor=tiny-qwen2", "model.reward=tiny-qwen2", f"model.tokenizer={tok_dir}",
              "checkpoint.export_hf=false", "checkpoint.every=1")
    out = tmp_path / "run"
    run(str(tmp_path / "unused"), out, "steps=1", *models, f"data.prompts={prompts}")
    lines[5] = json.dumps({"prompt": "a b -> c"}) + "\n"
    edited = tmp_path / "edited" / "prompts.jsonl"  # the same name: the same default ids
    edited.parent.mkdir()
    edited.write_text("".join(lines))
    with pytest.raises(ConfigError, match=r"checkpoint step1 was written with prompts of "
                                          r"fingerprint [0-9a-f]{16}, this run has prompts of "
                                          r"fingerprint [0-9a-f]{16}: the prompts handed out"):
        run(str(tmp_path / "unused"), out, "steps=2", *models, f"data.prompts={edited}")
    moved = tmp_path / "moved" / "prompts.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(prompts.read_bytes())
    run(str(tmp_path / "unused"), out, "steps=2", *models, f"data.prompts={moved}")
    assert [r["step"] for r in read_history(str(out / "metrics.jsonl"))] == [1, 2]


def test_resume_refuses_a_checkpoint_of_other_models(cache_dir, tmp_path):
    """A checkpoint's engines hold the actor and critic of the settings it was written with:
    under another architecture or ZeRO stage DeepSpeed failed to load them with a traceback
    (a state_dict size mismatch) or a missing optimizer file. Refused in one line naming each
    setting and what it was, before any engine loads; a checkpoint written before the
    settings were saved still resumes."""
    from oppo_ds.config import ConfigError

    out = tmp_path / "run"
    run(cache_dir, out, "steps=2", "checkpoint.every=2", "checkpoint.export_hf=false")
    with pytest.raises(ConfigError, match=r"^model.builtin_arch: tiny-gpt2, but checkpoint step2 was "
                                          r"written with tiny-llama; system.zero_stage: 2, written "
                                          r"with 0: its actor and critic are those models"):
        run(cache_dir, out, "steps=3", "checkpoint.export_hf=false", "model.builtin_arch=tiny-gpt2",
            "system.zero_stage=2")
    state_file = out / "checkpoints" / "trainer" / "step2" / "rank0.pt"
    state = torch.load(state_file, weights_only=False)
    assert state["settings"]["model.builtin_arch"] == "tiny-llama"
    del state["settings"]  # as written before 2026-11-24
    torch.save(state, state_file)
    run(cache_dir, out, "steps=3", "checkpoint.export_hf=false")
    assert [r["step"] for r in read_history(str(out / "metrics.jsonl"))] == [1, 2, 3]
    # model.critic null: the critic started from the reward model, so another model.reward
    # is another critic source (it resumed the old critic while the log named the new one)
    with pytest.raises(ConfigError, match=r"^model.reward: tiny-llama, but checkpoint step3 was "
                                          r"written with builtin: .* set model.critic to the one it "
                                          r"started from$"):
        run(cache_dir, out, "steps=4", "checkpoint.export_hf=false", "model.reward=tiny-llama")


def test_resume_refuses_gradients_of_another_dtype(cache_dir, tmp_path):
    """``system.grad_accum_dtype`` decides which optimizer DeepSpeed wraps AdamW in under
    bf16 ZeRO-1 (fp32: its BF16 optimizer; bf16: its ZeRO one), whose saved states differ:
    a resume under the other is refused naming the key and what resumes it. A checkpoint
    written before the key existed was never the BF16 optimizer's, and is taken as such."""
    from oppo_ds.config import ConfigError

    out, common = tmp_path / "run", ("checkpoint.export_hf=false", "system.zero_stage=1",
                                     "system.dtype=bf16")
    run(cache_dir, out, "steps=2", "checkpoint.every=2", *common)  # auto: fp32
    with pytest.raises(ConfigError, match=r"^system.grad_accum_dtype: bf16, but checkpoint step2 "
                                          r"was written with fp32 \(DeepSpeed's BF16 optimizer\): "
                                          r"its actor and critic .* resume it with "
                                          r"system.zero_stage 1, system.offload false and "
                                          r"system.grad_accum_dtype auto or fp32$"):
        run(cache_dir, out, "steps=3", *common, "system.grad_accum_dtype=bf16")
    with pytest.raises(ConfigError, match=r"^system.dtype: fp32, but checkpoint step2 was "
                                          r"written with bf16: its actor") as refused:
        run(cache_dir, out, "steps=3", *common[:2], "system.dtype=fp32")
    assert "grad_accum_dtype" not in str(refused.value)  # it follows the dtype: named once
    state_file = out / "checkpoints" / "trainer" / "step2" / "rank0.pt"
    state = torch.load(state_file, weights_only=False)
    written = state["settings"]["system.grad_accum_dtype"]
    assert written == "fp32 (DeepSpeed's BF16 optimizer)"
    del state["settings"]["system.grad_accum_dtype"]  # as written before 2026-11-28
    torch.save(state, state_file)
    with pytest.raises(ConfigError, match=r"^system.grad_accum_dtype: fp32 \(DeepSpeed's BF16 "
                                          r"optimizer\), but checkpoint step2 was written with "
                                          r"bf16: .* resume it with system.grad_accum_dtype "
                                          r"bf16$"):
        run(cache_dir, out, "steps=3", *common)
    state["settings"]["system.grad_accum_dtype"] = written
    torch.save(state, state_file)
    run(cache_dir, out, "steps=3", *common)  # the BF16 optimizer's states load
    assert [r["step"] for r in read_history(str(out / "metrics.jsonl"))] == [1, 2, 3]


def test_resume_refuses_another_lora_scale(cache_dir, tmp_path):
    """model.lora_alpha scales the saved LoRA matrices (s = alpha / rank): resumed under
    another, the model (and its merged export) computed another function, silently. Refused
    like the rank; without LoRA it scales nothing and may change."""
    from oppo_ds.config import ConfigError

    lora = ("checkpoint.every=2", "checkpoint.export_hf=false", "model.actor_lora_dim=2")
    run(cache_dir, tmp_path / "lora", "steps=2", *lora, "model.lora_alpha=16")
    with pytest.raises(ConfigError, match=r"^model.lora_alpha: 4.0, but checkpoint step2 was "
                                          r"written with 16.0"):
        run(cache_dir, tmp_path / "lora", "steps=3", *lora, "model.lora_alpha=4")
    plain = ("checkpoint.export_hf=false",)
    run(cache_dir, tmp_path / "plain", "steps=2", "checkpoint.every=2", *plain)
    run(cache_dir, tmp_path / "plain", "steps=3", *plain, "model.lora_alpha=4")
    assert [r["step"] for r in read_history(str(tmp_path / "plain" / "metrics.jsonl"))] == [1, 2, 3]


def test_streaming_switched_on_and_off_across_resumes_keeps_every_deferred_row(cache_dir, tmp_path):
    """A pool checkpoint resumed with streaming turned on (no scorer holds the deferred rows'
    caches: they prefill them), then with the reference no longer streamed (its carried cache
    is not loaded), then with streaming off (the rows' streamed scores are dropped and whole
    sequences scored): every prompt is still trained exactly once or waits in the pool."""
    from _builders import assert_trained_once

    out = tmp_path / "run"
    common = ("checkpoint.every=1", "checkpoint.export_hf=false", "oppo.overcommit=4",
              "oppo.chunk_size=4")
    run(cache_dir, out, "steps=2", *common)
    run(cache_dir, out, "steps=3", *common, "oppo.streaming=true",
        "oppo.stream_to=[actor,reference,critic]")
    resumed, _ = run(cache_dir, out, "steps=4", *common, "oppo.streaming=true", "oppo.stream_to=[]")
    assert set(resumed.carried_scorers) == {"reward"}
    resumed, _ = run(cache_dir, out, "steps=5", *common)
    assert [r["step"] for r in read_history(str(out / "metrics.jsonl"))] == [1, 2, 3, 4, 5]
    assert_trained_once(out / "checkpoints" / "trainer" / "step5" / "rank0.pt", 8, 5)


def test_resume_at_another_temperature_takes_the_pools_reference_work_anew(cache_dir, tmp_path):
    """generation.temperature may change at a resume, but the reference's work on the deferred
    rows (its carried cache's per-token log-probs, a finished row's results) was done at the
    old one. It is dropped and done anew: the resumed run equals one whose checkpoint never
    held that work (the path of a reference newly streamed), to 1e-6. Before, the carried
    cache refused to load (a ValueError), and the finished rows kept the old log-probs."""
    import shutil

    common = ("checkpoint.every=1", "checkpoint.export_hf=false", "oppo.overcommit=4",
              "oppo.chunk_size=4", "oppo.streaming=true", "oppo.stream_to=[actor,reference]")
    run(cache_dir, tmp_path / "a", "steps=3", *common)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    state_file = tmp_path / "b" / "checkpoints" / "trainer" / "step3" / "rank0.pt"
    state = torch.load(state_file, weights_only=False)
    assert state["scorers"]["reference"]["rows"]  # running rows the reference has prefilled
    assert state["scorer_inputs"]["reference"][1] == 1.0
    finished = [e for e in state["pool"]["entries"] if "reference" in e["results"]]
    assert finished  # and finished rows with their log-probs, waiting to be taken
    for e in finished:
        del e["results"]["reference"]
    del state["scorers"]["reference"], state["scorer_inputs"]
    state["objective"]["generation.temperature"] = 0.7  # as if written at this run's
    torch.save(state, state_file)

    hotter = ("steps=4", *common, "generation.temperature=0.7")
    a, _ = run(cache_dir, tmp_path / "a", *hotter)
    b, _ = run(cache_dir, tmp_path / "b", *hotter)
    ra = _metrics_by_step(tmp_path / "a" / "metrics.jsonl")[4]
    rb = _metrics_by_step(tmp_path / "b" / "metrics.jsonl")[4]
    assert ra["response/lengths"] == rb["response/lengths"]
    for key in DETERMINISTIC + ("kl/mean",):
        assert ra[key] == pytest.approx(rb[key], abs=1e-6), key
    assert [e.uid for e in a.pool.entries] == [e.uid for e in b.pool.entries]


def test_overcommit_resume_continues_exactly(cache_dir, tmp_path):
    """A run with deferred sequences in its pool, killed after its step-3 checkpoint and
    resumed, continues exactly (1e-6, as the sequential resume test): the pool, the ledger and
    Delta's controller come back with the engines."""
    over = ("steps=6", "checkpoint.every=3", "checkpoint.export_hf=false", "oppo.overcommit=auto",
            "oppo.delta_max=4", "oppo.delta_window=2")
    full, _ = run(cache_dir, tmp_path / "full", *over)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cache_dir, tmp_path / "cut", *over, crash_after=4)
    saved = torch.load(tmp_path / "cut" / "checkpoints" / "trainer" / "step3" / "rank0.pt",
                       weights_only=False)
    assert saved["pool"]["entries"] and saved["delta_ctl"] is not None
    resumed, _ = run(cache_dir, tmp_path / "cut", *over)
    a, b = _metrics_by_step(tmp_path / "full" / "metrics.jsonl"), _metrics_by_step(tmp_path / "cut" / "metrics.jsonl")
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert b[step]["response/lengths"] == a[step]["response/lengths"]
        for key in DETERMINISTIC + ("pool/delta", "pool/stale_token_frac", "pool/deferred_frac"):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-6), (step, key)
    assert [e.uid for e in resumed.pool.entries] == [e.uid for e in full.pool.entries]
    assert [e.tokens for e in resumed.pool.entries] == [e.tokens for e in full.pool.entries]
    assert resumed.pool.ledger.state_dict() == full.pool.ledger.state_dict()
    # Delta followed the reward trend and logged it (window 2 over 6 steps: 3 decisions)
    assert len({a[s]["pool/delta"] for s in a}) >= 2


def test_truncated_importance_sampling_option(cache_dir, tmp_path):
    """Truncated importance sampling weights the loss by pi_old / mu, clipped: fresh tokens
    weigh ~1, so its mean stays within [0, is_clip] and near 1."""
    run(cache_dir, tmp_path / "is", "steps=3", "checkpoint.export_hf=false", "oppo.overcommit=4",
        "oppo.off_policy=truncated_is", "oppo.is_clip=1.5")
    history = read_history(str(tmp_path / "is" / "metrics.jsonl"))
    for r in history:
        assert 0.0 < r["train/is_weight_mean"] <= 1.5
    assert history[0]["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)  # step 1: all fresh


def test_missing_eos_penalty_lowers_only_truncated_responses(cache_dir, tmp_path):
    """ppo.missing_eos_penalty: the same responses and reward-model scores (the penalty is
    not in reward/mean), a different update where responses hit the 24-token limit without
    <eos>; the share of those is logged either way."""
    trainer, _ = run(cache_dir, tmp_path / "plain", "steps=1", "checkpoint.export_hf=false",
                     "logging.samples=8", "logging.samples_every=1")
    run(cache_dir, tmp_path / "penalty", "steps=1", "checkpoint.export_hf=false",
        "ppo.missing_eos_penalty=2.0")
    plain, penalty = (read_history(str(tmp_path / d / "metrics.jsonl"))[0] for d in ("plain", "penalty"))
    samples = read_history(str(tmp_path / "plain" / "samples.jsonl"))
    truncated = [not s["ended"] for s in samples]
    assert plain["response/truncated_frac"] == pytest.approx(sum(truncated) / len(truncated))
    assert 0 < plain["response/truncated_frac"] < 1  # the tail reaches the limit here
    assert penalty["response/lengths"] == plain["response/lengths"]
    assert penalty["reward/mean"] == plain["reward/mean"]
    assert penalty["response/truncated_frac"] == plain["response/truncated_frac"]
    assert penalty["loss/value"] != pytest.approx(plain["loss/value"], rel=1e-3)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_masked_truncated_responses_train_the_actor_as_if_absent(cache_dir, tmp_path, mode):
    """ppo.mask_truncated_completions: the step's actor update on a batch with truncated
    responses is the update on that batch with their rows taken out after the advantages
    (only the padded width and the summation order differ), under the token mean and
    both per-response means (the loss counts the remaining tokens and responses); without the
    option the update is another. The critic still trains on them: its loss is the full
    batch's."""
    from oppo_ds.trainer import PPOTrainer

    truncated = {}

    def one_step(name, extra, drop_truncated):
        cfg = load_config(None, SMALL + [f"workload.cache_dir={cache_dir}", "steps=1",
                                         f"logging.output_dir={tmp_path / name}",
                                         "checkpoint.export_hf=false", "ppo.mini_batch_size=8",
                                         "ppo.micro_batch_size=8", f"ppo.loss_agg_mode={mode}", *extra])
        trainer = PPOTrainer(cfg)
        real = trainer.update

        def update(exp):
            rows = trainer._truncated(exp)
            truncated[name] = rows
            if drop_truncated:
                exp = exp.select(torch.nonzero(~rows).squeeze(1))
            return real(exp)
        trainer.update = update
        trainer.train()
        weights = {k: v.detach().clone() for k, v in trainer.actor.module.state_dict().items()}
        return weights, read_history(str(tmp_path / name / "metrics.jsonl"))[0]

    masked, masked_log = one_step("masked", ["ppo.mask_truncated_completions=true"], False)
    dropped, dropped_log = one_step("dropped", [], True)
    plain, plain_log = one_step("plain", [], False)
    assert torch.equal(truncated["masked"], truncated["dropped"])
    assert 0 < int(truncated["masked"].sum()) < len(truncated["masked"])  # both kinds of rows
    # Adam's first step moves a weight by about ppo.actor_lr (5e-4) whatever its gradient's
    # size; one whose gradient is near Adam's eps shows the summation order: 1e-5 is 2% of it
    for key in masked:
        torch.testing.assert_close(masked[key], dropped[key], atol=1e-5, rtol=0)
    assert max((masked[k] - plain[k]).abs().max().item() for k in masked) > 2e-4
    assert masked_log["loss/policy"] == pytest.approx(dropped_log["loss/policy"], abs=1e-6)
    assert masked_log["grad_norm/actor"] == pytest.approx(dropped_log["grad_norm/actor"], rel=1e-5)
    assert masked_log["loss/value"] == pytest.approx(plain_log["loss/value"], abs=1e-6)
    assert masked_log["response/truncated_frac"] == plain_log["response/truncated_frac"] > 0


def test_overlong_penalty_lowers_each_reward_by_its_length(cache_dir, tmp_path):
    """ppo.overlong_buffer_len=12 of the 24-token limit, factor 0.5: the same responses and
    scores as a run without it; each response's reward at its last token is lower by exactly
    0.5 x (length - 12) / 12 for lengths past 12 and unchanged otherwise (1e-6), the other
    tokens' rewards (the KL) are untouched, and the logged mean penalty is theirs."""
    from oppo_ds.trainer import PPOTrainer

    seen = {}
    for name, extra in (("plain", []), ("overlong", ["ppo.overlong_buffer_len=12",
                                                      "ppo.overlong_penalty_factor=0.5"])):
        cfg = load_config(None, SMALL + [f"workload.cache_dir={cache_dir}", "steps=1",
                                         f"logging.output_dir={tmp_path / name}",
                                         "checkpoint.export_hf=false", *extra])
        trainer = PPOTrainer(cfg)
        real = trainer.compute_advantages

        def compute_advantages(exp, real=real, name=name):
            real(exp)
            seen[name] = (exp.response_mask.sum(-1), exp.scores.clone(), exp.rewards.clone())
        trainer.compute_advantages = compute_advantages
        trainer.train()
    (lengths, scores, plain), (lengths2, scores2, shaped) = seen["plain"], seen["overlong"]
    assert torch.equal(lengths, lengths2) and torch.equal(scores, scores2)
    expected = 0.5 * (lengths.double() - 12).clamp(min=0) / 12
    assert (expected > 0).any() and (expected == 0).any()  # the batch has rows on both sides
    last = lengths.long() - 1
    rows = torch.arange(len(lengths))
    drop = plain[rows, last].double() - shaped[rows, last].double()
    torch.testing.assert_close(drop, expected, atol=1e-6, rtol=0)
    plain[rows, last] = shaped[rows, last] = 0
    torch.testing.assert_close(plain, shaped, atol=0, rtol=0)
    history = {n: read_history(str(tmp_path / n / "metrics.jsonl"))[0] for n in seen}
    assert "reward/overlong_penalty" not in history["plain"]
    assert history["overlong"]["reward/overlong_penalty"] == pytest.approx(expected.mean().item())
    assert history["overlong"]["reward/mean"] == history["plain"]["reward/mean"]


def test_freeze_actor_steps_trains_only_the_critic_first(cache_dir, tmp_path):
    """ppo.freeze_actor_steps=2: the actor's weights are the starting ones, exactly, after
    steps 1 and 2 and change in step 3; the critic trains from step 1; the frozen steps log no
    policy loss. With the rollout pool, tokens sampled while the actor was frozen are not
    stale: the unfrozen pool run of the same seed counts some."""
    from oppo_ds.config import load_config
    from oppo_ds.trainer import PPOTrainer

    cfg = load_config(None, SMALL + [f"workload.cache_dir={cache_dir}", f"logging.output_dir={tmp_path / 'run'}",
                                     "steps=3", "ppo.freeze_actor_steps=2", "checkpoint.export_hf=false"])
    trainer = PPOTrainer(cfg)

    def weights(engine):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    seen = [(weights(trainer.actor), weights(trainer.critic))]
    real_update = trainer.update

    def update(exp):
        stats = real_update(exp)
        seen.append((weights(trainer.actor), weights(trainer.critic)))
        return stats
    trainer.update = update
    trainer.train()

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)
    (actor0, critic0), (actor1, critic1), (actor2, _), (actor3, _) = seen
    assert same(actor0, actor1) and same(actor0, actor2) and not same(actor0, actor3)
    assert not same(critic0, critic1)
    rows = read_history(str(tmp_path / "run" / "metrics.jsonl"))
    assert ["loss/policy" in r for r in rows] == [False, False, True]
    assert all("loss/value" in r and "grad_norm/critic" in r for r in rows)
    assert ["grad_norm/actor" in r for r in rows] == [False, False, True]

    pool = ("steps=3", "oppo.overcommit=4", "checkpoint.export_hf=false")
    run(cache_dir, tmp_path / "frozen", *pool, "ppo.freeze_actor_steps=3")
    run(cache_dir, tmp_path / "trained", *pool)
    frozen, trained = (read_history(str(tmp_path / d / "metrics.jsonl")) for d in ("frozen", "trained"))
    assert any(r["pool/carried"] > 0 for r in frozen)
    assert all(r["pool/stale_token_frac"] == 0 for r in frozen)
    assert any(r["pool/stale_token_frac"] > 0 for r in trained)


def test_checkpoints_in_hf_format_are_kept_with_their_checkpoints(cache_dir, tmp_path):
    """checkpoint.save_hf: each checkpoint's models in HF format under checkpoints/hf/<tag>,
    loadable by transformers; the last one is the final export's weights exactly, an earlier
    one is another policy, and they go when keep_last removes their checkpoint."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    every = ("checkpoint.every=2", "checkpoint.keep_last=2", "checkpoint.save_hf=true")
    run(cache_dir, out, "steps=4", *every)
    hf = out / "checkpoints" / "hf"
    assert sorted(os.listdir(hf)) == ["step2", "step4"]  # no temporary folder left

    def actor(path):
        return load_file(str(path / "actor" / "model.safetensors"))
    final, step2, step4 = actor(out), actor(hf / "step2"), actor(hf / "step4")
    assert all(torch.equal(final[k], step4[k]) for k in final)
    assert any(not torch.equal(step2[k], step4[k]) for k in final)
    assert sorted(os.listdir(hf / "step4")) == ["actor", "critic"]
    model = AutoModelForCausalLM.from_pretrained(str(hf / "step2" / "actor"))
    assert model.generation_config.eos_token_id is not None

    (hf / ".step5.tmp" / "actor").mkdir(parents=True)  # as an export cut short by a crash leaves it
    run(cache_dir, out, "steps=6", *every)  # resumed: step 6's checkpoint pushes step 2's out
    assert sorted(os.listdir(hf)) == ["step4", "step6"]
    assert sorted(os.listdir(out / "checkpoints" / "trainer")) == ["step4", "step6"]


def test_clip_higher_and_dual_clip_reach_the_policy_loss(cache_dir, tmp_path):
    """ppo.clip_eps_high and ppo.dual_clip go to the policy loss (its hand values are in
    test_algo): the same responses as without them, another update; the dual clip's share is
    logged. A clip-higher bound equal to clip_eps is the default exactly."""
    base = ("steps=2", "checkpoint.export_hf=false", "ppo.ppo_epochs=4", "ppo.mini_batch_size=4",
            "ppo.actor_lr=5e-3")
    run(cache_dir, tmp_path / "plain", *base)
    run(cache_dir, tmp_path / "same", *base, "ppo.clip_eps_high=0.2")
    run(cache_dir, tmp_path / "both", *base, "ppo.clip_eps_high=0.28", "ppo.dual_clip=1.5")
    plain, same, both = (read_history(str(tmp_path / d / "metrics.jsonl")) for d in ("plain", "same", "both"))
    assert [r["loss/policy"] for r in same] == [r["loss/policy"] for r in plain]
    assert both[0]["response/lengths"] == plain[0]["response/lengths"]
    assert both[1]["loss/policy"] != pytest.approx(plain[1]["loss/policy"], rel=1e-6)
    assert all(0.0 <= r["policy/dual_clip_frac"] <= 1.0 for r in both)
    assert "policy/dual_clip_frac" not in plain[0]


def test_kl_in_the_loss_leaves_the_rewards_to_the_score(cache_dir, tmp_path, monkeypatch):
    """ppo.kl_penalty: loss: GAE gets the (clipped) score at each response's last token and
    nothing else, the actor's loss gets the KL (loss/kl logged), and kl/mean is the same
    measurement as with the KL in the rewards (step 1: the same responses, 1e-6)."""
    import oppo_ds.ppo_update as update_module

    seen = []
    real_gae = update_module.gae_advantages

    def gae(rewards, values, mask, *args):
        seen.append((rewards.clone(), mask.clone()))
        return real_gae(rewards, values, mask, *args)
    monkeypatch.setattr(update_module, "gae_advantages", gae)
    common = ("steps=2", "checkpoint.export_hf=false", "ppo.kl_estimator=k3", "ppo.kl_coef=0.2")
    run(cache_dir, tmp_path / "loss", *common, "ppo.kl_penalty=loss")
    rewards, mask = seen[0]
    last = mask.sum(1).long() - 1
    off_last = mask.bool().clone()
    off_last[torch.arange(len(last)), last] = False
    assert rewards[off_last].abs().max().item() == 0.0  # no per-token penalty
    assert rewards[torch.arange(len(last)), last].abs().max().item() > 0
    run(cache_dir, tmp_path / "reward", *common)
    loss, reward = (read_history(str(tmp_path / d / "metrics.jsonl")) for d in ("loss", "reward"))
    assert loss[0]["response/lengths"] == reward[0]["response/lengths"]
    assert loss[0]["kl/mean"] == pytest.approx(reward[0]["kl/mean"], abs=1e-6)
    assert all("loss/kl" in r and r["loss/kl"] >= 0 for r in loss)  # k3 >= 0
    assert "loss/kl" not in reward[0]


def test_reward_normalize_uses_the_reward_models_own_statistics(cache_dir, tmp_path):
    """model.reward_normalize with a reward checkpoint whose config.json holds OpenRLHF's
    `mean` and `std` (a list of one, as some of its versions write): step 1 trains on the
    same responses with rewards (score - 2) / 4 (1e-5: float32); the held-out answers before
    training too (after it the two actors differ: they trained on other rewards). A
    checkpoint without them, or with std 0, stops the run before any engine, naming the key."""
    import shutil

    from oppo_ds.config import ConfigError

    trainer, _ = run(cache_dir, tmp_path / "plain", "steps=1", "checkpoint.export_hf=false",
                     "eval.prompts=builtin", "eval.num_prompts=4")
    reward = tmp_path / "reward"
    shutil.copytree(trainer.sources.reward, reward)
    config = json.loads((reward / "config.json").read_text())
    (reward / "config.json").write_text(json.dumps({**config, "mean": [2.0], "std": [4.0]}))
    run(cache_dir, tmp_path / "normal", "steps=1", "checkpoint.export_hf=false", "eval.prompts=builtin",
        "eval.num_prompts=4", f"model.reward={reward}", f"model.critic={trainer.sources.reward}",
        "model.reward_normalize=true")
    (plain,), (normal,) = (read_history(str(tmp_path / d / "metrics.jsonl")) for d in ("plain", "normal"))
    assert normal["response/lengths"] == plain["response/lengths"]
    assert normal["reward/mean"] == pytest.approx((plain["reward/mean"] - 2.0) / 4.0, abs=1e-5)
    plain_eval, normal_eval = (read_history(str(tmp_path / d / "eval_samples.jsonl")) for d in ("plain", "normal"))
    before = [(a, b) for a, b in zip(plain_eval, normal_eval) if a["step"] == 0]
    assert len(before) == 4
    for a, b in before:
        assert (b["step"], b["response"]) == (0, a["response"])
        assert b["reward"] == pytest.approx((a["reward"] - 2.0) / 4.0, abs=1e-5)

    (reward / "config.json").write_text(json.dumps({**config, "mean": 1.0, "std": 0.0}))
    with pytest.raises(ConfigError, match=r"^model\.reward_normalize: .*std is 0.0, it must be > 0"):
        run(cache_dir, tmp_path / "bad", "steps=1", f"model.reward={reward}", "model.reward_normalize=true")
    with pytest.raises(ConfigError, match=r"^model\.reward_normalize: true, but .* holds no `mean`"):
        run(cache_dir, tmp_path / "none", "steps=1", "model.reward_normalize=true")


def test_whiten_rewards_rescales_what_gae_gets(cache_dir, tmp_path, monkeypatch):
    """ppo.whiten_rewards: GAE gets the KL-shaped rewards rescaled to unit variance over the
    batch's response tokens with their mean kept, zero at padding (1e-5: float32)."""
    import oppo_ds.ppo_update as update_module

    shaped, seen = [], []
    real_shaped, real_gae = update_module.kl_shaped_rewards, update_module.gae_advantages

    def shaping(*args, **kwargs):
        rewards, stats = real_shaped(*args, **kwargs)
        shaped.append((rewards.clone(), args[3].clone()))
        return rewards, stats

    def gae(rewards, *args):
        seen.append(rewards.clone())
        return real_gae(rewards, *args)
    monkeypatch.setattr(update_module, "kl_shaped_rewards", shaping)
    monkeypatch.setattr(update_module, "gae_advantages", gae)
    run(cache_dir, tmp_path / "run", "steps=2", "checkpoint.export_hf=false", "ppo.whiten_rewards=true")
    assert len(shaped) == len(seen) == 2
    for (raw, mask), got in zip(shaped, seen):
        valid = mask.bool()
        values = raw[valid].double()
        mean, var = values.mean(), values.var()  # unbiased, as the trainer's
        want = (raw.double() - mean) / torch.sqrt(var + 1e-8) + mean
        torch.testing.assert_close(got[valid].double(), want[valid], atol=1e-5, rtol=1e-5)
        assert got[~valid].abs().max().item() == 0.0
        assert got[valid].double().mean().item() == pytest.approx(mean.item(), abs=1e-5)
        assert got[valid].double().std().item() == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("placement", ["inline", "colocated"])
def test_streaming_pool_gives_the_pool_run(cache_dir, tmp_path, placement):
    """Full OPPO (streaming + overcommitment) computes what overcommitment alone does: the
    carried reward / reference caches and the critic rebuilt from prefixes give the scores of
    whole-sequence scoring. Same tolerances as the streaming test (1e-5 at step 1, 1e-4 after
    Adam updates)."""
    over = ("steps=4", "checkpoint.export_hf=false", "oppo.overcommit=4")
    run(cache_dir, tmp_path / "pool", *over)
    run(cache_dir, tmp_path / "oppo", *over, "oppo.streaming=true", "oppo.chunk_size=3",
        f"oppo.placement={placement}")
    a = _metrics_by_step(tmp_path / "pool" / "metrics.jsonl")
    b = _metrics_by_step(tmp_path / "oppo" / "metrics.jsonl")
    _assert_same_training(a, b, steps=(2, 3, 4))
    assert all(b[step]["pool/deferrals"] == a[step]["pool/deferrals"] for step in (2, 3, 4))
    assert max(r["pool/deferred_frac"] for r in b.values()) > 0
    assert all(0.0 <= r["stream/scoring_hidden_frac"] <= 1.0 for r in b.values())


@pytest.mark.parametrize("overcommit", [0, 4])
def test_decoding_in_blocks_trains_what_it_trains_with_any_block(cache_dir, tmp_path, overcommit):
    """``generation.sync_every`` > 1 (one host check of ended rows every N tokens) samples the
    same whatever N, with or without streaming: a run checking every 5 tokens and a streamed
    one in chunks of 8 checking every 16 (blocks of 8), with the pool (its stop rule settled
    once a block) and without: the same training (``_assert_same_training``)."""
    over = ("steps=3", "checkpoint.export_hf=false", f"oppo.overcommit={overcommit}")
    run(cache_dir, tmp_path / "five", *over, "generation.sync_every=5")
    run(cache_dir, tmp_path / "sixteen", *over, "generation.sync_every=16",
        "oppo.streaming=true", "oppo.chunk_size=8")
    a = _metrics_by_step(tmp_path / "five" / "metrics.jsonl")
    b = _metrics_by_step(tmp_path / "sixteen" / "metrics.jsonl")
    _assert_same_training(a, b, steps=(1, 2, 3))
    if overcommit:
        assert max(r["pool/deferred_frac"] for r in b.values()) > 0


@pytest.mark.parametrize("overcommit", [0, 4])
def test_static_cache_trains_what_the_default_decode_trains(cache_dir, tmp_path, overcommit,
                                                            monkeypatch):
    """``generation.static_cache`` (every decode forward of one shape, ended rows kept in the
    batch; its buffers reused from step to step) samples and trains what the default decode
    does: the sequential run, and full OPPO whose pool continues deferred prefixes in the
    static cache (``_assert_same_training``)."""
    over = ("steps=3", "checkpoint.export_hf=false", f"oppo.overcommit={overcommit}",
            *(("oppo.streaming=true", "oppo.chunk_size=5") if overcommit else ()))
    from oppo_ds.rollout import static_decode
    from oppo_ds.rollout.static_length import LENGTH_ROUND

    run(cache_dir, tmp_path / "default", *over)
    monkeypatch.setattr(static_decode, "_KEEP_WITHOUT_GRAPH", True)  # kept as with a graph
    trainer, _ = run(cache_dir, tmp_path / "static", *over, "generation.static_cache=true")
    kept = static_decode._KEPT[trainer.actor.module]  # the actor decoded in static buffers
    assert kept.length % LENGTH_ROUND == 0 and not kept.cuda_graph
    a = _metrics_by_step(tmp_path / "default" / "metrics.jsonl")
    b = _metrics_by_step(tmp_path / "static" / "metrics.jsonl")
    _assert_same_training(a, b, steps=(1, 2, 3))
    if overcommit:
        assert max(r["pool/deferred_frac"] for r in b.values()) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is seen")
def test_cuda_graph_without_a_gpu_stops_before_anything_is_built(tmp_path, monkeypatch):
    """Refused before the workload is prepared or any engine built (a ConfigError, not the
    AssertionError of the patched preparation)."""
    from oppo_ds.config import ConfigError

    def no_build(*args, **kwargs):
        raise AssertionError("the workload was prepared before the refusal")
    monkeypatch.setattr("oppo_ds.trainer.resolve_sources", no_build)
    with pytest.raises(ConfigError, match="generation.cuda_graph: needs a CUDA GPU"):
        run(str(tmp_path / "cache"), tmp_path / "out", "generation.static_cache=true",
            "generation.cuda_graph=true")


def test_streaming_pool_resume_continues(cache_dir, tmp_path):
    """The frozen scorers' caches of deferred rows are saved with the pool and loaded back.
    Tolerance 1e-5: the loaded caches hold each row's positions packed (no padding columns),
    which changes the float summation order of attention (measured ~1e-6 on scores)."""
    over = ("steps=6", "checkpoint.every=3", "checkpoint.export_hf=false", "oppo.overcommit=4",
            "oppo.streaming=true", "oppo.chunk_size=4")
    run(cache_dir, tmp_path / "full", *over)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cache_dir, tmp_path / "cut", *over, crash_after=4)
    saved = torch.load(tmp_path / "cut" / "checkpoints" / "trainer" / "step3" / "rank0.pt",
                       weights_only=False)
    assert saved["scorers"]["reward"]["rows"] and saved["scorers"]["reference"]["rows"]
    run(cache_dir, tmp_path / "cut", *over)
    a, b = _metrics_by_step(tmp_path / "full" / "metrics.jsonl"), _metrics_by_step(tmp_path / "cut" / "metrics.jsonl")
    for step in (4, 5, 6):
        assert b[step]["response/lengths"] == a[step]["response/lengths"]
        for key in DETERMINISTIC:
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-5), (step, key)


@pytest.mark.parametrize("overcommit", [0, 4])
def test_streamed_actor_logprobs_are_the_recomputed_ones(cache_dir, tmp_path, overcommit):
    """oppo.stream_to holding actor (the default): every step's old log-probs come from the
    actor's decode (with overcommitment: a deferred row's carried tokens from the prefill that
    rebuilt its cache after the update, a row that finished in an earlier step recomputed).
    Checked inside the run, step by step, against the recomputation of the same batch under
    the same weights: within 1e-5."""
    from oppo_ds.trainer import PPOTrainer

    cfg = load_config(None, SMALL + [f"workload.cache_dir={cache_dir}",
                                     f"logging.output_dir={tmp_path / 'run'}", "steps=4",
                                     "checkpoint.export_hf=false", "oppo.streaming=true",
                                     "oppo.chunk_size=3", f"oppo.overcommit={overcommit}"])
    assert cfg.oppo.streams_actor
    trainer = PPOTrainer(cfg)
    assert trainer.actor_streams  # no inference kernels on a CPU
    real = trainer.make_experience
    diffs, recomputed_rows = [], 0

    def make_experience(keys, gen, streamed=None):
        nonlocal recomputed_rows
        exp = real(keys, gen, streamed)
        got = streamed["actor"]
        if isinstance(got, list):
            recomputed_rows += sum(r is None for r in got)
        without = {k: v for k, v in streamed.items() if k != "actor"}
        again = real(keys, gen, without).old_logprobs
        on = exp.response_mask.bool()
        diffs.append(float((exp.old_logprobs - again)[on].abs().max()))
        return exp
    trainer.make_experience = make_experience
    trainer.train()
    assert len(diffs) == 4 and max(diffs) < 1e-5, diffs
    if overcommit:
        history = read_history(str(tmp_path / "run" / "metrics.jsonl"))
        # carried tokens were trained on, so the rebuild prefill's log-probs were used
        assert max(r["pool/stale_token_frac"] for r in history) > 0
        assert recomputed_rows > 0  # rows that had waited a step took the recompute path


def test_actor_logprobs_recomputed_under_the_inference_kernels():
    """The hybrid engine's inference kernels decode with other numerics than the training
    forward: there the actor's old log-probs are recomputed even with actor in
    oppo.stream_to (the kernels exist on GPUs only, so the engine path is given here)."""
    from oppo_ds.engines.deepspeed_engine import HYBRID_KERNELS, HYBRID_NO_KERNELS_CPU, HYBRID_OFF
    from oppo_ds.trainer import actor_streams

    assert not actor_streams(True, HYBRID_KERNELS)
    assert actor_streams(True, HYBRID_OFF) and actor_streams(True, HYBRID_NO_KERNELS_CPU)
    assert not actor_streams(False, HYBRID_OFF)


def _chat_style_actor(source, root) -> str:
    """A copy of the built-in SFT actor (at ``source``) laid out as Llama-3-Instruct's first
    release was: the tokenizer names another token as its EOS (here <unk>) and only
    generation_config.json lists the token the model ends its answers with (<eos>)."""
    import shutil

    from oppo_ds import workload as wl

    path = os.path.join(str(root), "chat-actor")
    shutil.copytree(source, path)
    unk = wl.build_tokenizer().convert_tokens_to_ids("<unk>")
    for name, key, value in (("tokenizer_config.json", "eos_token", "<unk>"),
                             ("generation_config.json", "eos_token_id", [unk, wl.EOS_ID])):
        file = os.path.join(path, name)
        with open(file) as f:
            content = json.load(f)
        content[key] = value
        with open(file, "w") as f:
            json.dump(content, f)
    return path


def test_responses_end_at_every_eos_id_of_the_generation_config(cache_dir, tmp_path, caplog, monkeypatch):
    """Responses end where Hugging Face's generate would end them: at every id the actor's
    generation config lists, not only the tokenizer's EOS (before, a checkpoint laid out like
    Llama-3-Instruct's decoded every response to max_new_tokens). The chat-style copy of the
    actor samples exactly the built-in run (same weights, seed and prompts); the SFT actor has
    no use for <unk>, so ending only there (generation.eos_token_ids) runs most responses to
    the limit."""
    import logging

    trainer, _ = run(cache_dir, tmp_path / "base", "steps=2", "checkpoint.export_hf=false")
    chat = _chat_style_actor(trainer.sources.actor, tmp_path)
    with caplog.at_level(logging.INFO, logger="oppo_ds.sources"):
        run(cache_dir, tmp_path / "chat", "steps=2", "checkpoint.export_hf=false", f"model.actor={chat}")
    assert "responses end at token ids [3, 2] ['<unk>', '<eos>']" in caplog.text
    base = read_history(str(tmp_path / "base" / "metrics.jsonl"))
    same = read_history(str(tmp_path / "chat" / "metrics.jsonl"))
    for a, b in zip(base, same):
        assert b["response/lengths"] == a["response/lengths"]
        for key in ("reward/mean", "kl/mean", "loss/policy"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
    assert min(min(row["response/lengths"]) for row in base) < 24  # the SFT actor ends answers

    run(cache_dir, tmp_path / "unk", "steps=1", "checkpoint.export_hf=false", f"model.actor={chat}",
        "generation.eos_token_ids=[3]")
    (only_unk,) = read_history(str(tmp_path / "unk" / "metrics.jsonl"))
    at_limit = sum(n == 24 for n in only_unk["response/lengths"])
    assert at_limit > sum(n == 24 for n in base[0]["response/lengths"]) and at_limit >= 6

    from oppo_ds.config import ConfigError
    from oppo_ds.engines import factory

    # before any model is built: at 70B that is minutes
    with monkeypatch.context() as patch:
        patch.setattr(factory, "build_models",
                      lambda *a, **k: pytest.fail("models were built before the check"))
        with pytest.raises(ConfigError, match=r"generation\.eos_token_ids: 99 is not a token id of "
                                              r"this tokenizer \(it has \d+\)"):
            run(cache_dir, tmp_path / "bad", "steps=1", f"model.actor={chat}",
                "generation.eos_token_ids=[2, 99]")


def test_the_exported_actor_ends_responses_where_training_did(cache_dir, tmp_path):
    """The exported actor's generation config names the ids the run's responses ended at, so
    that Hugging Face's generate ends them there too: before, it kept the checkpoint's, which
    a run's generation.eos_token_ids (or the tokenizer's EOS, when the checkpoint's generation
    config leaves it out) differs from."""
    from transformers import AutoModelForCausalLM

    trainer, _ = run(cache_dir, tmp_path / "base", "steps=1", "checkpoint.export_hf=false")
    chat = _chat_style_actor(trainer.sources.actor, tmp_path)  # its generation config: [3, 2]
    run(cache_dir, tmp_path / "unk", "steps=1", f"model.actor={chat}", "generation.eos_token_ids=[3]")
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "unk" / "actor"))
    assert exported.generation_config.eos_token_id == 3
    with open(tmp_path / "unk" / "actor" / "generation_config.json") as f:
        saved = json.load(f)
    assert saved["bos_token_id"] == 1 and saved["pad_token_id"] == 0  # the rest as it was


def test_the_exported_critic_scores_batches_under_hf(cache_dir, tmp_path):
    """The exported critic is a sequence classifier HF runs on a batch: a checkpoint without
    a pad id in its config (Llama 3's) gets the tokenizer's, without which
    AutoModelForSequenceClassification refuses more than one row. Its scores equal the
    trained critic's last-token values within 1e-5 (fp32)."""
    import shutil

    from transformers import AutoModelForSequenceClassification

    trainer, _ = run(cache_dir, tmp_path / "base", "steps=1", "checkpoint.export_hf=false")
    reward = tmp_path / "reward-no-pad"
    shutil.copytree(trainer.sources.reward, reward)
    config = json.loads((reward / "config.json").read_text())
    config["pad_token_id"] = None
    (reward / "config.json").write_text(json.dumps(config))
    trainer, _ = run(cache_dir, tmp_path / "run", "steps=1", f"model.reward={reward}")
    critic = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "run" / "critic"))
    pad = trainer.tokenizer.pad_token_id
    assert critic.config.pad_token_id == pad
    rows = [[5, 6, 7, 8, 9], [5, 6, 7, pad, pad]]  # right-padded: HF reads the last non-pad token
    with torch.no_grad():
        scores = critic.eval()(torch.tensor(rows)).logits[:, 0]
        model = trainer.critic.module.eval()
        ours = [model(torch.tensor([r[:n]])).values[0, -1] for r, n in zip(rows, (5, 3))]
    torch.testing.assert_close(scores, torch.stack(ours), rtol=0, atol=1e-5)


def test_a_reward_model_of_another_tokenizer_stops_before_any_engine(tmp_path, monkeypatch):
    """A reward checkpoint whose embedding is smaller than the actor's tokenizer stopped the
    first step with an IndexError traceback (a device-side assert on a GPU); now the run stops
    before any model is built, naming the key, the path and both sizes."""
    from oppo_ds.config import ConfigError
    from oppo_ds.engines import factory
    from oppo_ds.models import build_value_model
    from oppo_ds.workload import build_tokenizer

    tok_dir = tmp_path / "tok"
    build_tokenizer().save_pretrained(str(tok_dir))
    n = len(build_tokenizer())
    reward = tmp_path / "reward"
    build_value_model("tiny-llama", vocab_size=n - 3, seed=0).save_pretrained(str(reward))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "want a b c ->"}) + "\n")
    monkeypatch.setattr(factory, "build_models",
                        lambda *a, **k: pytest.fail("models were built before the check"))
    with pytest.raises(ConfigError) as err:
        run(str(tmp_path / "unused-cache"), tmp_path / "run", "steps=1", "model.actor=tiny-llama",
            f"model.reward={reward}", f"model.tokenizer={tok_dir}", f"data.prompts={prompts}")
    assert str(err.value) == (f"model.reward: {reward}: its embedding holds {n - 3} token ids, the "
                              f"actor's tokenizer has {n}: it was trained with another tokenizer; "
                              "every model must use the actor's tokenizer")


def test_chunk_size_auto_with_a_step_that_decodes_nothing(tmp_path, caplog):
    """Overcommitment with `chunk_size: auto`: step 1 decodes 8 rows, every row finishes in
    the same chunk and 4 finished rows are carried, so step 2 takes them and decodes nothing.
    That step (the second calibration step) fed zeros to the chunk-size cost fit, which raised
    and killed the run (found with a user's model under `oppo-bench --modes oppo`); now the
    controller calibrates the size again at the next step that decodes."""
    import logging

    from _builders import tiny_run_overrides

    from oppo_ds.trainer import PPOTrainer

    cfg = load_config(None, [*tiny_run_overrides(tmp_path, 4), "oppo.streaming=true",
                             "oppo.chunk_size=auto", "oppo.overcommit=4", "checkpoint.export_hf=false"])
    with caplog.at_level(logging.INFO, logger="oppo_ds.trainer"):
        assert PPOTrainer(cfg).train()["steps"] == 4
    history = read_history(str(tmp_path / "run" / "metrics.jsonl"))
    assert any(row.get("stream/chunks") is None for row in history)  # a step decoded nothing
    assert "step 3: chunk_size=" in caplog.text  # decided after the step that did decode


@pytest.mark.parametrize("overcommit, want", [(0, 192), (4, 256)])
def test_the_hybrid_engines_workspace_holds_the_longest_rollout(overcommit, want, tmp_path):
    """DeepSpeed sizes its inference kernels' KV workspace by hybrid_engine.max_out_tokens (512
    unless told; DeepSpeed-Chat passes prompt + answer length). The actor's is the longest
    sequence a rollout reaches, as the static cache is sized: 40 + 100 + sync_every 1, rounded
    up to 64; with the rollout pool a carried response of up to 99 tokens more (240 -> 256).
    As DeepSpeed parses the engine's config."""
    from _builders import tiny_run_overrides

    from oppo_ds.trainer import PPOTrainer

    cfg = load_config(None, [*tiny_run_overrides(tmp_path, 1), "system.hybrid_engine=true",
                             "generation.max_prompt_len=40", "generation.max_new_tokens=100",
                             f"oppo.overcommit={overcommit}"])
    trainer = PPOTrainer(cfg)
    try:
        assert trainer.actor.config["hybrid_engine"]["max_out_tokens"] == want
        assert trainer.actor.ds_engine._config.hybrid_engine.max_out_tokens == want
    finally:
        trainer.close()


def test_responses_longer_than_a_learned_position_table_stop_before_any_engine(tmp_path, monkeypatch):
    """GPT-2's positions are a learned table of n_positions rows: a prompt plus response past
    it failed mid-run in an IndexError traceback (a device-side assert on a GPU). Now the run
    stops first, naming the keys, the model and its limit (the tiny-llama reward's 512 rotary
    positions, also exceeded, are only a warning)."""
    from oppo_ds.config import ConfigError
    from oppo_ds.engines import factory
    from oppo_ds.models import build_causal_lm
    from oppo_ds.workload import build_tokenizer

    tok = build_tokenizer()
    actor = tmp_path / "gpt2"
    build_causal_lm("tiny-gpt2", vocab_size=len(tok), seed=0).save_pretrained(str(actor))
    tok.save_pretrained(str(actor))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "want a b c ->"}) + "\n")
    monkeypatch.setattr(factory, "build_models",
                        lambda *a, **k: pytest.fail("models were built before the check"))
    with pytest.raises(ConfigError) as err:
        run(str(tmp_path / "unused-cache"), tmp_path / "run", "steps=1", f"model.actor={actor}",
            "model.reward=tiny-llama", f"data.prompts={prompts}", "generation.max_prompt_len=32",
            "generation.max_new_tokens=481")
    assert str(err.value) == (
        f"generation.max_new_tokens: max_prompt_len 32 + max_new_tokens 481 = 513 positions, but "
        f"model.actor ({actor}) has 512 (n_positions in its config): its positions are a learned "
        "table, so a longer sequence cannot be scored; lower the two")


def test_a_resume_names_the_objective_settings_that_changed(cache_dir, tmp_path, caplog):
    """A run may continue under another objective (here the KL coefficient, the loss
    aggregation and the reward: a function in place of the reward model): the resume says so,
    one line per setting, as it does for learning rates; a micro-batch size (the same update)
    and unchanged settings go unmentioned."""
    import logging

    out = tmp_path / "run"
    run(cache_dir, out, "steps=2", "checkpoint.every=2", "checkpoint.export_hf=false")
    with caplog.at_level(logging.INFO, logger="oppo_ds.resume"):
        run(cache_dir, out, "steps=3", "checkpoint.export_hf=false", "ppo.kl_coef=0.1",
            "ppo.loss_agg_mode=seq_mean_token_mean", "ppo.micro_batch_size=2",
            "model.reward_function=oppo_ds.workload:gold_reward")
    lines = [r.getMessage() for r in caplog.records if "was written with" in r.getMessage()]
    assert lines == ["ppo.kl_coef: 0.1, not the 0.05 checkpoint step2 was written with",
                     "ppo.loss_agg_mode: seq_mean_token_mean, not the token_mean checkpoint step2 "
                     "was written with",
                     "model.reward_function: oppo_ds.workload:gold_reward, not the null checkpoint "
                     "step2 was written with"]
    history = read_history(str(out / "metrics.jsonl"))
    assert history[-1]["reward/mean"] == pytest.approx(history[-1]["gold/mean"], abs=1e-6)
    assert read_history(str(out / "metrics.jsonl"))[-1]["kl/coef"] == 0.1

    # with ppo.kl_target the checkpoint's adaptive coefficient goes on: ppo.kl_coef, only its
    # start, is not named as if it applied
    adaptive = ("checkpoint.export_hf=false", "ppo.kl_target=0.5", "ppo.kl_horizon=20")
    run(cache_dir, tmp_path / "adaptive", "steps=2", "checkpoint.every=2", *adaptive)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="oppo_ds.resume"):
        run(cache_dir, tmp_path / "adaptive", "steps=3", "ppo.kl_coef=0.2", *adaptive)
    assert "ppo.kl_coef" not in caplog.text and "resumed from step2" in caplog.text
    assert read_history(str(tmp_path / "adaptive" / "metrics.jsonl"))[-1]["kl/coef"] != 0.2


def test_cudnn_attention_is_off_in_the_run_unless_asked_for(cache_dir, tmp_path):
    """system.cudnn_attention (default false): the run's forwards (rollout, scoring, update,
    evaluation) go without torch's cuDNN attention backend (it plans every new shape, and a
    rollout's shapes change nearly every forward); the switch is back as it was after train().
    Seen from a forward hook on the actor, for every forward of the run; on a CPU no attention
    runs on cuDNN, so this checks the switch, not a kernel."""
    from oppo_ds.trainer import PPOTrainer

    assert torch.backends.cuda.cudnn_sdp_enabled()
    for extra, want in (([], False), (["system.cudnn_attention=true"], True)):
        trainer = PPOTrainer(load_config(None, SMALL + [
            f"workload.cache_dir={cache_dir}", f"logging.output_dir={tmp_path / str(want)}",
            "steps=1", "eval.every=1", *extra]))
        seen = []
        trainer.actor.module.register_forward_pre_hook(
            lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
        trainer.train()
        assert len(seen) > 10 and set(seen) == {want}
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_profile_step_writes_torchs_profile_of_that_step(cache_dir, tmp_path):
    """logging.profile_step: torch's profiler watches that step only: a table of the ops (the
    phases named in it) and a trace whose events include the phases and the model's ops."""
    _, summary = run(cache_dir, tmp_path / "run", "steps=2", "logging.profile_step=2")
    assert summary["steps"] == 2
    out = tmp_path / "run" / "profile"
    assert sorted(os.listdir(out)) == ["step_2.json", "step_2.txt"]
    table = (out / "step_2.txt").read_text()
    assert table.startswith("ops by self_cpu_time_total\n")
    assert "phase/generate" in table and "phase/train" in table and "aten::" in table
    names = {e.get("name") for e in json.loads((out / "step_2.json").read_text())["traceEvents"]}
    assert {"phase/generate", "phase/score", "phase/train"} <= names
    assert any(n and n.startswith("aten::mm") or n == "aten::addmm" for n in names)
