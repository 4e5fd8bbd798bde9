"""Slurm: the srun rendezvous (pure, tier 0) and a real single-node Slurm cluster (tier 2)
that runs slurm/train_70b.sh on the tiny config with 2 CPU tasks, then resumes it.

The cluster test needs root and apt (it installs slurm-wlm and munge when missing) and
starts munged, slurmctld and slurmd itself; they are stopped by pid at teardown."""
from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import time

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


# ---------------------------------------------------------------- tier 2: a real cluster

SMALL = ["workload.num_prompts=64", "workload.sft_steps=20", "workload.reward_steps=20",
         "generation.max_new_tokens=24", "ppo.batch_size=4", "ppo.mini_batch_size=4",
         "ppo.micro_batch_size=2", "logging.progress=false", "logging.log_every=0",
         "system.torch_threads=1", "checkpoint.every=1", "checkpoint.export_hf=false"]

SLURM_CONF = """\
ClusterName=oppotest
FirstJobId={first_job_id}
SlurmctldHost=localhost
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
SlurmdPidFile={d}/slurmd.pid
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=2000
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def _munge_works() -> bool:
    if shutil.which("munge") is None:
        return False
    enc = subprocess.run(["munge", "-n"], capture_output=True)
    return enc.returncode == 0 and subprocess.run(["unmunge"], input=enc.stdout,
                                                  capture_output=True).returncode == 0


def _install_slurm() -> None:
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        reason = "not root" if os.geteuid() != 0 else "apt-get is not available"
        print(f"skipping the Slurm cluster test: {reason}, cannot install slurm-wlm and munge")
        pytest.skip(f"Slurm is not installed and cannot be: {reason}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


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


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A one-node Slurm cluster (localhost, 2 CPUs); yields the environment that reaches it."""
    from oppo_ds.engines.deepspeed_engine import find_free_port

    if os.geteuid() != 0:
        print("skipping the Slurm cluster test: not root (munged/slurmd need root)")
        pytest.skip("not root")
    _install_slurm()
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    conf = d / "slurm.conf"
    # job ids from a random start: the jobs' MASTER_PORT (derived from the id) varies per run
    first_job_id = random.randrange(1, 1_000_000)
    conf.write_text(SLURM_CONF.format(d=d, ctld_port=find_free_port(), d_port=find_free_port(),
                                      first_job_id=first_job_id))
    # earlier tests in this process may have left a launcher's rendezvous variables behind;
    # the jobs must see only what a user's shell would (slurm/train.sh unsets them as well)
    launcher = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"}
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["SLURM_CONF"] = str(conf)
    started: list[subprocess.Popen] = []
    try:
        if not _munge_works():
            for path in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
                os.makedirs(path, exist_ok=True)
                shutil.chown(path, "munge", "munge")
            # runuser switches to munge in the child, not Python's user=/group=: with those
            # Python forks instead of vforking, and a fork accounts this test process's whole
            # heap again (after ~1000 tests its virtual heap passed the machine's 23 GiB once:
            # ENOMEM, "__vm_enough_memory ... 26000039936" in dmesg, every Slurm test errored)
            started.append(subprocess.Popen(["runuser", "-u", "munge", "--", "munged",
                                             "--foreground"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            _wait_for(_munge_works, "munged answers")
        started.append(subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        started.append(subprocess.Popen(["slurmd", "-D", "-N", "localhost", "-f", str(conf)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def node_idle() -> bool:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, env=env)
            return out.stdout.strip() == "idle"

        _wait_for(node_idle, "the node is idle")
        yield env
    finally:
        if len(started) > 1:
            _cancel_all_jobs(env)
        for proc in reversed(started):
            proc.terminate()
        for proc in reversed(started):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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
                extra: tuple = (), python: str = sys.executable) -> tuple[str, str]:
    """Submits slurm/train_70b.sh on the tiny config with 2 CPU tasks; returns the job id and
    the path of its output file (complete once the job ended, when ``wait``)."""
    job_env = dict(env, CONFIG="examples/configs/tiny.yaml", OUTPUT_DIR=str(tmp_path / "run"),
                   PYTHON=python, OMP_NUM_THREADS="1", LAUNCHER=launcher,
                   OVERRIDES=" ".join([*SMALL, f"steps={steps}", f"workload.cache_dir={cache}", *extra]))
    log = tmp_path / f"job-steps{steps}-{launcher}.out"
    # sbatch flags override the script's #SBATCH lines: one node of 2 CPUs, no GPUs
    cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), "--nodes=1", "--ntasks-per-node=2",
           "--cpus-per-task=1", "--gpus-per-node=0", "--time=10", f"--output={log}", "slurm/train_70b.sh"]
    proc = subprocess.run(cmd, cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=600)
    text = log.read_text() if log.exists() else "(no job output file)"
    assert proc.returncode == 0, f"sbatch exit {proc.returncode}: {proc.stderr}\n{text[-4000:]}"
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
    out = tmp_path / "run"
    steps = 60  # far more than run before the signal (a tiny 2-rank step: ~0.1-0.3 s)
    slow = tmp_path / "python-rank0-ends-last"
    # srun signals every process of a task: the wrapper's own USR1 is a no-op (not ignored,
    # which python would inherit); srun's TERM still ends it while it sleeps
    slow.write_text(f'#!/bin/bash\ntrap : USR1\n"{sys.executable}" "$@"\nrc=$?\n'
                    '[[ ${SLURM_PROCID} == 0 && ${rc} == 75 ]] && sleep 5\nexit ${rc}\n')
    slow.chmod(0o755)
    job, log = _sbatch_70b(slurm_cluster, tmp_path, workload_cache, steps=steps, wait=False,
                           extra=("checkpoint.every=0",), python=str(slow))
    metrics = out / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2,
              "two steps logged", 240, poll=0.1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm_cluster, check=True)
    _wait_for(lambda: _job_field(slurm_cluster, job, "Restarts") == "1", "the job is requeued", 240)
    # Slurm holds a requeued job back (its BeginTime, ~2 min later) so that the first run's
    # step can finish on the node; released before that, slurmd refuses to launch it ("Job
    # credential revoked"). Wait until the controller lists none of its steps, and give slurmd
    # the seconds it took in CI to finish the step (3 s) several times over, then release it.
    _wait_for(lambda: not _steps(slurm_cluster, job), "the first run's steps end", 120)
    time.sleep(10)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm_cluster, check=True)
    # the first run's end can still show as the job's state for a moment: wait for the
    # second run's own output before reading the state
    _wait_for(lambda: f"job {job} restart 1" in _read(log) and _job_field(slurm_cluster, job, "JobState")
              in ("COMPLETED", "FAILED", "CANCELLED"), "the requeued job ends", 420)
    text = _read(log)
    assert _job_field(slurm_cluster, job, "JobState") == "COMPLETED", text[-3000:]
    stopped = re.findall(r"rank (\d): stopped by SIGUSR1 after step (\d+)", text)
    assert sorted(r for r, _ in stopped) == ["0", "1"], text[-3000:]  # both ranks, same step
    (at,) = {int(n) for _, n in stopped}
    assert 2 <= at < steps
    assert "the ranks stopped on a signal (SIGUSR1 step" in text, text[-3000:]
    assert "requeueing job" in text and f"job {job} restart 1" in text, text[-3000:]
    assert f"resumed from step{at} at step {at}" in text, text[-3000:]
    assert [r["step"] for r in read_history(str(metrics))] == list(range(1, steps + 1))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step{steps}"


def test_deepspeed_launcher_with_a_hostfile_from_the_nodelist(slurm_cluster, workload_cache, tmp_path):
    """LAUNCHER=deepspeed: the job writes a hostfile from SLURM_JOB_NODELIST and the deepspeed
    launcher starts the 2 ranks from it."""
    out = tmp_path / "run"
    _, log = _sbatch_70b(slurm_cluster, tmp_path, workload_cache, steps=2, launcher="deepspeed")
    text = _read(log)
    assert '"world_size": 2' in text, text[-3000:]
    assert (out / "hostfile").read_text() == "localhost slots=2\n"
    assert (out / "checkpoints" / "latest").read_text().strip() == "step2"
