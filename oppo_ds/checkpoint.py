"""Checkpoints: engines (weights, optimizer, scheduler) through the engine interface, plus
the trainer's own state per rank (step, data cursor, RNG states).

Layout under ``root``: ``<engine>/<tag>/`` (the engine's own format), ``trainer/<tag>/rank<r>.pt``
and ``latest``. ``latest`` is written last, after every rank finished, and it and the trainer
states durably (``write_durably``: fsynced, then renamed into place): a run killed mid-save,
or a node lost, still resumes from the previous complete checkpoint. A tag is complete when
its trainer state and every engine's folder are there; pruning removes the trainer state
first, so that a crash mid-prune leaves no tag that looks whole.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .config import ConfigError
from .durable import fsync_dir, fsync_tree, write_durably
from .engines.base import CheckpointMismatch

_TAG = re.compile(r"^step(\d+)$")
_RANK_FILE = re.compile(r"^rank(\d+)\.pt$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def checkpoint_root(cfg) -> str:
    """Where a run's checkpoints are: ``checkpoints/`` under ``logging.output_dir``."""
    return os.path.join(cfg.logging.output_dir, "checkpoints")


def _listed(folder: str) -> list[str]:
    return os.listdir(folder) if os.path.isdir(folder) else []


def _step(tag: str) -> int:
    return int(_TAG.match(tag).group(1))


ENGINES = ("actor", "critic")  # the models a checkpoint holds (PPOUpdate.trained_engines)


def _engine_folders(root: str) -> list[str]:
    """The engines' folders under ``root``: the critic's only where the run has one (a
    critic-free ``ppo.advantage_estimator`` has none)."""
    return [name for name in ENGINES if os.path.isdir(os.path.join(root, name))]


def _missing_engines(root: str, tag: str) -> list[str]:
    """The engines of ``root`` with nothing of ``tag``: a crash while it was saved, cleared
    or pruned (before 2026-11-29 pruning removed the engines' folders first)."""
    return [name for name in _engine_folders(root) if not _listed(os.path.join(root, name, tag))]


def _saved_files(folder: str) -> list[str]:
    """The files torch saved under an engine's ``folder`` of a tag (DeepSpeed's, Megatron's
    ``.pt``), in order."""
    return sorted(os.path.join(top, name) for top, _, names in os.walk(folder)
                  for name in names if name.endswith(".pt"))


def _saved_ranks(folder: str) -> list[int]:
    """The ranks whose trainer state is in ``folder`` (``trainer/<tag>``), in order."""
    return sorted(int(m.group(1)) for m in map(_RANK_FILE.match, _listed(folder)) if m)


def _whole(root: str, tag: str) -> bool:
    """Whether ``tag`` is a complete checkpoint: the trainer states of ranks 0 to n-1 and
    something of it in every engine's folder. Rank 0 writes its state after every rank's
    files are written (``CheckpointManager.save``; since 2026-11-29): a save cut short on
    some ranks has none, whatever the others wrote."""
    ranks = _saved_ranks(os.path.join(root, "trainer", tag))
    return bool(ranks) and ranks == list(range(len(ranks))) and not _missing_engines(root, tag)


def checkpoint_tags(root: str) -> list[str]:
    """The tags of the complete checkpoints under ``root`` (``_whole``), in step order."""
    found = [t for t in _listed(os.path.join(root, "trainer")) if _TAG.match(t)]
    return sorted((t for t in found if _whole(root, t)), key=_step)


def check_tag(root: str, tag: str, engines: Optional[Sequence[str]] = None) -> None:
    """``ConfigError`` (key ``checkpoint.resume``) when ``root`` holds no checkpoint ``tag``,
    or one without the files of an engine the run loads (``engines``; None: all of them; an
    evaluation loads the actor alone): cheap, so that a run naming a tag is checked before
    any engine is built."""
    _check_trainer_state(root, tag)
    missing = [name for name in _missing_engines(root, tag) if engines is None or name in engines]
    if missing:
        held = ", ".join(checkpoint_tags(root)) or "none"
        raise ConfigError("checkpoint.resume", (
            f"checkpoint {tag} is incomplete: nothing of the {' and '.join(missing)} under "
            f"{root} (a crash while it was saved or removed); the complete ones: {held}"))


