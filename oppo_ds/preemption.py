"""Stop on a signal with a checkpoint: what a preempted or time-limited cluster job needs.

Slurm sends a signal some time before it stops a job (``#SBATCH --signal=B:USR1@300``;
slurm/train.sh forwards it to the tasks). A rank that receives one of
``checkpoint.on_signals`` only records it; at the end of the step every rank learns whether
any rank got one (one all-reduce of a flag), so all of them stop after the same step, save
the same checkpoint and exit with :data:`PREEMPTED_EXIT`, which the job script turns into
a requeue. The resumed job continues from that checkpoint exactly (checkpoint.resume=auto).

A second TERM or INT stops the process at once (the default action), for a user who does
not want to wait for the step to end; in a Slurm job (``SLURM_JOB_ID`` set) a second TERM is
only recorded. Slurm sends TERM more than once and KILL after it: a preemption's notice to
the tasks, then at the end of its GraceTime (as on ``scancel`` and at the time limit) TERM to
the tasks, twice in Slurm 22.05, and to srun and the batch script, and KILL ``KillWait``
seconds later. The save that the first TERM started gets all of that time; stopping at the
second one cut it short, and a save longer than the grace time left no checkpoint
(tests/test_slurm.py, the preemption test).

A USR1 that arrives before training begins (while the config resolves, the workload is
prepared, the models load and DeepSpeed builds its ops: minutes for a big model) is held
(:func:`hold_early_signals`) and handed to :class:`StopOnSignal`: every rank then stops before
its first step, trains nothing, saves nothing (the checkpoint it resumed from stands) and
exits with :data:`PREEMPTED_EXIT`. Without it USR1's default action ended every rank, and
the job was not requeued. In a Slurm job TERM is held as well: a preemption's notice while
the models load ended every rank, the job ended before its grace time did, and Slurm did not
requeue it (a job that ends by itself during the grace time ends TIMEOUT, 22.05).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist

from . import comm

logger = logging.getLogger(__name__)

PREEMPTED_EXIT = 75
"""Exit code after a checkpoint on a signal (EX_TEMPFAIL: run the same command again)."""

STOPPED_MARK = "stopped_on_signal"
"""A file in ``logging.output_dir`` that rank 0 writes when every rank stopped on a signal
(after the checkpoint, if one was due) and removes when a run starts: slurm/train.sh requeues
on it even when a rank's exit code was lost (``srun --kill-on-bad-exit`` ends the ranks still
tearing down once the first exits with 75)."""


def signal_number(name: Optional[str]) -> int:
    """``"USR1"`` -> signal.SIGUSR1's number; None -> 0 (how the wire and flags say "none")."""
    return int(getattr(signal, f"SIG{name}")) if name else 0


def signal_name(number: int) -> Optional[str]:
    """The inverse of :func:`signal_number`."""
    return signal.Signals(number).name.removeprefix("SIG") if number else None


_EARLY: dict = {"received": None, "previous": {}}  # hold_early_signals' state


def _in_slurm_job() -> bool:
    """Whether this process runs in a Slurm job, where TERM comes more than once (see the
    module's docstring)."""
    return bool(os.environ.get("SLURM_JOB_ID"))


def hold_early_signals(names: Optional[tuple[str, ...]] = None) -> None:
    """Record ``names`` instead of taking their default action until a :class:`StopOnSignal`
    takes over (see the module's docstring). By default USR1, and TERM in a Slurm job: outside
    one a TERM or Ctrl-C while a run starts still ends it, as a user who sends one expects.
    In the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    if names is None:
        names = ("USR1", "TERM") if _in_slurm_job() else ("USR1",)
    for name in names:
        number = signal_number(name)
        _EARLY["previous"].setdefault(number, signal.signal(number, _hold))


def _hold(signum, frame) -> None:
    if _EARLY["received"] is None:
        _EARLY["received"] = signal_name(signum)
        logger.warning("SIG%s received while the run starts: it stops before its first step",
                       _EARLY["received"])


def release_early_signals() -> Optional[str]:
    """The held signal (None if none), the process's own handlers back in place (a no-op
    once a ``StopOnSignal`` took them over)."""
    received, _EARLY["received"] = _EARLY["received"], None
    for number, previous in _EARLY["previous"].items():
        signal.signal(number, previous)
    _EARLY["previous"].clear()
    return received


def drop_early_hold() -> None:
    """For a run that trains nothing (``oppo-train --evaluate``: no checkpoint to stop with):
    the process's own handlers back, and a signal held meanwhile takes its own action now
    (TERM, USR1: the default, ending the process), as without :func:`hold_early_signals`."""
    held = release_early_signals()
    if held is not None:
        signal.raise_signal(signal_number(held))


class StopOnSignal:
    """Records the first of ``names`` (``"USR1"``, ``"TERM"``, ...) that arrives; installed
    while training runs (:meth:`__enter__`), the previous handlers restored after."""

    def __init__(self, names: list[str] | tuple[str, ...]):
        self.signals = [signal_number(name) for name in names]
        self.received: Optional[str] = None
        self._here = False  # a signal reached this process (not only another one of the run)
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        name = signal_name(signum)
        if self._here and signum in self._stop_now():
            # asked twice: stop now, as without us
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        if self._here:
            logger.warning("SIG%s again: the step and its checkpoint go on (a Slurm job: KILL "
                           "comes KillWait seconds after Slurm's TERM)", name)
        self._here = True
        self.record(name)

    @staticmethod
    def _stop_now() -> tuple:
        """The signals that stop at once when they come a second time (see the module)."""
        if _in_slurm_job():  # Slurm repeats TERM itself, and KILLs after
            return (signal.SIGINT,)
        return (signal.SIGTERM, signal.SIGINT)

    def record(self, name: str, where: str = "") -> None:
        """Take ``name`` (``"USR1"``) as received here, unless one was already: also for a
        signal that reached another process of the run (``where`` says which)."""
        if self.received is None:
            self.received = name
            logger.warning("SIG%s received%s: stopping after this step with a checkpoint", name,
                           f" by {where}" if where else "")

    @property
    def number(self) -> int:
        """The received signal's number, 0 for none."""
        return signal_number(self.received)

    def __enter__(self) -> "StopOnSignal":
        # Python runs handlers in the main thread only; elsewhere (a trainer inside a worker
        # thread) the process keeps its own handling
        if threading.current_thread() is threading.main_thread():
            early = release_early_signals()
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
            if early is not None and signal_number(early) in self.signals:
                self._here, self.received = True, early  # _hold logged it
            elif early is not None:  # not one to stop on (checkpoint.on_signals): as without us
                signal.raise_signal(signal_number(early))
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def agreed(self, group=None) -> Optional[str]:
        """Collective over ``group``: the name of a signal received by any rank (the
        lowest-numbered one when ranks got different ones), or None."""
        code = float(self.number)
        if not (dist.is_available() and dist.is_initialized()):
            return self.received
        flag = comm.all_reduce(torch.tensor([code if code else float("inf")], dtype=torch.float64),
                               op=dist.ReduceOp.MIN, group=group)
        if flag.item() == float("inf"):
            return None
        return signal_name(int(flag.item()))
