"""Slurm: the srun rendezvous and the TERM rules of oppo_ds/preemption.py in a Slurm job
(tier 0); a real single-node Slurm cluster (tier 2) that runs slurm/train_70b.sh on the tiny
config with 2 CPU tasks, then resumes it, stops it by USR1, by Slurm's own preemption (TERM,
GraceTime) and by TERM to the batch script; and a real
two-node cluster on this machine, the second node in a network namespace of its own, where a
job of one rank per node is stopped by USR1, requeued and resumed.

The cluster tests need root and apt (they install slurm-wlm and munge when missing), and the
two-node one `ip netns`, `unshare` and `nsenter`; they start munged, slurmctld and slurmd
themselves, and stop them (and remove the namespace) at teardown."""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import pytest

from oppo_ds.engines.deepspeed_engine import expand_hostlist, slurm_rendezvous
from oppo_ds.telemetry import read_history

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- tier 0: env mapping

@pytest.mark.parametrize("hostlist, hosts", [
    ("localhost", ["localhost"]),
    ("a,b", ["a", "b"]),
    ("node[01-03,05]", ["node01", "node02", "node03", "node05"]),
    ("gpu[8-11],cpu1", ["gpu8", "gpu9", "gpu10", "gpu11", "cpu1"]),
    ("r[1-2]-n[09-10]", ["r1-n09", "r1-n10", "r2-n09", "r2-n10"]),
    ("x[7],y[001-002]", ["x7", "y001", "y002"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


SRUN_TASK = {"SLURM_PROCID": "9", "SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "16",
             "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123456",
             "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08]"}


def test_slurm_rendezvous_from_srun_variables():
    assert slurm_rendezvous(SRUN_TASK) == {
        "RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(10000 + 123456 % 20000)}
    # the port is a function of the job only: every task of the job agrees on it
    other = dict(SRUN_TASK, SLURM_PROCID="0", SLURM_LOCALID="0")
    assert slurm_rendezvous(other)["MASTER_PORT"] == slurm_rendezvous(SRUN_TASK)["MASTER_PORT"]
    assert slurm_rendezvous(dict(SRUN_TASK, MASTER_PORT="29500"))["MASTER_PORT"] == "29500"
    # a LOCAL_RANK left in the environment (sbatch exports the submitting shell's) is not the
    # task's: every task of a node would take GPU 0
    assert slurm_rendezvous(dict(SRUN_TASK, LOCAL_RANK="0"))["LOCAL_RANK"] == "1"


def test_oppo_train_reads_its_rank_before_the_group_exists():
    """oppo-train sets its log level (INFO on rank 0 only) before torch.distributed is up:
    under a bare srun it must read the rank srun gives, not take every task for rank 0."""
    from oppo_ds.cli.train import launch_rank

    assert launch_rank(SRUN_TASK) == (9, 16)
    assert launch_rank(dict(SRUN_TASK, RANK="3", WORLD_SIZE="4")) == (3, 4)  # a launcher's
    assert launch_rank({}) == (0, 1)


def test_slurm_rendezvous_leaves_launchers_and_batch_shell_alone():
    assert slurm_rendezvous({}) is None
    # the deepspeed launcher / torchrun inside an allocation already set the rank
    assert slurm_rendezvous(dict(SRUN_TASK, RANK="3", WORLD_SIZE="16")) is None
    # the batch script itself (python run without srun): no step, not a rank of a group
    batch = {k: v for k, v in SRUN_TASK.items() if not k.startswith("SLURM_STEP_")}
    assert slurm_rendezvous(batch) is None


def _child(code: str, slurm_job: bool) -> subprocess.CompletedProcess:
    """Python ``code`` in a child (its signals do not reach pytest), in a Slurm job's
    environment (SLURM_JOB_ID) or outside one."""
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    if slurm_job:
        env["SLURM_JOB_ID"] = "123456"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def test_a_repeated_term_in_a_slurm_job_does_not_cut_the_save_short():
    """Slurm sends TERM again at the end of a preemption's grace time (twice, 22.05), and on
    scancel, then KILL after KillWait: in a Slurm job a second TERM is only recorded, and the
    checkpoint the first one started goes on. Outside Slurm it still stops at once."""
    code = ("import signal\nfrom oppo_ds.preemption import StopOnSignal\n"
            "with StopOnSignal(['USR1', 'TERM']) as stop:\n"
            "    for _ in range(3):\n        signal.raise_signal(signal.SIGTERM)\n"
            "    print('saved after', stop.received, flush=True)\n")
    proc = _child(code, slurm_job=True)
    assert proc.returncode == 0 and "saved after TERM" in proc.stdout, proc.stderr[-2000:]
    assert "SIGTERM again: the step and its checkpoint go on" in proc.stderr
    proc = _child(code, slurm_job=False)
    assert proc.returncode == -signal.SIGTERM and "saved" not in proc.stdout, proc.stderr[-2000:]
    # a second Ctrl-C still stops at once, in a Slurm job as well
    code = code.replace("SIGTERM", "SIGINT").replace("'TERM'", "'INT'")
    assert _child(code, slurm_job=True).returncode == -signal.SIGINT


def test_a_term_while_a_slurm_job_starts_is_held_for_training():
    """A preemption's TERM while the models load: in a Slurm job it is held, as USR1 is, and
    training stops before its first step (exit 75, requeue) instead of every rank dying and the
    job ending during its grace time, which Slurm does not requeue. Outside Slurm TERM still
    ends a starting run."""
    code = ("import signal\nfrom oppo_ds.preemption import StopOnSignal, hold_early_signals\n"
            "hold_early_signals()\nsignal.raise_signal(signal.SIGTERM)\n"
            "print('held', flush=True)\n"
            "with StopOnSignal(['USR1', 'TERM']) as stop:\n    print('stops on', stop.received)\n")
    proc = _child(code, slurm_job=True)
    assert proc.returncode == 0 and "held" in proc.stdout and "stops on TERM" in proc.stdout, \
        proc.stderr[-2000:]
    proc = _child(code, slurm_job=False)
    assert proc.returncode == -signal.SIGTERM and "held" not in proc.stdout, proc.stderr[-2000:]


# ---------------------------------------------------------------- tier 2: a real cluster

SMALL = ["workload.num_prompts=64", "workload.sft_steps=20", "workload.reward_steps=20",
         "generation.max_new_tokens=24", "ppo.batch_size=4", "ppo.mini_batch_size=4",
         "ppo.micro_batch_size=2", "logging.progress=false", "logging.log_every=0",
         "system.torch_threads=1", "checkpoint.every=1", "checkpoint.export_hf=false"]

# {d}: the cluster's folder; a node's spool, pid and log files are its own (%n: its name)
SLURM_CONF = """\
ClusterName={cluster}
FirstJobId={first_job_id}
SlurmctldHost={ctld_host}
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ReturnToService=2
{nodes}
"""
# preemption as a cluster sets it up: a job of partition urgent preempts the default
# partition's, which get GraceTime seconds after Slurm's TERM, then are requeued
ONE_NODE = """\
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=2000
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP PriorityTier=1 \
GraceTime=10 PreemptMode=REQUEUE
PartitionName=urgent Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF"""


def _munge_works() -> bool:
    if shutil.which("munge") is None:
        return False
    enc = subprocess.run(["munge", "-n"], capture_output=True)
    return enc.returncode == 0 and subprocess.run(["unmunge"], input=enc.stdout,
                                                  capture_output=True).returncode == 0


def _apt_install(binaries: tuple, packages: tuple, what: str) -> None:
    """Installs ``packages`` with apt unless every one of ``binaries`` is found; skips the
    test (saying why) when that cannot be done."""
    if all(shutil.which(b) for b in binaries):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        reason = "not root" if os.geteuid() != 0 else "apt-get is not available"
        print(f"skipping {what}: {reason}, cannot install {' and '.join(packages)}")
        pytest.skip(f"{' and '.join(packages)} not installed and cannot be: {reason}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def _install_slurm() -> None:
    _apt_install(("slurmctld", "slurmd", "sbatch", "munged"), ("slurm-wlm", "munge"),
                 "the Slurm cluster test")


def _wait_for(predicate, what: str, timeout: float = 30.0, poll: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll)
    raise TimeoutError(f"{what} within {timeout:.0f} s")


def _cancel_all_jobs(env) -> None:
    """Cancels this cluster's jobs and waits for them to end: with the daemons gone first, a
    running job's slurmstepd would be left waiting for them."""
    def queue() -> list[str]:
        proc = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=env)
        return proc.stdout.split()

    jobs = queue()
    if jobs:
        subprocess.run(["scancel", *jobs], env=env)
        try:
            _wait_for(lambda: not queue(), "the cancelled jobs end", 60)
        except TimeoutError as err:
            print(f"slurm_cluster teardown: {err}")


def _needs_root(what: str) -> None:
    if os.geteuid() != 0:
        print(f"skipping {what}: not root (munged/slurmd need root)")
        pytest.skip("not root")


@pytest.fixture(scope="module")
def munge():
    """munged answering on its usual socket: the one already running, else one started here
    (and stopped at teardown). Every cluster below authenticates through it."""
    _needs_root("the Slurm cluster tests")
    _install_slurm()
    proc = None
    if not _munge_works():
        for path in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
            os.makedirs(path, exist_ok=True)
            shutil.chown(path, "munge", "munge")
        # runuser switches to munge in the child, not Python's user=/group=: with those
        # Python forks instead of vforking, and a fork accounts this test process's whole
        # heap again (after ~1000 tests its virtual heap passed the machine's 23 GiB once:
        # ENOMEM, "__vm_enough_memory ... 26000039936" in dmesg, every Slurm test errored)
        proc = subprocess.Popen(["runuser", "-u", "munge", "--", "munged", "--foreground"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for(_munge_works, "munged answers")
    yield
    if proc is not None:
        _stop([proc])


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        proc.terminate()
    for proc in reversed(procs):
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _cluster_env(conf) -> dict:
    # earlier tests in this process may have left a launcher's rendezvous variables behind;
    # the jobs must see only what a user's shell would (slurm/train.sh unsets them as well)
    launcher = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"}
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["SLURM_CONF"] = str(conf)
    return env


def _nodes_idle(env, count: int) -> bool:
    # one line per node and partition: a node in two partitions (ONE_NODE's) is listed twice
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                         env=env)
    states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
    return len(states) == count and set(states.values()) == {"idle"}


@pytest.fixture(scope="module")
def slurm_cluster(munge, tmp_path_factory):
    """A one-node Slurm cluster (localhost, 2 CPUs); yields the environment that reaches it."""
    from oppo_ds.engines.deepspeed_engine import find_free_port

    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool-localhost"):
        (d / sub).mkdir()
    conf = d / "slurm.conf"
    # job ids from a random start: the jobs' MASTER_PORT (derived from the id) varies per run
    conf.write_text(SLURM_CONF.format(d=d, cluster="oppotest", ctld_host="localhost",
                                      ctld_port=find_free_port(), d_port=find_free_port(),
                                      first_job_id=random.randrange(1, 1_000_000),
                                      nodes=ONE_NODE))
    env = _cluster_env(conf)
    started: list[subprocess.Popen] = []
    try:
        started.append(subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        started.append(subprocess.Popen(["slurmd", "-D", "-N", "localhost", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_for(lambda: _nodes_idle(env, 1), "the node is idle")
        yield env
    finally:
        if started:
            _cancel_all_jobs(env)
        _stop(started)


def test_expand_hostlist_matches_scontrol(slurm_cluster):
    hostlist = "node[01-03,05],gpu[8-11],r[1-2]-n[09-10]"
    proc = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True,
                          env=slurm_cluster)
    assert proc.returncode == 0, proc.stderr
    assert expand_hostlist(hostlist) == proc.stdout.split()


@pytest.fixture(scope="module")
def workload_cache(tmp_path_factory):
    """The built-in workload's tokenizer, prompts and tuned models, prepared by the first job."""
    return tmp_path_factory.mktemp("workload-cache")


def _sbatch_70b(env, tmp_path, cache, steps: int, wait: bool = True, launcher: str = "srun",
                extra: tuple = (), python: str = sys.executable, nodes: int = 1,
                output_dir: str | None = None, ok: bool = True) -> tuple[str, str]:
    """Submits slurm/train_70b.sh on the tiny config with 2 CPU tasks on ``nodes`` nodes;
    returns the job id and the path of its output file (complete once the job ended, when
    ``wait``). ``ok``: whether sbatch (with ``wait``, the job) must succeed, else fail."""
    job_env = dict(env, CONFIG="examples/configs/tiny.yaml",
                   OUTPUT_DIR=output_dir or str(tmp_path / "run"),
                   PYTHON=python, OMP_NUM_THREADS="1", LAUNCHER=launcher,
                   OVERRIDES=" ".join([*SMALL, f"steps={steps}", f"workload.cache_dir={cache}", *extra]))
    log = tmp_path / f"job-steps{steps}-{launcher}.out"
    # sbatch flags override the script's #SBATCH lines: 2 CPU tasks, no GPUs
    cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), f"--nodes={nodes}",
           f"--ntasks-per-node={2 // nodes}",
           "--cpus-per-task=1", "--gpus-per-node=0", "--time=10", f"--output={log}", "slurm/train_70b.sh"]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=600)
    text = log.read_text() if log.exists() else "(no job output file)"
    assert (proc.returncode == 0) == ok, f"sbatch exit {proc.returncode}: {proc.stderr}\n{text[-4000:]}"
    return proc.stdout.strip().split(";")[0], str(log)


def _job_field(env, job: str, field: str) -> str:
    proc = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env)
    match = re.search(rf"\b{field}=(\S+)", proc.stdout)
    return match.group(1) if match else ""


def _steps(env, job: str) -> list[str]:
    """The job's running steps (squeue), empty when none."""
    proc = subprocess.run(["squeue", "--steps", "--noheader", "--jobs", job, "--format", "%i"],
                          capture_output=True, text=True, env=env)
    return proc.stdout.split()


def _read(path) -> str:
    return open(path).read() if os.path.exists(path) else ""


def test_sbatch_70b_script_trains_tiny_then_resumes(slurm_cluster, workload_cache, tmp_path):
    out = tmp_path / "run"
    _, log = _sbatch_70b(slurm_cluster, tmp_path, workload_cache, steps=2)
    text = _read(log)
    assert '"world_size": 2' in text, text[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step2"
    assert sorted(os.listdir(out / "checkpoints" / "trainer" / "step2")) == ["rank0.pt", "rank1.pt"]
    events = [f for f in os.listdir(out / "tensorboard") if f.startswith("events.out.tfevents")]
    assert events, "no TensorBoard events"

    # a second job continues from step 2: one history line per step
    _, log = _sbatch_70b(slurm_cluster, tmp_path, workload_cache, steps=3)
    text = _read(log)
    assert "resumed from step2 at step 2" in text, text[-3000:]
    assert [r["step"] for r in read_history(str(out / "metrics.jsonl"))] == [1, 2, 3]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step3"


def test_usr1_checkpoints_requeues_and_the_job_resumes_there(slurm_cluster, workload_cache, tmp_path):
    """What the time limit does (--signal=B:USR1@300): USR1 to the batch shell, whose trap
    passes it to the srun tasks; both ranks stop after the same step with a checkpoint (no
    periodic ones here), exit 75, the script requeues the job, and the requeued job resumes
    from exactly that step. Rank 0 here takes 5 s longer to end, as its teardown (summary,
    TensorBoard) can: rank 1's 75 makes srun (--kill-on-bad-exit) end it, and srun's exit
    code is no longer 75 (the job ended FAILED 143 then); the file rank 0 wrote requeues it."""
    _usr1_requeue_resume(slurm_cluster, workload_cache, tmp_path, nodes=1)


# python for the preemption test's ranks: oppo_ds.train, whose checkpoint on a signal waits
# for the file {go} first (a save that outlasts the grace time, as a big model's can)
SLOW_SAVE = """\
import os, runpy, sys, time
sys.path.insert(0, os.getcwd())  # the repository the job runs in, as `python -m` has it
from oppo_ds.trainer import PPOTrainer
save = PPOTrainer.save_checkpoint
def save_checkpoint(self):
    deadline = time.monotonic() + 300
    while self.preempted and not os.path.exists({go!r}) and time.monotonic() < deadline:
        time.sleep(0.1)
    save(self)
PPOTrainer.save_checkpoint = save_checkpoint
assert sys.argv[1:3] == ["-m", "oppo_ds.train"], sys.argv
sys.argv = [sys.argv[0], *sys.argv[3:]]
runpy.run_module("oppo_ds.train", run_name="__main__", alter_sys=True)
"""


def test_preemption_term_the_save_outlasts_the_grace_time_and_the_job_resumes(
        slurm_cluster, workload_cache, tmp_path):
    """Slurm's own preemption, not an imitation of it: a job of partition urgent preempts the
    running train_70b.sh job (PreemptMode=REQUEUE, GraceTime=10). Slurm 22.05 sends TERM to the
    tasks only (not the batch script); the ranks finish the step and start the checkpoint,
    which here waits until the grace time is over. Then Slurm sends TERM again to the tasks
    (twice) and to srun and the batch script, requeues the job and KILLs what is left KillWait
    (30 s) later. The checkpoint completes in that time, the batch script waits for the ranks
    (it traps TERM) and does not requeue the job a second time, and the job Slurm requeued
    resumes from exactly that step. Before 2026-11-29 the second TERM ended every rank in the
    middle of its save (a repeated TERM stopped at once), TERM's default action ended the batch
    script, and the requeued job started again from step 0.

    Not `scancel --full -s TERM`: srun turns the TERM it receives into KILL for its tasks, so
    the ranks die before they see one (tried: "tasks 0-1: Killed"). Not `scancel -s TERM`
    alone: that is the grace time's first notice only, which the USR1 test's path covers."""
    env = slurm_cluster
    out, steps = tmp_path / "run", 60
    go = tmp_path / "grace-time-over"
    slow = tmp_path / "python-saves-after-the-grace-time"
    slow.write_text(f"#!{sys.executable}\n" + SLOW_SAVE.format(go=str(go)))
    slow.chmod(0o755)
    job, log = _sbatch_70b(env, tmp_path, workload_cache, steps=steps, wait=False,
                           extra=("checkpoint.every=0",), python=str(slow))
    metrics = out / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2,
              "two steps logged", 240, poll=0.1)
    urgent = subprocess.run(["sbatch", "--parsable", "--partition=urgent", "--ntasks=2",
                             "--cpus-per-task=1", "--time=2", f"--output={tmp_path / 'urgent.out'}",
                             "--wrap", "true"], env=env, capture_output=True, text=True, check=True)
    # the grace time is over when the controller requeues the job; its TERMs reach the tasks
    ctld_log = os.path.join(os.path.dirname(env["SLURM_CONF"]), "slurmctld.log")
    _wait_for(lambda: f"preempted JobId={job} has been requeued" in _read(ctld_log),
              "the grace time ends", 120)
    time.sleep(3)
    go.touch()
    _wait_for(lambda: not _steps(env, job), "the first run's steps end", 120)
    try:  # the batch script's last words, once srun ended (before KILL, KillWait after TERM)
        _wait_for(lambda: "oppo-train: the ranks stopped on a signal" in _read(log),
                  "the batch script reports", 40)
    except TimeoutError:
        pass  # the assertions below say what is missing
    text = _read(log)
    stopped = re.findall(r"rank (\d): stopped by SIGTERM after step (\d+)", text)
    assert sorted(r for r, _ in stopped) == ["0", "1"], text[-3000:]  # both ranks, same step
    (at,) = {int(n) for _, n in stopped}
    assert 2 <= at < steps
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step{at}", text[-3000:]
    assert "oppo-train: TERM (scancel" in text, text[-3000:]
    assert "not requeued by this script: Slurm ends the job" in text, text[-3000:]
    assert "requeueing job" not in text, text[-3000:]
    _wait_for(lambda: _job_field(env, urgent.stdout.strip().split(";")[0], "JobState")
              == "COMPLETED", "the urgent job ends", 120)
    assert _job_field(env, job, "Restarts") == "1"
    time.sleep(10)  # as in the USR1 test: slurmd finishes the first run's step
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)
    _wait_for(lambda: f"job {job} restart 1" in _read(log) and _job_field(env, job, "JobState")
              in ("COMPLETED", "FAILED", "CANCELLED"), "the requeued job ends", 420)
    text = _read(log)
    assert _job_field(env, job, "JobState") == "COMPLETED", text[-3000:]
    assert f"resumed from step{at} at step {at}" in text, text[-3000:]
    assert [r["step"] for r in read_history(str(metrics))] == list(range(1, steps + 1))


def test_term_to_the_batch_script_stops_with_a_checkpoint_and_no_requeue(
        slurm_cluster, workload_cache, tmp_path):
    """`scancel --batch --signal=TERM`: TERM to the batch script only. Its trap passes TERM to
    the tasks (scancel --signal=TERM, not to srun, which would KILL them), both ranks stop
    after the same step with a checkpoint, and the job ends COMPLETED, not requeued: TERM to
    the script means stop (USR1 means stop and come back). Before 2026-11-29 TERM's default
    action ended the script, the job ended FAILED at once, and the ranks had KillWait left."""
    env = slurm_cluster
    out, steps = tmp_path / "run", 60
    job, log = _sbatch_70b(env, tmp_path, workload_cache, steps=steps, wait=False,
                           extra=("checkpoint.every=0",))
    metrics = out / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2,
              "two steps logged", 240, poll=0.1)
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], env=env, check=True)
    _wait_for(lambda: _job_field(env, job, "JobState") in ("COMPLETED", "FAILED", "CANCELLED"),
              "the job ends", 240)
    text = _read(log)
    assert _job_field(env, job, "JobState") == "COMPLETED", text[-3000:]
    assert _job_field(env, job, "Restarts") == "0", text[-3000:]
    stopped = re.findall(r"rank (\d): stopped by SIGTERM after step (\d+)", text)
    assert sorted(r for r, _ in stopped) == ["0", "1"], text[-3000:]
    (at,) = {int(n) for _, n in stopped}
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step{at}", text[-3000:]
    assert "not requeued by this script" in text and "requeueing job" not in text, text[-3000:]


def _usr1_requeue_resume(env, cache, tmp_path, nodes: int) -> dict[tuple[int, int], str]:
    """Runs the USR1 test above on ``nodes`` nodes; returns the host each rank ran on, by
    (restart, rank)."""
    out = tmp_path / "run"
    steps = 60  # far more than run before the signal (a tiny 2-rank step: ~0.1-0.3 s)
    slow, hosts = tmp_path / "python-rank0-ends-last", tmp_path / "hosts"
    # srun signals every process of a task: the wrapper's own USR1 is a no-op (not ignored,
    # which python would inherit); srun's TERM still ends it while it sleeps
    slow.write_text(f'#!/bin/bash\ntrap : USR1\n'
                    'echo "${SLURM_RESTART_COUNT:-0} ${SLURM_PROCID} $(hostname)"'
                    f' >> "{hosts}"\n'
                    f'"{sys.executable}" "$@"\nrc=$?\n'
                    '[[ ${SLURM_PROCID} == 0 && ${rc} == 75 ]] && sleep 5\nexit ${rc}\n')
    slow.chmod(0o755)
    job, log = _sbatch_70b(env, tmp_path, cache, steps=steps, wait=False, nodes=nodes,
                           extra=("checkpoint.every=0",), python=str(slow))
    metrics = out / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2,
              "two steps logged", 240, poll=0.1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True)
    _wait_for(lambda: _job_field(env, job, "Restarts") == "1", "the job is requeued", 240)
    # Slurm holds a requeued job back (its BeginTime, ~2 min later) so that the first run's
    # step can finish on the node; released before that, slurmd refuses to launch it ("Job
    # credential revoked"). Wait until the controller lists none of its steps, and give slurmd
    # the seconds it took in CI to finish the step (3 s) several times over, then release it.
    _wait_for(lambda: not _steps(env, job), "the first run's steps end", 120)
    time.sleep(10)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)
    # the first run's end can still show as the job's state for a moment: wait for the
    # second run's own output before reading the state
    _wait_for(lambda: f"job {job} restart 1" in _read(log) and _job_field(env, job, "JobState")
              in ("COMPLETED", "FAILED", "CANCELLED"), "the requeued job ends", 420)
    text = _read(log)
    assert _job_field(env, job, "JobState") == "COMPLETED", text[-3000:]
    stopped = re.findall(r"rank (\d): stopped by SIGUSR1 after step (\d+)", text)
    assert sorted(r for r, _ in stopped) == ["0", "1"], text[-3000:]  # both ranks, same step
    (at,) = {int(n) for _, n in stopped}
    assert 2 <= at < steps
    assert "the ranks stopped on a signal (SIGUSR1 step" in text, text[-3000:]
    assert "requeueing job" in text and f"job {job} restart 1" in text, text[-3000:]
    assert f"resumed from step{at} at step {at}" in text, text[-3000:]
    assert [r["step"] for r in read_history(str(metrics))] == list(range(1, steps + 1))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step{steps}"
    ran = {}
    for line in hosts.read_text().splitlines():
        restart, rank, host = line.split()
        ran[int(restart), int(rank)] = host
    return ran


