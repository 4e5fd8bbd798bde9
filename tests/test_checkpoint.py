"""Tier 0: the checkpoint manager's check of a tag's per-rank trainer states, which runs
before any engine is loaded (the whole resume path is in test_trainer.py and, with real
ranks, test_distributed.py)."""
from __future__ import annotations

import os

import pytest
import torch

from oppo_ds.checkpoint import CheckpointManager
from oppo_ds.config import ConfigError
from oppo_ds.engines import CheckpointMismatch


def _write(root, tag, ranks, engines=("actor",)):
    """Each rank's trainer state as the manager saves it (no process group), and a file in
    each engine's folder of the tag (an engine writes its own format there)."""
    for r in ranks:
        CheckpointManager(str(root), rank=r, world_size=len(ranks), keep_last=2).save(
            tag, {"step": 1}, engines={})
    for name in engines:
        (root / name / tag).mkdir(parents=True, exist_ok=True)
        torch.save({}, root / name / tag / "model_states.pt")


class _Engine:
    """Records whether the manager got as far as the engines."""

    def __init__(self):
        self.loaded = False

    def load(self, path, tag, weights_only=False):
        self.loaded = True


def test_another_world_size_is_refused_before_the_engines_but_evaluated(tmp_path):
    _write(tmp_path, "step1", [0, 1])
    engine = _Engine()
    manager = CheckpointManager(str(tmp_path), rank=0, world_size=1, keep_last=2)
    with pytest.raises(ConfigError, match=r"checkpoint.resume: checkpoint step1 was written by 2 "
                                          r"rank\(s\), this run has 1.*resume with 2 rank\(s\)"):
        manager.load("step1", {"actor": engine})
    assert not engine.loaded
    manager = CheckpointManager(str(tmp_path), rank=2, world_size=3, keep_last=2)
    with pytest.raises(ConfigError, match="written by 2 rank"):
        manager.load("step1", {"actor": engine})
    # oppo-train --evaluate takes the weights and the step alone: any number of ranks, a rank
    # beyond the checkpoint's reading rank 0's state
    for rank, world in ((0, 1), (2, 3)):
        engine = _Engine()
        manager = CheckpointManager(str(tmp_path), rank=rank, world_size=world, keep_last=2,
                                    evaluating=True)
        assert manager.load("step1", {"actor": engine})["step"] == 1 and engine.loaded


def test_an_engine_that_cannot_read_its_files_names_the_key(tmp_path):
    """An engine's ``FileNotFoundError`` or ``CheckpointMismatch`` (its files missing, another
    model's weights) reaches the user as a ``ConfigError`` on checkpoint.resume with the way
    out; any other error of a load (a bug's) keeps its type and traceback."""
    _write(tmp_path, "step1", [0])

    class Unreadable(_Engine):
        def __init__(self, error):
            self.error = error

        def load(self, path, tag, weights_only=False):
            raise self.error
    manager = CheckpointManager(str(tmp_path), rank=0, world_size=1, keep_last=2, evaluating=True)
    mismatch = CheckpointMismatch("it holds the weights of another model: x is (2,) there")
    with pytest.raises(ConfigError, match=r"^checkpoint\.resume: checkpoint step1: the actor's "
                                          r"files could not be read: it holds the weights of "
                                          r"another model: x is \(2,\) there; evaluate another "
                                          r"tag"):
        manager.load("step1", {"actor": Unreadable(mismatch)})
    manager = CheckpointManager(str(tmp_path), rank=0, world_size=1, keep_last=2)
    with pytest.raises(ValueError, match="^a bug$") as caught:
        manager.load("step1", {"actor": Unreadable(ValueError("a bug"))})
    assert not isinstance(caught.value, ConfigError)


