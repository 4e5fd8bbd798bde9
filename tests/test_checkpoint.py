"""Tier 0: the checkpoint manager's check of a tag's per-rank trainer states, which runs
before any engine is loaded (the whole resume path is in test_trainer.py and, with real
ranks, test_distributed.py)."""
from __future__ import annotations

import pytest

from oppo_ds.checkpoint import CheckpointManager
from oppo_ds.config import ConfigError


def _write(root, tag, ranks, engines=("actor",)):
    """Each rank's trainer state as the manager saves it (no process group), and a file in
    each engine's folder of the tag (an engine writes its own format there)."""
    for r in ranks:
        CheckpointManager(str(root), rank=r, world_size=len(ranks), keep_last=2).save(
            tag, {"step": 1}, engines={})
    for name in engines:
        (root / name / tag).mkdir(parents=True, exist_ok=True)
        (root / name / tag / "model_states.pt").write_bytes(b"")


class _Engine:
    """Records whether the manager got as far as the engines."""

    def __init__(self):
        self.loaded = False

    def load(self, path, tag):
        self.loaded = True


def test_another_world_size_is_refused_before_the_engines(tmp_path):
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


def test_an_incomplete_or_missing_tag_is_refused(tmp_path):
    _write(tmp_path, "step1", [1])
    manager = CheckpointManager(str(tmp_path), rank=0, world_size=2, keep_last=2)
    with pytest.raises(ConfigError, match=r"checkpoint step1 is incomplete: .* ranks \[1\]"):
        manager.load("step1", {})
    with pytest.raises(ConfigError, match=r"no checkpoint step7 in .* \(it holds: step1\)"):
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
    """An earlier run's later tags (beside a fresh start, or a branch left by a resume from an
    older tag) take none of keep_last's places: they counted in step order and pruned this
    run's own checkpoints down to its latest. Left alone until this run saves their step,
    which replaces them; ``forget_latest`` takes ``latest`` off them."""
    from oppo_ds.checkpoint import checkpoint_tags

    for tag in ("step250", "step300"):  # the earlier run's two
        _write(tmp_path, tag, [0], engines=())
    manager = CheckpointManager(str(tmp_path), rank=0, world_size=1, keep_last=2)
    assert manager.latest() == "step300"
    manager.forget_latest()
    assert manager.latest() is None and checkpoint_tags(str(tmp_path)) == ["step250", "step300"]
    for step in (50, 100, 150):
        manager.save(f"step{step}", {"step": step}, engines={})
    assert checkpoint_tags(str(tmp_path)) == ["step100", "step150", "step250", "step300"]
    assert manager.latest() == "step150"
    manager.save("step250", {"step": 250}, engines={})  # this run's own replaces the old one
    assert checkpoint_tags(str(tmp_path)) == ["step150", "step250", "step300"]
    assert manager.load("step250", {})["step"] == 250