def test_deepspeed_launcher_with_a_hostfile_from_the_nodelist(slurm_cluster, workload_cache, tmp_path):
    """LAUNCHER=deepspeed: the job writes a hostfile from SLURM_JOB_NODELIST and the deepspeed
    launcher starts the 2 ranks from it."""
    out = tmp_path / "run"
    _, log = _sbatch_70b(slurm_cluster, tmp_path, workload_cache, steps=2, launcher="deepspeed")
    text = _read(log)
    assert '"world_size": 2' in text, text[-3000:]
    assert (out / "hostfile").read_text() == "localhost slots=2\n"
    assert (out / "checkpoints" / "latest").read_text().strip() == "step2"


# ------------------------------------------- tier 2: two nodes, each in its own namespaces

TWO_NODES = """\
NodeName=oppo-n1 NodeAddr={net}.1 CPUs=2 RealMemory=2000
NodeName=oppo-n2 NodeAddr={net}.2 CPUs=2 RealMemory=2000
PartitionName=debug Nodes=oppo-n[1-2] Default=YES MaxTime=INFINITE State=UP"""

# a node: its own hostname (UTS namespace), its own /etc/hosts, ssh client config and /dev/shm
# (mount namespace, private: nothing reaches the machine's); then the daemon. $0 is the
# hostname, $1 the hosts file, $2 the ssh_config
NODE_SHELL = ('hostname "$0" && mount --bind "$1" /etc/hosts '
              '&& { [ "$2" = - ] || mount --bind "$2" /etc/ssh/ssh_config; } '
              '&& mount -t tmpfs tmpfs /dev/shm && shift 2 && exec "$@"')