def test_a_file_cut_short_names_the_file_and_the_tags_to_resume_instead(tmp_path):
    """A trainer state cut short (a copy of the run's folder interrupted) was a raw
    "RuntimeError: PytorchStreamReader failed reading zip archive", naming no file; so was an
    engine's file (DeepSpeed's, Megatron's, read by torch.load inside the engine). Each is
    now named with the tag, and the earlier complete tags to resume instead."""
    for tag in ("step1", "step2", "step3"):
        _write(tmp_path, tag, [0])
    state = tmp_path / "trainer" / "step3" / "rank0.pt"
    state.write_bytes(state.read_bytes()[:200])
    manager = CheckpointManager(str(tmp_path), rank=0, world_size=1, keep_last=5)
    engine = _Engine()
    with pytest.raises(ConfigError) as err:
        manager.load("step3", {"actor": engine})
    assert str(err.value) == (
        f"checkpoint.resume: checkpoint step3: {state} cannot be read (its zip directory, at "
        "the end of the file, is missing or broken: cut short or never fetched); resume an "
        "earlier complete tag, checkpoint.resume=step2 (the complete ones: step1, step2), or "
        "start afresh with checkpoint.resume=never")
    assert not engine.loaded

    class TorchLoading(_Engine):  # reads its files as DeepSpeed's load_checkpoint does
        def load(self, path, tag, weights_only=False):
            torch.load(os.path.join(path, tag, "model_states.pt"), weights_only=False)
    model = tmp_path / "actor" / "step1" / "model_states.pt"
    model.write_bytes(model.read_bytes()[:100])
    with pytest.raises(ConfigError) as err:
        manager.load("step1", {"actor": TorchLoading()})
    assert str(err.value) == (
        f"checkpoint.resume: checkpoint step1: {model} cannot be read (its zip directory, at "
        "the end of the file, is missing or broken: cut short or never fetched); start afresh "
        "with checkpoint.resume=never (no earlier complete tag)")
    assert isinstance(err.value.__cause__, RuntimeError)  # torch's own, kept as the cause
    model.write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ConfigError, match=r"cannot be read \(the file is a git-lfs pointer: "
                                          r"cut short or never fetched\); evaluate another"):
        CheckpointManager(str(tmp_path), rank=0, world_size=1, keep_last=5,
                          evaluating=True).load("step1", {"actor": TorchLoading()})


def test_an_incomplete_or_missing_tag_is_refused(tmp_path):
    _write(tmp_path, "step1", [1])
    manager = CheckpointManager(str(tmp_path), rank=0, world_size=2, keep_last=2)
    with pytest.raises(ConfigError, match=r"checkpoint step1 is incomplete: .* ranks \[1\]; "
                                          r"resume from another tag, or start afresh"):
        manager.load("step1", {})
    evaluating = CheckpointManager(str(tmp_path), rank=0, world_size=2, keep_last=2,
                                   evaluating=True)
    with pytest.raises(ConfigError, match=r"ranks \[1\]; evaluate another tag "
                                          r"\(checkpoint.resume=TAG\)$"):
        evaluating.load("step1", {})
    # step1 is no complete checkpoint: not offered
    with pytest.raises(ConfigError, match=r"no checkpoint step7 in .* \(it holds: none\)"):
        manager.load("step7", {})


def test_a_tag_without_an_engines_files_is_refused_before_the_engines(tmp_path):
    """A tag whose engine folder is missing or empty (a kill while a tag was cleared, as a
    finished run's final save once did) is refused naming it, not left to DeepSpeed's bare
    assert on its list of files."""
    _write(tmp_path, "step1", [0], engines=("actor",))
    (tmp_path / "critic" / "step1").mkdir(parents=True)
    engine = _Engine()
    manager = CheckpointManager(str(tmp_path), rank=0, world_size=1, keep_last=2)
    for engines, missing in (({"actor": engine, "critic": _Engine()}, "critic"),
                             ({"actor": engine, "ema": _Engine()}, "ema")):
        with pytest.raises(ConfigError, match=rf"checkpoint.resume: checkpoint step1 is "
                                              rf"incomplete: nothing of the {missing} under"):
            manager.load("step1", engines)
        assert not engine.loaded


