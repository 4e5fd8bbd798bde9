"""Stop on a signal with a checkpoint (oppo_ds/preemption.py): a real `oppo-train` process
receives SIGUSR1, checkpoints after the step it is in, exits 75, and the same command
resumes from that checkpoint; over 2 real gloo ranks a signal to one rank stops both after
the same step."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from _builders import single_process_env, tiny_run_overrides
from oppo_ds.engines.deepspeed_engine import find_free_port
from oppo_ds.preemption import (PREEMPTED_EXIT, STOPPED_MARK, StopOnSignal, hold_early_signals,
                                release_early_signals)
from oppo_ds.telemetry import read_history


def _train(args, **kw):
    return subprocess.Popen([sys.executable, "-m", "oppo_ds.train", *args], env=single_process_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def test_usr1_checkpoints_after_the_step_and_the_same_command_resumes(tmp_path):
    steps = 400  # far more than run before the signal: the run must stop early
    args = [*tiny_run_overrides(tmp_path, steps), "checkpoint.every=0", "logging.tensorboard=false"]
    metrics = tmp_path / "run" / "metrics.jsonl"
    proc = _train(args)
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.time() < deadline, "no steps logged"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == PREEMPTED_EXIT, out[-3000:]
    done = len(read_history(str(metrics)))
    assert 3 <= done < steps
    # checkpoint.every=0 saves only at the end: this one exists because of the signal
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == f"step{done}"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_by_signal"] == "SIGUSR1" and summary["steps"] == done
    assert not (tmp_path / "run" / "actor").exists()  # no export of an unfinished run
    mark = tmp_path / "run" / STOPPED_MARK  # what slurm/train.sh requeues on
    assert mark.read_text() == f"SIGUSR1 step{done}\n"

    # the same command, two steps further: resumes at the signalled step
    args[0] = f"steps={done + 2}"
    proc = _train(args)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert f"resumed from step{done} at step {done}" in out
    assert [r["step"] for r in read_history(str(metrics))] == list(range(1, done + 3))
    assert not mark.exists()

    # a USR1 while the run starts (here before its config is read; on a cluster while the
    # models load): USR1's default action ended every rank and the job was not requeued; it
    # is held until training begins, and the run stops before its first step
    args[0] = f"steps={done + 4}"
    proc = _train(args)
    while not _catches(proc.pid, signal.SIGUSR1):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == PREEMPTED_EXIT, out[-3000:]
    assert "stopped by SIGUSR1 before its first step" in out
    assert [r["step"] for r in read_history(str(metrics))] == list(range(1, done + 3))
    assert (ckpt / "latest").read_text().strip() == f"step{done + 2}"
    assert mark.read_text() == f"SIGUSR1 step{done + 2}\n"


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (Linux: /proc/PID/status SigCgt)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


def _rank(rank: int, port: int, signalled: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    with StopOnSignal(["USR1", "TERM"]) as stop:
        results = [stop.agreed()]  # nothing yet
        if rank == signalled:
            signal.raise_signal(signal.SIGUSR1)
        results.append(stop.agreed())
    out.put((rank, results, signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL))
    dist.destroy_process_group()


def test_a_signal_to_one_rank_stops_every_rank():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = find_free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, 1, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    # both ranks agree: nothing before, USR1 after (only rank 1 received it); the default
    # handler is back once training ends
    assert got == [(0, [None, "USR1"], True), (1, [None, "USR1"], True)]


def test_a_usr1_while_the_run_starts_is_held_for_training():
    """hold_early_signals: a USR1 before training is recorded, not fatal, and the training's
    StopOnSignal takes it over; the process's own handlers come back after either."""
    before = signal.getsignal(signal.SIGUSR1)
    hold_early_signals()
    signal.raise_signal(signal.SIGUSR1)  # USR1's default action would end pytest here
    with StopOnSignal(["USR1", "TERM"]) as stop:
        assert stop.received == "USR1"
        assert signal.getsignal(signal.SIGUSR1) == stop._handle
    assert signal.getsignal(signal.SIGUSR1) == before
    hold_early_signals()
    assert release_early_signals() is None  # a run that ended before training: nothing held
    assert signal.getsignal(signal.SIGUSR1) == before
    # held, but not one of checkpoint.on_signals: its default action once training begins
    code = ("import signal\nfrom oppo_ds.preemption import StopOnSignal, hold_early_signals\n"
            "hold_early_signals()\nsignal.raise_signal(signal.SIGUSR1)\n"
            "print('held', flush=True)\nwith StopOnSignal(['TERM']):\n"
            "    print('not reached', flush=True)\n")
    _dies_of(code, signal.SIGUSR1, after="held")
    # a run that trains nothing (--evaluate) drops the hold: what it held takes its action
    code = ("import signal\nfrom oppo_ds.preemption import drop_early_hold, hold_early_signals\n"
            "hold_early_signals(('USR1', 'TERM'))\nsignal.raise_signal(signal.SIGTERM)\n"
            "print('held', flush=True)\ndrop_early_hold()\nprint('not reached', flush=True)\n")
    _dies_of(code, signal.SIGTERM, after="held")


def _dies_of(code: str, sig: int, after: str) -> None:
    """Python ``code`` run in a child (so that pytest survives) prints ``after``, then the
    default action of ``sig`` ends it before it prints 'not reached'. Outside a Slurm job
    (where a second TERM is only recorded), even when the tests run inside one."""
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == -sig, proc.stderr[-2000:]
    assert after in proc.stdout and "not reached" not in proc.stdout


def test_handlers_are_restored_and_a_second_term_is_not_swallowed():
    before = signal.getsignal(signal.SIGUSR1)
    with StopOnSignal(["USR1"]) as stop:
        assert signal.getsignal(signal.SIGUSR1) == stop._handle
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)  # a second USR1 is only recorded once
        assert stop.received == "USR1"
    assert signal.getsignal(signal.SIGUSR1) == before
    # a second TERM takes the default action: run it in a child so pytest survives
    code = ("import signal, time\nfrom oppo_ds.preemption import StopOnSignal\n"
            "with StopOnSignal(['TERM']):\n"
            "    signal.raise_signal(signal.SIGTERM)\n    print('first TERM recorded', flush=True)\n"
            "    signal.raise_signal(signal.SIGTERM)\n    print('not reached', flush=True)\n")
    _dies_of(code, signal.SIGTERM, after="first TERM recorded")


def test_the_resume_hint_follows_checkpoint_resume():
    """After a stop (or a non-finite step) the log says how to resume: the same command under
    ``checkpoint.resume: auto``; under ``never`` or a tag that command would start afresh or
    load its tag again, so the hint names ``auto`` instead."""
    from types import SimpleNamespace

    from oppo_ds.config import load_config
    from oppo_ds.trainer import PPOTrainer

    def hint(resume):
        trainer = SimpleNamespace(cfg=load_config(None, [f"checkpoint.resume={resume}"]))
        return PPOTrainer._resume_hint(trainer, "it")

    assert hint("auto") == "the same command resumes from it"
    assert hint("never") == ("checkpoint.resume=auto resumes from it (this run's "
                             "checkpoint.resume=never would start afresh)")
    assert hint("step4") == ("checkpoint.resume=auto resumes from it (this run's "
                             "checkpoint.resume=step4 would load step4 again)")