# passwordless ssh between the nodes as root, for the deepspeed launcher's pdsh: the keys, the
# host key and the configs live in the cluster's folder; sshd is started by absolute path
SSH_CONFIG = """\
Host oppo-n1 oppo-n2 {net}.*
    Port {port}
    IdentityFile {d}/id
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    BatchMode yes
    LogLevel ERROR
"""
SSHD_CONFIG = """\
Port {port}
HostKey {d}/host
AuthorizedKeysFile {d}/id.pub
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
"""


def _free_subnet() -> str:
    """A /24 of 198.18.0.0/15 (set aside for benchmarking networks, RFC 2544) that no address
    or route of this machine is in, as "198.x.y"; not of 10/8, which a pod or VPN may route."""
    taken = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    if "198.18.0.0/15" in taken:
        pytest.skip("this machine routes 198.18.0.0/15 itself")
    while True:
        net = f"198.{random.randrange(18, 20)}.{random.randrange(0, 256)}"
        if f"{net}." not in taken:
            return net


class TwoNodes(NamedTuple):
    env: dict  # reaches the controller
    ssh: str | None  # why the nodes cannot ssh to each other (None: they can)


def _ssh_tools() -> str | None:
    """Installs sshd and pdsh when missing; why they are not there, or None. A failure here
    skips the test that needs them, not the cluster."""
    try:
        _apt_install(("sshd", "ssh-keygen", "pdsh"), ("openssh-server", "pdsh"),
                     "the deepspeed launcher across two nodes")
    except (pytest.skip.Exception, AssertionError, OSError, subprocess.SubprocessError) as err:
        return f"sshd and pdsh cannot be installed: {err}"
    if not os.path.isfile("/etc/ssh/ssh_config"):  # bound over in each node's namespace
        return "no /etc/ssh/ssh_config to bind the nodes' ssh settings over"
    return None


