"""Directories that every rank must see as one: checked once at start, across nodes.

Under data parallel each rank writes its own part of a checkpoint (trainer state, ZeRO
partitions) into ``logging.output_dir`` and a resume reads every part; rank 0 prepares the
built-in workload in ``workload.cache_dir`` and the other ranks load it after a barrier. On a
node-local disk (``/tmp``, ``/scratch``, ``/dev/shm``) the ranks of another node see none of
that: they would not find the workload (``sources.resolve_sources`` stops them, naming the
folder), or take an incomplete checkpoint for none and start afresh beside ranks that resume.
Rank 0 therefore writes a mark into each directory, and every rank looks for it; one that
cannot see it stops the run, naming the key, its path and the hosts that do not share it.
"""
from __future__ import annotations

import os
import secrets
import socket
import time

import torch
import torch.distributed as dist

from . import comm
from .config_types import ConfigError

MARK = ".oppo-shared-{:016x}"
WHY = {"logging.output_dir": "Every rank writes its part of each checkpoint there, and a "
                             "resume reads all of them",
       "workload.cache_dir": "Rank 0 prepares the built-in workload there, and the other ranks "
                             "load it"}
# what to do about a folder some node does not share (here and in sources.resolve_sources)
SHARE_IT = "put it on a filesystem all nodes share (NFS, Lustre, GPFS, a shared home), under " \
    "the same path"
# how long a rank waits for rank 0's mark to show before it calls the directory unshared:
# a shared filesystem shows a file created before the barrier at once, and this only delays
# the run that fails
SETTLE_S = 5.0


def check_shared_dirs(dirs: dict[str, str], *, settle_s: float = SETTLE_S) -> None:
    """Raise the same ``ConfigError`` on every rank of the world when some rank cannot create
    a directory of ``dirs`` (the lowest such rank's first key names it), else when some rank
    does not see, within ``settle_s``, a file rank 0 created there (the first such key of
    ``dirs``, in its order). ``dirs`` maps config keys to paths (created when missing, as the
    run would) and must be the same on every rank; a relative path is each rank's own working
    directory's. One rank, or no group: nothing to check."""
    if not comm.active() or not dirs:
        return
    rank, host = dist.get_rank(), socket.gethostname()
    token = comm.broadcast(torch.tensor([secrets.randbits(62) if rank == 0 else 0]), 0)
    name = MARK.format(int(token.item()))
    marks = {key: os.path.join(path, name) for key, path in dirs.items()}
    where = {key: _absolute(path) for key, path in dirs.items()}  # by this rank's cwd
    problem = None
    # every rank creates the folders, as the run would: on NFS a folder made by another node
    # can stay hidden behind a "no such file" this node cached for an earlier lookup
    for key, path in dirs.items():
        try:
            os.makedirs(path, exist_ok=True)
            if rank == 0:
                with open(marks[key], "w") as f:
                    f.write(host)
        except (OSError, ValueError) as err:  # every rank must reach the collectives below
            problem = (key, f"{where[key]} cannot be written by rank {rank} ({host}): {err}")
            break
    dist.barrier()
    missing = [key for key in dirs if not os.path.exists(marks[key])]
    deadline = time.monotonic() + settle_s
    while missing and problem is None and time.monotonic() < deadline:
        time.sleep(0.2)
        missing = [key for key in missing if not os.path.exists(marks[key])]
    seen = comm.gather_lists([(host, missing, problem, where)])
    dist.barrier()  # every rank has looked: the marks can go
    if rank == 0:
        for mark in marks.values():
            try:
                os.remove(mark)
            except OSError:
                pass
    problems = [p for _, _, p, _ in seen if p is not None]
    if problems:
        raise ConfigError(*problems[0])
    host0, _, _, where0 = seen[0]
    for key in dirs:
        # a rank in another working directory resolves a relative path elsewhere: say so
        blind = [f"rank {r} ({other})" if at[key] == where0[key] else
                 f"rank {r} ({other}, where it is {at[key]})"
                 for r, (other, miss, _, at) in enumerate(seen) if key in miss]
        if blind:
            raise ConfigError(key, (
                f"{where0[key]} is not one directory for every rank: {', '.join(blind)} cannot "
                f"see the file rank 0 ({host0}) wrote there. {WHY.get(key, 'Every rank uses it')}: "
                f"{SHARE_IT}"))


def _absolute(path: str) -> str:
    """``path`` made absolute by this process's working directory; as given when that is
    gone (nothing may raise before the check's barrier on one rank alone)."""
    try:
        return os.path.abspath(path)
    except (OSError, ValueError):
        return path
