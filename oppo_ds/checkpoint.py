"""Checkpoints: engines (weights, optimizer, scheduler) through the engine interface, plus
the trainer's own state per rank (step, data cursor, RNG states).

Layout under ``root``: ``<engine>/<tag>/`` (the engine's own format), ``trainer/<tag>/rank<r>.pt``
and ``latest``. ``latest`` is written last, by an atomic rename, after every rank finished:
a run killed mid-save still resumes from the previous complete checkpoint.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from typing import Optional

import torch
import torch.distributed as dist

_TAG = re.compile(r"^step(\d+)$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    def __init__(self, root: str, *, rank: int, keep_last: int):
        self.root, self.rank, self.keep_last = root, rank, keep_last

    def latest(self) -> Optional[str]:
        path = os.path.join(self.root, "latest")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return f.read().strip() or None

    def save(self, tag: str, state: dict, engines: dict) -> None:
        for name, engine in engines.items():
            engine.save(os.path.join(self.root, name), tag)
        state = dict(state, python_rng=random.getstate(), torch_rng=torch.get_rng_state())
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        folder = os.path.join(self.root, "trainer", tag)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".rank{self.rank}.pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(folder, f"rank{self.rank}.pt"))
        _barrier()
        if self.rank == 0:
            tmp = os.path.join(self.root, ".latest.tmp")
            with open(tmp, "w") as f:
                f.write(tag)
            os.replace(tmp, os.path.join(self.root, "latest"))
            self._prune(list(engines))
        _barrier()

    def load(self, tag: str, engines: dict) -> dict:
        """Restore the engines and RNG states of ``tag``; returns the trainer state."""
        path = os.path.join(self.root, "trainer", tag, f"rank{self.rank}.pt")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint {tag!r} has no trainer state for rank "
                                    f"{self.rank} ({path}); was it saved with another world size?")
        for name, engine in engines.items():
            engine.load(os.path.join(self.root, name), tag)
        # on the CPU: a GPU tensor in the state (a pool row's streamed scores) would otherwise
        # come back on the saving rank's GPU, which a resume on another layout may not have
        state = torch.load(path, weights_only=False, map_location="cpu")
        random.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        return state

    def tags(self) -> list[str]:
        folder = os.path.join(self.root, "trainer")
        found = [t for t in os.listdir(folder) if _TAG.match(t)] if os.path.isdir(folder) else []
        return sorted(found, key=lambda t: int(_TAG.match(t).group(1)))

    def _prune(self, engine_names: list[str]) -> None:
        keep = self.latest()
        for tag in self.tags()[:-self.keep_last]:
            if tag == keep:
                continue
            for name in engine_names + ["trainer"]:
                shutil.rmtree(os.path.join(self.root, name, tag), ignore_errors=True)