def _ssh_files(d, net: str) -> None:
    """The keys and configs in folder ``d``: root by key, no password."""
    from oppo_ds.engines.deepspeed_engine import find_free_port

    d.mkdir()
    port = find_free_port()
    for key in ("id", "host"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)],
                       check=True, capture_output=True)
    (d / "ssh_config").write_text(SSH_CONFIG.format(net=net, port=port, d=d))
    (d / "sshd_config").write_text(SSHD_CONFIG.format(port=port, d=d))


def _start_sshd(d, net: str, node) -> None:
    """An sshd on each node, with the files of ``_ssh_files``; waits until both answer."""
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation folder
    for name, last in (("oppo-n1", 1), ("oppo-n2", 2)):
        node(name, shutil.which("sshd"), "-D", "-f", str(d / "sshd_config"), "-E",
             str(d / f"sshd-{name}.log"), "-o", f"ListenAddress={net}.{last}",
             "-o", f"PidFile={d}/sshd-{name}.pid")

    def answers() -> bool:
        names = []
        for last in (1, 2):
            proc = subprocess.run(["ssh", "-F", str(d / "ssh_config"), f"{net}.{last}", "hostname"],
                                  capture_output=True, text=True, timeout=30)
            names.append(proc.stdout.strip())
        return names == ["oppo-n1", "oppo-n2"]

    try:
        _wait_for(answers, "ssh reaches both nodes", 30)
    except TimeoutError as err:
        logs = "".join(f.read_text()[-1000:] for f in sorted(d.glob("sshd-*.log")))
        raise TimeoutError(f"{err}; sshd says: {logs}") from None


