"""Files written whole or not at all, and on disk once written: what a crash mid-run (a kill,
a lost node, a power cut) must not tear or lose, as the checkpoint's ``latest`` and trainer
states and the run's history rewritten at a resume."""
from __future__ import annotations

import errno
import os
from typing import BinaryIO, Callable


def write_durably(path: str, write: Callable[[BinaryIO], None]) -> None:
    """``write(f)`` fills a temporary file beside ``path`` (binary), which is flushed,
    fsynced and renamed over ``path``; then the folder is fsynced, so that the rename too
    survives a crash. A reader sees the old file or the new one, never a part; an error in
    ``write`` leaves the old one and no temporary file."""
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a kill (KeyboardInterrupt) too: no stray temporary file
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(folder)


def fsync_dir(folder: str) -> None:
    """Flush ``folder``'s entries (a file renamed or created in it) to disk. A filesystem that
    cannot sync a folder (EINVAL, ENOTSUP) orders its metadata itself: nothing to do there."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(folder: str) -> None:
    """Flush every file under ``folder``, and its folders' entries, to disk: what another
    writer (DeepSpeed's checkpoint, which syncs nothing) left in the page cache. Before a
    ``latest`` names it: a power cut then keeps the files that ``latest`` promises. On a
    shared folder another rank may still be writing there (Megatron's shards of another
    pipeline stage, through a temporary file it renames): a file gone by the time it is
    opened is skipped, that rank syncs its own."""
    for top, _, names in os.walk(folder):
        for name in names:
            try:
                fd = os.open(os.path.join(top, name), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(top)
