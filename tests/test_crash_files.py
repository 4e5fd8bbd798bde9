"""Tier 0: what a crash mid-run leaves on disk, and that a restart reads it: a torn last line
of the run's JSONL history, a rewrite or a save killed half-way, a `latest` lost beside
complete tags, a prune killed half-way. Real files in tmp_path; a kill is an exception
raised at a chosen point by an audit hook (``sys.audit`` events of ``os.replace`` and
``shutil.rmtree``), as a process stopped there stops writing. Last, one tiny run (Tier 2)
with a torn metrics.jsonl that resumes and continues exactly."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys

import pytest

from oppo_ds.checkpoint import CheckpointManager, check_tag, checkpoint_tags
from oppo_ds.config import ConfigError, load_config
from oppo_ds.datafiles import DataError
from oppo_ds.durable import write_durably
from oppo_ds.telemetry import Telemetry, read_history
from test_trainer import DETERMINISTIC, SMALL, _metrics_by_step, run  # the tiny in-process runs

_KILL = {"event": None, "after": 0, "seen": [], "hooked": False}  # set by _killed_at


class Killed(BaseException):
    """A kill: not an ``Exception``, so that nothing on the way catches it."""


def _audit(event, args):
    if event == _KILL["event"]:
        _KILL["seen"].append(args[0])
        if len(_KILL["seen"]) > _KILL["after"]:
            raise Killed(f"killed at {event} {args[0]}")


@contextlib.contextmanager
def _killed_at(event: str, after: int = 0):
    """Within: the ``after``+1-th ``event`` (``os.rename``: an ``os.replace``; ``shutil.rmtree``)
    raises ``Killed`` before it acts. Yields the paths the events named."""
    if not _KILL["hooked"]:  # for the process's life (hooks cannot be removed): idle unarmed
        sys.addaudithook(_audit)
        _KILL["hooked"] = True
    _KILL.update(event=event, after=after, seen=[])
    try:
        with pytest.raises(Killed):
            yield _KILL["seen"]
    finally:
        _KILL["event"] = None


def _telemetry(out, start_step: int) -> Telemetry:
    return Telemetry(str(out), enabled=True, tensorboard=False, progress=False, total_steps=9,
                     start_step=start_step, log_every=0)


def _rows(*steps) -> bytes:
    return b"".join(json.dumps({"step": s, "reward/mean": s / 10}).encode() + b"\n"
                    for s in steps)


# -- the run's JSONL history --------------------------------------------------------------

def test_a_torn_last_line_is_dropped_at_a_resume_with_a_warning(tmp_path, caplog):
    """Killed while appending: metrics.jsonl ends in half a row, samples.jsonl inside a
    character of one, eval.jsonl in a row that has all but its newline (whole: kept). The
    resume at step 2 keeps rows 1-2 (and eval's 0-2), names each torn line in a warning, and
    the next rows append on lines of their own."""
    (tmp_path / "metrics.jsonl").write_bytes(_rows(1, 2, 3) + b'{"step": 4, "reward/me')
    sample = json.dumps({"step": 3, "response": "é"}, ensure_ascii=False).encode()
    (tmp_path / "samples.jsonl").write_bytes(
        b'{"step": 2, "response": "\xc3\xa9"}\n' + sample[:sample.index(b"\xc3") + 1])
    (tmp_path / "eval.jsonl").write_bytes(_rows(0, 2)[:-1])
    with caplog.at_level("WARNING", logger="oppo_ds.telemetry"):
        telemetry = _telemetry(tmp_path, start_step=2)
    for name, line in (("metrics.jsonl", 4), ("samples.jsonl", 2)):
        assert f"{tmp_path / name}:{line}: dropped an unreadable last line" in caplog.text
    assert "eval.jsonl" not in caplog.text
    assert [r["step"] for r in read_history(str(tmp_path / "metrics.jsonl"))] == [1, 2]
    # kept rows are kept as written (a non-ASCII response is not re-escaped)
    assert (tmp_path / "samples.jsonl").read_bytes() == b'{"step": 2, "response": "\xc3\xa9"}\n'
    assert [r["step"] for r in read_history(str(tmp_path / "eval.jsonl"))] == [0, 2]
    telemetry.log_step(3, {"reward/mean": 0.3})
    telemetry.log_eval(3, {"eval/prompts": 1, "eval/time_s": 0.0}, [])
    assert [r["step"] for r in read_history(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3]
    assert [r["step"] for r in read_history(str(tmp_path / "eval.jsonl"))] == [0, 2, 3]
    assert telemetry.close()["steps"] == 3


def test_an_unreadable_line_before_the_last_is_an_error_naming_it(tmp_path):
    """A bad line with rows after it is no torn append but corruption: the resume stops,
    naming the file and line, and leaves the file as it was; a fresh start reads nothing of
    the old history and starts it anew."""
    path = tmp_path / "metrics.jsonl"
    corrupt = _rows(1) + b'{"step": 2, "rew\n' + _rows(3)
    path.write_bytes(corrupt)
    where = re.escape(str(path))
    with pytest.raises(DataError, match=rf"^{where}:2: not a JSON row, and not the last line"):
        _telemetry(tmp_path, start_step=3)
    assert path.read_bytes() == corrupt
    _telemetry(tmp_path, start_step=0)
    assert path.read_bytes() == b""


def test_a_kill_while_the_history_is_rewritten_leaves_the_old_file(tmp_path):
    """The truncation at a resume writes a temporary file beside the history and renames it
    over: killed just before the rename, the history is as it was (every row, the torn line
    too, which the next start drops) and no temporary file is left; done, the file is a new
    one (another inode), not the old one rewritten in place."""
    path = tmp_path / "metrics.jsonl"
    before = _rows(1, 2, 3) + b'{"st'
    path.write_bytes(before)
    inode = os.stat(path).st_ino
    with _killed_at("os.rename") as renamed:
        _telemetry(tmp_path, start_step=2)
    assert renamed == [str(tmp_path / ".metrics.jsonl.tmp")]
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["metrics.jsonl"]
    _telemetry(tmp_path, start_step=2)
    assert path.read_bytes() == _rows(1, 2) and os.stat(path).st_ino != inode


def test_write_durably_is_whole_or_not_at_all(tmp_path):
    """Killed while writing, or before the rename: the old file stays, no temporary one."""
    path = tmp_path / "latest"
    write_durably(str(path), lambda f: f.write(b"step2"))
    assert path.read_bytes() == b"step2"

    def torn(f):
        f.write(b"ste")
        raise Killed("killed mid-write")
    with pytest.raises(Killed):
        write_durably(str(path), torn)
    with _killed_at("os.rename"):
        write_durably(str(path), lambda f: f.write(b"step4"))
    assert path.read_bytes() == b"step2" and os.listdir(tmp_path) == ["latest"]
    write_durably(str(path), lambda f: f.write(b"step4"))
    assert path.read_bytes() == b"step4" and os.listdir(tmp_path) == ["latest"]


# -- checkpoints ----------------------------------------------------------------------------

class _Files:
    """An engine whose save writes a file into its folder of the tag, as DeepSpeed's does."""

    def save(self, folder, tag):
        os.makedirs(os.path.join(folder, tag), exist_ok=True)
        with open(os.path.join(folder, tag, "model_states.pt"), "wb") as f:
            f.write(b"weights")


def _save(root, tag: str, keep_last: int = 9, engines=("actor", "critic")):
    """A checkpoint as a run saves it (the manager's own save, which then prunes)."""
    CheckpointManager(str(root), rank=0, world_size=1, keep_last=keep_last).save(
        tag, {"step": int(tag[4:])}, engines={name: _Files() for name in engines})


def test_a_save_writes_latest_and_the_trainer_state_through_a_rename(tmp_path):
    """Killed at the rename of its trainer state, a save leaves `latest` on the previous
    tag, and neither a half file nor a temporary one in the tag's folder; killed at the
    rename of `latest`, the new tag's files are whole and `latest` still names the old."""
    engines = {"actor": _Files()}
    manager = CheckpointManager(str(tmp_path), rank=0, world_size=1, keep_last=9)
    manager.save("step2", {"step": 2}, engines)
    with _killed_at("os.rename") as renamed:
        manager.save("step4", {"step": 4}, engines)
    assert renamed == [str(tmp_path / "trainer" / "step4" / ".rank0.pt.tmp")]
    assert manager.latest() == "step2" and os.listdir(tmp_path / "trainer" / "step4") == []
    assert manager.tags() == ["step2"]
    with _killed_at("os.rename", after=1) as renamed:
        manager.save("step4", {"step": 4}, engines)
    assert renamed[-1] == str(tmp_path / ".latest.tmp") and manager.latest() == "step2"
    assert not (tmp_path / ".latest.tmp").exists()
    assert manager.load("step4", {})["step"] == 4  # whole: an explicit resume takes it


@pytest.mark.parametrize("latest", [None, b"", b"\n"], ids=["missing", "empty", "blank"])
def test_auto_refuses_complete_tags_without_latest(tmp_path, latest):
    """`latest` lost beside complete tags: `checkpoint.resume: auto` stops, naming the folder,
    the newest tag and both ways on, rather than start from step 0 (which truncated the
    history and pruned the tags); with nothing there it starts afresh as before."""
    manager = CheckpointManager(str(tmp_path), rank=0, world_size=1, keep_last=9)
    assert manager.auto_tag() is None
    for tag in ("step2", "step4"):
        _save(tmp_path, tag)
    assert manager.auto_tag() == "step4"
    os.remove(tmp_path / "latest")
    if latest is not None:
        (tmp_path / "latest").write_bytes(latest)
    with pytest.raises(ConfigError, match=(
            rf"^checkpoint\.resume: auto, but {re.escape(str(tmp_path))} holds checkpoints "
            rf"\(step2, step4\) and no `latest` naming one \(missing or empty\): resume the "
            rf"newest with checkpoint\.resume=step4, or start afresh with "
            rf"checkpoint\.resume=never")):
        manager.auto_tag()
    check_tag(str(tmp_path), "step4")  # the way out named: a whole tag


def test_a_trainer_state_without_its_engines_is_no_checkpoint(tmp_path):
    """What a prune killed between the engines and the trainer state left before
    2026-11-29 (the engines first): step 2's trainer state, no actor. It is not offered as a
    tag, `auto` without `latest` names step 4, a run naming it stops before any engine is
    built, and the next save removes what is left of it."""
    for tag in ("step2", "step4"):
        _save(tmp_path, tag)
    shutil.rmtree(tmp_path / "actor" / "step2")
    assert checkpoint_tags(str(tmp_path)) == ["step4"]
    with pytest.raises(ConfigError, match=r"^checkpoint\.resume: checkpoint step2 is incomplete: "
                                          r"nothing of the actor under .*; the complete ones: "
                                          r"step4$"):
        check_tag(str(tmp_path), "step2")
    os.remove(tmp_path / "latest")
    with pytest.raises(ConfigError, match="checkpoint.resume=step4"):
        CheckpointManager(str(tmp_path), rank=0, world_size=1, keep_last=9).auto_tag()
    _save(tmp_path, "step6")
    assert checkpoint_tags(str(tmp_path)) == ["step4", "step6"]
    for name in ("trainer", "actor", "critic"):
        assert sorted(os.listdir(tmp_path / name)) == ["step4", "step6"]


def test_a_prune_removes_the_trainer_state_first(tmp_path):
    """keep_last 1: the save of step 4 prunes step 2. Killed after its first removal, the
    trainer state is gone and the engines' files are left, named by no tag: `latest` and
    the tags are step 4 alone; the next save removes the rest."""
    _save(tmp_path, "step2", keep_last=1)
    with _killed_at("shutil.rmtree", after=1) as removed:
        _save(tmp_path, "step4", keep_last=1)
    assert removed[0] == str(tmp_path / "trainer" / "step2")
    assert (tmp_path / "actor" / "step2").exists() and not (tmp_path / "trainer" / "step2").exists()
    assert checkpoint_tags(str(tmp_path)) == ["step4"]
    assert CheckpointManager(str(tmp_path), rank=0, world_size=1, keep_last=1).latest() == "step4"
    _save(tmp_path, "step6", keep_last=1)
    for name in ("trainer", "actor", "critic"):
        assert os.listdir(tmp_path / name) == ["step6"]


def test_rank_0_writes_its_state_once_every_rank_has_saved(tmp_path, monkeypatch):
    """A save whose other ranks never reach the barrier after their files (killed there):
    rank 0 has saved its engines but not its trainer state, which it writes only after that
    barrier, so the tag is no checkpoint. Before, rank 0's state was written beside the
    others', and rank 0's alone made a rank-0-to-n-1 run that looked whole."""
    import oppo_ds.checkpoint as checkpoint

    _save(tmp_path, "step2")
    calls = []

    def barrier():  # the third of a save's: after its engines and (on other ranks) states
        calls.append(1)
        if len(calls) == 3:
            raise Killed("the other ranks never arrived")
    monkeypatch.setattr(checkpoint, "_barrier", barrier)
    with pytest.raises(Killed):
        CheckpointManager(str(tmp_path), rank=0, world_size=2, keep_last=9).save(
            "step4", {"step": 4}, engines={"actor": _Files()})
    assert (tmp_path / "actor" / "step4").exists()
    assert not (tmp_path / "trainer" / "step4" / "rank0.pt").exists()
    assert checkpoint_tags(str(tmp_path)) == ["step2"]


def test_a_save_syncs_the_engines_files_before_latest_names_them(tmp_path, monkeypatch):
    """DeepSpeed writes its files without syncing them: a power cut after `latest` named the
    tag (and a keep_last of 1 pruned the one before) could leave it empty. The save syncs
    every file of the tag's engine folders, then the trainer state, then `latest`; and the
    folders holding the tag's entries (actor/, critic/, trainer/), or the tag itself may be
    gone after a power cut that kept `latest`."""
    import oppo_ds.durable as durable

    synced, folders = [], []
    real = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        (synced if os.path.isfile(path) else folders).append(os.path.relpath(path, tmp_path))
        return real(fd)
    monkeypatch.setattr(durable.os, "fsync", fsync)
    _save(tmp_path, "step2", engines=("actor", "critic"))
    files = synced
    assert {"actor", "critic", "trainer", "."} <= set(folders)
    engine_files = sorted(os.path.relpath(os.path.join(top, name), tmp_path)
                          for name_ in ("actor", "critic")
                          for top, _, names in os.walk(tmp_path / name_ / "step2")
                          for name in names)
    assert engine_files and sorted(f for f in files if f in engine_files) == engine_files
    last = max(files.index(f) for f in engine_files)
    assert last < files.index(".latest.tmp")


def test_syncing_a_folder_skips_a_file_another_rank_renamed_meanwhile(tmp_path, monkeypatch):
    """On a shared folder another pipeline stage may still write its Megatron shard through a
    temporary file it renames: listed, then gone before it is opened. The sync skips it
    (that rank syncs its own) and syncs the rest. Seen in CI: a FileNotFoundError stopped
    the save of a pipeline-parallel run."""
    import oppo_ds.durable as durable

    (tmp_path / "mp_rank_00_000.pt").write_bytes(b"shard")
    real = os.walk

    def walk(folder):
        for top, dirs, names in real(folder):
            yield top, dirs, names + [".mp_rank_00_001.pt.tmp"]  # renamed since listed
    monkeypatch.setattr(durable.os, "walk", walk)
    durable.fsync_tree(str(tmp_path))


def test_an_evaluation_of_a_tag_needs_the_actors_files_alone(tmp_path):
    """A checkpoint copied for evaluation without the critic's folder: a resume refuses it
    (the critic would not load), `oppo-train --evaluate` (the actor alone) takes it."""
    _save(tmp_path, "step2", engines=("actor", "critic"))
    _save(tmp_path, "step4", engines=("actor", "critic"))
    shutil.rmtree(tmp_path / "critic" / "step4")
    with pytest.raises(ConfigError, match="nothing of the critic"):
        check_tag(str(tmp_path), "step4")
    check_tag(str(tmp_path), "step4", ("actor",))
    shutil.rmtree(tmp_path / "actor" / "step4")
    with pytest.raises(ConfigError, match="nothing of the actor"):
        check_tag(str(tmp_path), "step4", ("actor",))


def test_the_history_is_utf8_whatever_the_locale(tmp_path):
    """Under an ASCII locale (LC_ALL=C, no UTF-8 coercion) the history's files are still
    written in UTF-8, as the resume reads them: before, a non-ASCII prompt stopped the step
    that logged it (UnicodeEncodeError), and another locale's bytes stopped every resume."""
    import subprocess

    code = ("import sys; from oppo_ds.telemetry import Telemetry\n"
            "t = Telemetry(sys.argv[1], enabled=True, tensorboard=False, progress=False, "
            "total_steps=2, start_step=0, log_every=0)\n"
            "t.log_samples(1, [{'prompt': 'caf\\u00e9', 'response': '\\u00fc'}], False)\n"
            "t.log_eval(1, {'eval/reward_mean': 1.0}, [{'prompt': '\\u00e9', 'response': 'x'}])\n")
    env = dict(os.environ, LC_ALL="C", PYTHONCOERCECLOCALE="0", PYTHONUTF8="0")
    subprocess.run([sys.executable, "-X", "utf8=0", "-c", code, str(tmp_path)], check=True,
                   env=env, capture_output=True)
    assert "caf\u00e9".encode() in (tmp_path / "samples.jsonl").read_bytes()
    assert read_history(str(tmp_path / "eval_samples.jsonl"))[0]["prompt"] == "\u00e9"
    _telemetry(tmp_path, start_step=1)  # and a resume reads them back


# -- a whole run ---------------------------------------------------------------------------

def test_a_run_whose_history_ends_in_half_a_line_resumes_and_continues(cache_dir, tmp_path):
    """Tier 2 (tiny models): a run killed in step 4 after its step-2 checkpoint, with half
    of a row at the end of metrics.jsonl, as a kill mid-append leaves it. Its `latest` lost
    too, `auto` stops before touching the history; the tag the message names resumes, drops
    the torn line, and gives the uninterrupted run's metrics for steps 3 and 4 (1e-6, as
    test_crash_then_resume_continues_exactly)."""
    from oppo_ds.trainer import PPOTrainer

    over = ("steps=4", "checkpoint.every=2", "checkpoint.export_hf=false")
    run(cache_dir, tmp_path / "full", *over)
    cut = tmp_path / "cut"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cache_dir, cut, *over, crash_after=3)
    metrics = cut / "metrics.jsonl"
    with open(metrics, "ab") as f:
        f.write(b'{"step": 4, "reward/mean": 0.1')
    torn = metrics.read_bytes()
    os.remove(cut / "checkpoints" / "latest")
    cfg = load_config(None, [*SMALL, f"workload.cache_dir={cache_dir}",
                             f"logging.output_dir={cut}", *over])
    with pytest.raises(ConfigError, match=r"checkpoint\.resume=step2, or start afresh"):
        PPOTrainer(cfg)
    assert metrics.read_bytes() == torn and checkpoint_tags(str(cut / "checkpoints")) == [
        "step2"]
    run(cache_dir, cut, *over, "checkpoint.resume=step2")
    a, b = _metrics_by_step(tmp_path / "full" / "metrics.jsonl"), _metrics_by_step(metrics)
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert b[step]["response/lengths"] == a[step]["response/lengths"]
        for key in DETERMINISTIC:
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-6), (step, key)
    assert (cut / "checkpoints" / "latest").read_text() == "step4"