@pytest.fixture(scope="module")
def slurm_two_nodes(munge, tmp_path_factory):
    """A two-node Slurm cluster on this one machine. Node oppo-n2 lives in a network namespace
    of its own, joined to the machine's by a veth pair: its loopback, addresses and ports are
    not node oppo-n1's, so a rank that took "localhost" for rank 0's host, or a port only
    bound on loopback, fails as it would between two machines. Each node also has its own
    hostname, /etc/hosts (naming both nodes) and /dev/shm; the filesystem is shared, as a
    cluster's is. With sshd and pdsh (installed when missing) each node runs an sshd, and
    root on one node reaches the other by key, as the deepspeed launcher's pdsh needs."""
    from oppo_ds.engines.deepspeed_engine import find_free_port

    missing = [b for b in ("ip", "unshare", "nsenter") if shutil.which(b) is None]
    if missing:
        print(f"skipping the two-node Slurm test: {', '.join(missing)} not found")
        pytest.skip(f"{', '.join(missing)} not found (iproute2, util-linux)")
    tag = f"{os.getpid() % 100000}"
    netns, veth = f"oppo-n2-{tag}", f"oppoh{tag}"
    d = tmp_path_factory.mktemp("slurm-two")
    net = _free_subnet()
    proc = subprocess.run(["ip", "netns", "add", netns], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"skipping the two-node Slurm test: ip netns add: {proc.stderr.strip()}")
        pytest.skip(f"cannot create a network namespace: {proc.stderr.strip()}")
    env: dict = {}
    started: list[subprocess.Popen] = []
    try:
        for cmd in (["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                     "netns", netns],
                    ["ip", "addr", "add", f"{net}.1/24", "dev", veth],
                    ["ip", "link", "set", veth, "up"],
                    ["ip", "-n", netns, "addr", "add", f"{net}.2/24", "dev", "eth0"],
                    ["ip", "-n", netns, "link", "set", "eth0", "up"],
                    ["ip", "-n", netns, "link", "set", "lo", "up"]):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stderr}"
        for sub in ("state", "spool-oppo-n1", "spool-oppo-n2"):
            (d / sub).mkdir()
        hosts = d / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n{net}.1 oppo-n1\n{net}.2 oppo-n2\n")
        ssh = _ssh_tools()
        if not ssh:
            _ssh_files(d / "ssh", net)
        ssh_config = "-" if ssh else str(d / "ssh" / "ssh_config")
        conf = d / "slurm.conf"
        ctld_port = find_free_port()
        conf.write_text(SLURM_CONF.format(d=d, cluster="oppotwo", ctld_host=f"oppo-n1({net}.1)",
                                          ctld_port=ctld_port, d_port=find_free_port(),
                                          first_job_id=random.randrange(1, 1_000_000),
                                          nodes=TWO_NODES.format(net=net)))
        env = _cluster_env(conf)

        def node(name: str, *cmd: str) -> None:
            # nsenter, not `ip netns exec`: that one mounts a fresh /sys without the cgroup
            # tree, and slurmd then fails to start ("No filesystem mounted on /sys/fs/cgroup")
            started.append(subprocess.Popen(
                [*(("nsenter", f"--net=/run/netns/{netns}") if name == "oppo-n2" else ()),
                 "unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
                 NODE_SHELL, name, str(hosts), ssh_config, *cmd],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        node("oppo-n1", "slurmctld", "-D", "-f", str(conf))
        node("oppo-n1", "slurmd", "-D", "-N", "oppo-n1", "-f", str(conf))
        node("oppo-n2", "slurmd", "-D", "-N", "oppo-n2", "-f", str(conf))
        if not ssh:
            _start_sshd(d / "ssh", net, node)
        _wait_for(lambda: _nodes_idle(env, 2), "both nodes are idle", 60)
        # the separation claimed above: from oppo-n2 the controller (on oppo-n1) answers at
        # oppo-n1's address, and nothing answers on loopback
        probe = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 5)"
        for host, reachable in ((f"{net}.1", True), ("127.0.0.1", False)):
            proc = subprocess.run(["nsenter", f"--net=/run/netns/{netns}", sys.executable, "-c",
                                   probe, host, str(ctld_port)], capture_output=True, text=True)
            assert (proc.returncode == 0) == reachable, (host, proc.stderr[-500:])
        yield TwoNodes(env, ssh)
    finally:
        if started:
            _cancel_all_jobs(env)
        _stop(started)
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)