def _check_trainer_state(root: str, tag: str) -> None:
    if not os.path.isdir(os.path.join(root, "trainer", tag)):
        held = ", ".join(checkpoint_tags(root)) or "none"
        raise ConfigError("checkpoint.resume", f"no checkpoint {tag} in {root} (it holds: {held})")


class CheckpointManager:
    def __init__(self, root: str, *, rank: int, world_size: int, keep_last: int,
                 evaluating: bool = False):
        """``evaluating``: loads serve ``oppo-train --evaluate``, whose refusals name its own
        ways out (a fresh start there evaluates ``model.actor``, not a checkpoint), and which
        reads the weights alone: of a checkpoint of any number of ranks."""
        self.root, self.rank, self.world_size, self.keep_last = root, rank, world_size, keep_last
        self.evaluating = evaluating

    def _another_tag(self) -> str:
        return ("evaluate another tag (checkpoint.resume=TAG)" if self.evaluating else
                "resume from another tag, or start afresh with checkpoint.resume=never")

    def latest(self) -> Optional[str]:
        path = os.path.join(self.root, "latest")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return f.read().strip() or None

    def auto_tag(self) -> Optional[str]:
        """The tag ``checkpoint.resume: auto`` resumes: the one ``latest`` names; None where
        there is no checkpoint. ``ConfigError`` where complete tags are there but ``latest``
        is missing or empty (lost in a crash, removed by hand): a fresh start would truncate
        the run's history and prune its checkpoints."""
        latest = self.latest()
        tags = self.tags()
        if latest is not None or not tags:
            return latest
        raise ConfigError("checkpoint.resume", (
            f"auto, but {self.root} holds checkpoints ({', '.join(tags)}) and no `latest` "
            f"naming one (missing or empty): resume the newest with "
            f"checkpoint.resume={tags[-1]}, or start afresh with checkpoint.resume=never "
            f"(which moves them aside)"))

    def save(self, tag: str, state: dict, engines: dict) -> None:
        # a tag written before (a resume from an older tag re-saving a later one, a finished
        # run's final save again) is cleared first, and `latest` moved off it, so that a crash
        # mid-save cannot leave `latest` naming a tag whose files are of two runs
        _barrier()
        if self.rank == 0 and self._written(tag, engines):
            self._clear(tag, list(engines))
        _barrier()
        for name, engine in engines.items():
            engine.save(os.path.join(self.root, name), tag)
            # on disk before `latest` names them (DeepSpeed syncs nothing): each rank its own
            # (on a shared filesystem everyone's: syncing clean files costs little)
            fsync_tree(os.path.join(self.root, name, tag))
            if os.path.isdir(os.path.join(self.root, name, tag)):  # a rank may write none
                fsync_dir(os.path.join(self.root, name))  # the tag's entry in it
        state = dict(state, python_rng=random.getstate(), torch_rng=torch.get_rng_state())
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        folder = os.path.join(self.root, "trainer", tag)
        os.makedirs(folder, exist_ok=True)

        def write_state():
            write_durably(os.path.join(folder, f"rank{self.rank}.pt"),
                          lambda f: torch.save(state, f))
            fsync_dir(os.path.dirname(folder))  # trainer/: the tag's entry in it
        if self.rank != 0:
            write_state()
        _barrier()
        if self.rank == 0:  # last, once every rank's files are there: rank 0's state marks
            write_state()   # a whole tag (``_whole``), a save cut short has none
            self._write_latest(tag)
            self._prune(list(engines))
        _barrier()

    def load(self, tag: str, engines: dict, check: Optional[Callable[[dict], None]] = None, *,
             weights_only: bool = False) -> dict:
        """Restore the engines and RNG states of ``tag``; returns the trainer state.
        ``check(state)`` sees this rank's trainer state before any engine loads.
        ``weights_only``: the engines' weights alone (``TrainEngine.load``), for an evaluation.

        Raises ``ConfigError`` (key ``checkpoint.resume``) before touching an engine when
        ``tag`` was written by another number of ranks: every rank's rollout pool, prompt
        shard and random state are its own, and a rank without its file (or a file without
        its rank) would lose or invent them. Not for an evaluation, which takes the weights
        and the step alone (a rank beyond the checkpoint's reads rank 0's state)."""
        _check_trainer_state(self.root, tag)  # the engines passed: checked by name below
        folder = os.path.join(self.root, "trainer", tag)
        saved = _saved_ranks(folder)
        if saved != list(range(len(saved))) or not saved:
            raise ConfigError("checkpoint.resume", (
                f"checkpoint {tag} is incomplete: {folder} holds the trainer state of ranks "
                f"{saved}; {self._another_tag()}"))
        if len(saved) != self.world_size and not self.evaluating:
            raise ConfigError("checkpoint.resume", (
                f"checkpoint {tag} was written by {len(saved)} rank(s), this run has "
                f"{self.world_size}: each rank's rollout pool, prompt shard and random state "
                f"are its own; "
                f"resume with {len(saved)} rank(s), or start afresh with "
                f"checkpoint.resume=never"))
        # on the CPU: a GPU tensor in the state (a pool row's streamed scores) would otherwise
        # come back on the saving rank's GPU, which a resume on another layout may not have
        mine = self.rank if self.rank < len(saved) else 0
        try:
            state = torch.load(os.path.join(folder, f"rank{mine}.pt"), weights_only=False,
                               map_location="cpu")
        except Exception as err:
            self._refuse_broken(tag, [os.path.join(folder, f"rank{mine}.pt")], err)
            raise
        if check is not None:  # before the engines: it may refuse what they would choke on
            check(state)
        empty = [name for name in engines
                 if not os.path.isdir(os.path.join(self.root, name, tag))
                 or not os.listdir(os.path.join(self.root, name, tag))]
        if empty:  # DeepSpeed would only assert on an empty list of its files
            raise ConfigError("checkpoint.resume", (
                f"checkpoint {tag} is incomplete: nothing of the {' and '.join(empty)} under "
                f"{self.root}; {self._another_tag()}"))
        for name, engine in engines.items():
            try:
                engine.load(os.path.join(self.root, name), tag, weights_only=weights_only)
            except (FileNotFoundError, CheckpointMismatch) as err:  # missing, another model's
                raise ConfigError("checkpoint.resume", (
                    f"checkpoint {tag}: the {name}'s files could not be read: {err}; "
                    f"{self._another_tag()}")) from err
            except Exception as err:  # torch's "failed reading zip archive" names no file
                self._refuse_broken(tag, _saved_files(os.path.join(self.root, name, tag)), err)
                raise
        random.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        return state

    def _refuse_broken(self, tag: str, files: list[str], err: Exception) -> None:
        """``ConfigError`` naming the first of ``files`` (of ``tag``) that is no whole file
        torch saved (cut short by a copy or a disk, empty, a git-lfs pointer), with the
        earlier complete tags to resume instead; nothing where each looks whole (``err``,
        a load's failure, is then some other one's, and keeps its traceback)."""
        from .checkpoint_files import torch_file_problem

        for file in files:
            problem = torch_file_problem(file)
            if problem is None:
                continue
            earlier = [t for t in self.tags()
                       if t != tag and (not _TAG.match(tag) or _step(t) < _step(tag))]
            if self.evaluating:
                way = self._another_tag()
            elif earlier:
                way = (f"resume an earlier complete tag, checkpoint.resume={earlier[-1]} (the "
                       f"complete ones: {', '.join(earlier)}), or start afresh with "
                       "checkpoint.resume=never")
            else:
                way = "start afresh with checkpoint.resume=never (no earlier complete tag)"
            raise ConfigError("checkpoint.resume", (
                f"checkpoint {tag}: {file} cannot be read ({problem}: cut short or "
                f"never fetched); {way}")) from err

    def _written(self, tag: str, engines: dict) -> bool:
        return any(os.path.exists(os.path.join(self.root, name, tag))
                   for name in list(engines) + ["trainer"])

    def _clear(self, tag: str, engine_names: list[str]) -> None:
        """Remove ``tag``'s folders; ``latest`` naming it goes back to the newest earlier tag
        (or away, with none)."""
        if self.latest() == tag:
            tags = self.tags()  # in step order
            earlier = tags[:tags.index(tag)] if tag in tags else []
            if earlier:
                self._write_latest(earlier[-1])
            else:
                os.remove(os.path.join(self.root, "latest"))
                fsync_dir(self.root)
        self._remove(tag, engine_names)

    def _remove(self, tag: str, engine_names: list[str]) -> None:
        """Remove ``tag``'s folders, its trainer state first (on disk before the rest goes):
        a crash in between leaves engine files that no tag names, not a tag without them."""
        trainer = os.path.join(self.root, "trainer")
        if os.path.isdir(os.path.join(trainer, tag)):
            shutil.rmtree(os.path.join(trainer, tag), ignore_errors=True)
            if os.path.exists(os.path.join(trainer, tag)):  # not removable: the tag stays whole
                return
            fsync_dir(trainer)
        for name in engine_names + ["hf"]:  # hf: checkpoint.save_hf's exports
            shutil.rmtree(os.path.join(self.root, name, tag), ignore_errors=True)

    def _write_latest(self, tag: str) -> None:
        """``latest`` names ``tag``, replaced in one rename (never half written), on disk."""
        write_durably(os.path.join(self.root, "latest"), lambda f: f.write(tag.encode()))

    def tags(self) -> list[str]:
        return checkpoint_tags(self.root)

    def set_aside(self) -> Optional[str]:
        """A fresh start where an earlier run left checkpoints: move them whole to
        ``<root>.earlier-<time>`` (a rename, nothing copied or deleted), so that this run's
        tags, ``keep_last`` and a later ``checkpoint.resume: auto`` see this run's alone (a
        crash before its first save and a restart under ``auto`` resumed the earlier run into
        this one's logs). Returns where they went, or None when there were none. A root that
        is a link (checkpoints kept on another disk) stays one: its folder moves beside itself
        there, and the link points at a new empty one."""
        if not self.tags():
            return None
        real = os.path.realpath(self.root)
        aside = base = f"{real}.earlier-{time.strftime('%Y%m%d-%H%M%S')}"
        again = 1
        while os.path.exists(aside):
            again += 1
            aside = f"{base}-{again}"
        os.rename(real, aside)
        if os.path.islink(self.root):
            os.makedirs(real)
        return aside

    def _prune(self, engine_names: list[str]) -> None:
        """Remove all but the newest ``keep_last`` tags up to ``latest``. Tags of later steps are
        a branch left by resuming an older tag: left alone while the run is short of them (its
        save of the same step replaces one; one it passes without saving counts again). What a
        crash mid-save or mid-prune left of tags before ``latest`` goes too."""
        keep = self.latest()
        tags = self.tags()
        left = set()
        if keep in tags:  # latest is then the last of them: keep_last >= 1 never removes it
            tags = tags[:tags.index(keep) + 1]
            left = {t for name in engine_names + ["trainer", "hf"]
                    for t in _listed(os.path.join(self.root, name))
                    if _TAG.match(t) and _step(t) < _step(keep) and t not in tags}
        for tag in tags[:-self.keep_last] + sorted(left, key=_step):
            self._remove(tag, engine_names)