def test_a_complete_tag_loads(tmp_path):
    _write(tmp_path, "step1", [0, 1])
    engine = _Engine()
    state = CheckpointManager(str(tmp_path), rank=1, world_size=2, keep_last=2).load(
        "step1", {"actor": engine})
    assert engine.loaded and state["step"] == 1


def test_the_check_sees_the_state_before_any_engine_loads(tmp_path):
    _write(tmp_path, "step1", [0])
    engine, seen = _Engine(), []

    def check(state):
        seen.append(state["step"])
        raise ConfigError("model.actor", "not this one")
    with pytest.raises(ConfigError, match="model.actor: not this one"):
        CheckpointManager(str(tmp_path), rank=0, world_size=1, keep_last=2).load(
            "step1", {"actor": engine}, check=check)
    assert seen == [1] and not engine.loaded


def test_keep_last_counts_the_tags_up_to_latest(tmp_path):
    """A branch's later tags, left by resuming an older tag, take no place of keep_last from
    the resumed run's own until it saves their step, which replaces them: they counted in
    step order and pruned the run's own checkpoints down to its latest."""
    from oppo_ds.checkpoint import checkpoint_tags

    for tag in ("step100", "step200", "step300"):  # a run; then resumed from step100
        _write(tmp_path, tag, [0], engines=())
    manager = CheckpointManager(str(tmp_path), rank=0, world_size=1, keep_last=2)
    for step in (150, 175, 190):
        manager.save(f"step{step}", {"step": step}, engines={})
    assert checkpoint_tags(str(tmp_path)) == ["step175", "step190", "step200", "step300"]
    assert manager.latest() == "step190"
    manager.save("step200", {"step": 200}, engines={})  # the resumed run's own replaces it
    assert checkpoint_tags(str(tmp_path)) == ["step190", "step200", "step300"]
    assert manager.load("step200", {})["step"] == 200


def test_set_aside_moves_an_earlier_runs_checkpoints_whole(tmp_path):
    """A fresh start's ``set_aside``: the earlier run's folder renamed, tags and ``latest``
    with it, a second one beside the first; nothing to move, nothing moved."""
    from oppo_ds.checkpoint import checkpoint_tags

    root = tmp_path / "checkpoints"
    assert CheckpointManager(str(root), rank=0, world_size=1, keep_last=2).set_aside() is None
    moved = []
    for _ in range(2):
        for tag in ("step2", "step4"):
            _write(root, tag, [0])
        manager = CheckpointManager(str(root), rank=0, world_size=1, keep_last=2)
        moved.append(manager.set_aside())
        assert not root.exists() and manager.tags() == [] and manager.latest() is None
    assert moved[0] != moved[1]
    for aside in moved:
        assert os.path.basename(aside).startswith("checkpoints.earlier-")
        assert checkpoint_tags(aside) == ["step2", "step4"]
        assert CheckpointManager(aside, rank=0, world_size=1, keep_last=2).latest() == "step4"


def test_set_aside_keeps_a_linked_checkpoint_folder_on_its_disk(tmp_path):
    """checkpoints/ as a link to a folder on another disk (a cluster's scratch space): the
    earlier run's folder moves beside itself there, and the link stays a link, to an empty
    folder of that disk, where the new run's checkpoints then go."""
    from oppo_ds.checkpoint import checkpoint_tags

    disk, run = tmp_path / "scratch", tmp_path / "run"
    disk.mkdir()
    run.mkdir()
    for tag in ("step2", "step4"):
        _write(disk / "ckpt", tag, [0])
    (run / "checkpoints").symlink_to(disk / "ckpt")
    aside = CheckpointManager(str(run / "checkpoints"), rank=0, world_size=1,
                              keep_last=2).set_aside()
    assert os.path.dirname(aside) == str(disk) and checkpoint_tags(aside) == ["step2", "step4"]
    assert os.path.islink(run / "checkpoints") and os.listdir(disk / "ckpt") == []
    CheckpointManager(str(run / "checkpoints"), rank=0, world_size=1, keep_last=2).save(
        "step1", {"step": 1}, engines={})
    assert checkpoint_tags(str(disk / "ckpt")) == ["step1"]