def test_two_nodes_a_signal_stops_both_and_the_requeued_job_resumes(slurm_two_nodes,
                                                                    workload_cache, tmp_path):
    """slurm/train_70b.sh on two nodes, one rank each: the second node finds rank 0 on the
    first host of the node list (its own loopback is not rank 0's), both train over gloo
    between the namespaces, a USR1 to the batch shell stops both after the same step with a
    checkpoint, and the requeued job resumes from exactly that step on the same nodes."""
    ran = _usr1_requeue_resume(slurm_two_nodes.env, workload_cache, tmp_path, nodes=2)
    assert ran == {(0, 0): "oppo-n1", (0, 1): "oppo-n2", (1, 0): "oppo-n1", (1, 1): "oppo-n2"}


def test_two_nodes_an_output_dir_on_a_node_local_disk_stops_the_job(slurm_two_nodes,
                                                                    workload_cache, tmp_path):
    """logging.output_dir on /dev/shm, which is each node's own: rank 1 on oppo-n2 cannot see
    the file rank 0 wrote there, and both ranks stop before any model is built, naming the
    key, the host that does not share it and what to do (oppo_ds/shared_dirs.py)."""
    out = f"/dev/shm/oppo-run-{os.getpid()}"
    job, log = _sbatch_70b(slurm_two_nodes.env, tmp_path, workload_cache, steps=2, nodes=2,
                           output_dir=out, ok=False)
    text = _read(log)
    assert _job_field(slurm_two_nodes.env, job, "JobState") == "FAILED", text[-3000:]
    assert (f"oppo-train: error: logging.output_dir: {out} is not one directory for every "
            "rank: rank 1 (oppo-n2) cannot see the file rank 0 (oppo-n1) wrote there") in text, \
        text[-3000:]
    assert "filesystem all nodes share" in text
    assert "DeepSpeed engine" not in text  # stopped before any engine was built


def test_two_nodes_deepspeed_launcher_reaches_the_second_node_by_pdsh(slurm_two_nodes,
                                                                      workload_cache, tmp_path):
    """LAUNCHER=deepspeed on two nodes: the job writes a two-line hostfile from the node list,
    and DeepSpeed's runner on oppo-n1 starts one rank on each node by pdsh over ssh (its
    default multi-node launcher); they train together and checkpoint."""
    if slurm_two_nodes.ssh:
        pytest.skip(slurm_two_nodes.ssh)
    out = tmp_path / "run"
    _, log = _sbatch_70b(slurm_two_nodes.env, tmp_path, workload_cache, steps=2, nodes=2,
                         launcher="deepspeed")
    text = _read(log)
    assert (out / "hostfile").read_text() == "oppo-n1 slots=1\noppo-n2 slots=1\n"
    assert '"world_size": 2' in text, text[-3000:]
    # pdsh names the node each line came from: each node's DeepSpeed launcher started its rank
    for host, node_rank in (("oppo-n1", 0), ("oppo-n2", 1)):
        assert re.search(rf"^{host}: .*node_rank={node_rank}", text, re.M), text[-3000:]
    assert sorted(os.listdir(out / "checkpoints" / "trainer" / "step2")) == ["rank0.pt", "rank1.pt"]
