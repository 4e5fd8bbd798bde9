#!/bin/bash
# PPO-RLHF with oppo-ds on Slurm, with either launcher:
#   LAUNCHER=srun (default): one `srun` task per GPU (per CPU rank without GPUs); each task
#     derives RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from Slurm's variables
#     (oppo_ds.engines.deepspeed_engine.slurm_rendezvous).
#   LAUNCHER=deepspeed: the `deepspeed` launcher on the first node with a hostfile written
#     from SLURM_JOB_NODELIST (one line per node, `slots` = GPUs or tasks per node) under
#     $OUTPUT_DIR; across nodes it reaches the others by pdsh over passwordless ssh (DeepSpeed's
#     default; DS_LAUNCHER picks another of its launchers, but not slurm: LAUNCHER=srun).
#
#   sbatch slurm/train.sh                                     # the values below
#   CONFIG=examples/configs/llama3_8b_zero3.yaml sbatch --nodes=2 slurm/train.sh
#   OVERRIDES="ppo.kl_coef=0.1 steps=1000" sbatch slurm/train.sh
#   LAUNCHER=deepspeed sbatch slurm/train.sh
#
# Nodes, tasks, GPUs, time: pass sbatch flags; they override the #SBATCH lines below
# (`sbatch --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 --time=24:00:00 slurm/train.sh`).
# Run it from the repository root (the job cds to the directory it was submitted from).
#
# Time limit (USR1): Slurm sends USR1 to this script 300 s before the time limit
# (--signal=B:USR1@300; `scancel -b -s USR1 JOBID` does the same). With srun the trap forwards
# it to the tasks: the trainer finishes the step it is in, every rank saves the same
# checkpoint and exits with code 75, rank 0 writes $OUTPUT_DIR/stopped_on_signal, and the
# script requeues the job (--requeue), which resumes from that checkpoint exactly
# (checkpoint.resume=auto; checkpoint.on_signals lists the signals). The file decides, not
# srun's exit code alone: the first rank to exit with 75 makes srun (--kill-on-bad-exit) end
# the others, still tearing down. A USR1 while the run starts (models loading) stops it
# before its first step, and the job requeues likewise. Choose the lead time to cover one
# step plus a checkpoint save.
# Preemption and cancel (TERM), as Slurm 22.05 sends it (slurm.conf(5) GraceTime, scancel(1)):
#   - preemption with a GraceTime: TERM to the tasks only, not to this script. The ranks stop
#     as on USR1 (also while the run starts) and, if they are done within the grace time, the
#     script requeues the job (also under PreemptMode=CANCEL; Slurm requeues no job that
#     ended by itself). `scancel -s TERM JOBID` (the steps only) is the same notice.
#   - the end of that grace time, `scancel JOBID` and the time limit itself: TERM to the tasks
#     (again), to srun and to this script, then KILL after KillWait (30 s by default). The
#     ranks keep saving until then (oppo_ds/preemption.py: a repeated TERM in a Slurm job does
#     not cut the save short), and this script traps TERM and waits for them. It does not
#     requeue the job: scancel means stop, and a preempted job is requeued by Slurm itself
#     (PreemptMode=REQUEUE) or cancelled (PreemptMode=CANCEL).
#   - `scancel -b -s TERM JOBID`: TERM to this script only; it passes TERM to the tasks
#     (`scancel -s TERM`), the ranks stop with a checkpoint, and the job is not requeued.
#   Never `scancel --full -s TERM`: srun turns a TERM it receives into KILL for its tasks.
# With LAUNCHER=deepspeed a USR1 requeues the job at once and it resumes from the latest
# periodic checkpoint (checkpoint.every): the launcher does not pass USR1 on to its ranks; a
# TERM to this script is passed to the launcher, which ends its ranks.
# A checkpoint holds, under $OUTPUT_DIR/checkpoints: the actor and critic DeepSpeed engines
# (weights, optimizer, LR scheduler), each rank's trainer state (step, prompt stream cursor,
# RNG states, rollout pool) and `latest`, written last (a job killed mid-save resumes from
# the previous complete checkpoint). metrics.jsonl and TensorBoard are cut back to that step.

# ======================= change these ======================================================
#SBATCH --job-name=oppo-train
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
##SBATCH --partition=YOUR_PARTITION
##SBATCH --account=YOUR_ACCOUNT

CONFIG=${CONFIG:-examples/configs/tiny.yaml}     # any YAML under examples/configs/
OUTPUT_DIR=${OUTPUT_DIR:-runs/${SLURM_JOB_NAME:-oppo-train}}  # keep it across requeues
OVERRIDES=${OVERRIDES:-}                          # extra key=value overrides, space separated
PYTHON=${PYTHON:-python}                          # the environment's python (venv, conda)
LAUNCHER=${LAUNCHER:-srun}                        # srun | deepspeed
# ===========================================================================================

set -euo pipefail
cd "${REPO_DIR:-${SLURM_SUBMIT_DIR:-.}}"

# one rank per task: torch's intra-op threads from the CPUs Slurm gave the task; srun of
# Slurm 22.05-23.02 does not take --cpus-per-task from sbatch unless told
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
[[ -n ${SLURM_CPUS_PER_TASK:-} ]] && export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK}
# first host of the allocation hosts rank 0; the port is derived from SLURM_JOB_ID unless set
# here (export MASTER_PORT=29500 to fix it). sbatch exports the submitting shell's variables:
# a launcher's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR left there would make every task take
# them for its own, so they go; Slurm's say who is who.
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR

PREEMPTED_EXIT=75  # oppo_ds.preemption.PREEMPTED_EXIT: stopped on a signal after a checkpoint
STOPPED_MARK=${OUTPUT_DIR}/stopped_on_signal  # oppo_ds.preemption.STOPPED_MARK, by rank 0
TRAIN_PID=  # set once the launcher runs: a signal before that has no one to pass it to
REQUEUED=   # this script asked for the requeue (scontrol requeue)
TERMINATED= # this script got TERM: Slurm ends the job (scancel, preemption's grace time over)
requeue() {
    echo "oppo-train: requeueing job ${SLURM_JOB_ID}; it resumes from the latest checkpoint" \
         "under ${OUTPUT_DIR}/checkpoints"
    REQUEUED=1
    scontrol requeue "${SLURM_JOB_ID}"
}
on_usr1() {
    if [[ ${LAUNCHER} == srun ]]; then
        echo "oppo-train: USR1 (time limit or preemption): the ranks checkpoint after this step"
        [[ -n ${TRAIN_PID} ]] && kill -USR1 "${TRAIN_PID}" 2>/dev/null  # srun: to every task
        true
    else
        echo "oppo-train: USR1 (time limit or preemption)"
        requeue
    fi
}
# Without this trap TERM's default action ends the shell in `wait`, and the job with it
on_term() {
    if [[ -z ${TRAIN_PID} ]]; then  # nothing to save yet: end as without the trap
        echo "oppo-train: TERM before the launcher started: stopping"
        exit 143
    fi
    [[ -n ${TERMINATED} || -n ${REQUEUED} ]] && return  # the requeue's own TERM, or a repeat
    TERMINATED=1
    echo "oppo-train: TERM (scancel, time limit or end of a preemption's grace time): the ranks" \
         "checkpoint after this step; waiting for them, no requeue"
    if [[ ${LAUNCHER} == srun ]]; then
        # to the tasks by Slurm (the steps, not this shell); not `kill srun`: srun turns a TERM
        # into KILL for its tasks. Where Slurm sent TERM to the tasks already, a repeat is only
        # recorded (oppo_ds/preemption.py). In the background and bounded: on a job that Slurm
        # is ending scancel retries for a minute and more, and the trap would hold this shell
        timeout 10 scancel --signal=TERM "${SLURM_JOB_ID}" >/dev/null 2>&1 &
    else
        kill -TERM "${TRAIN_PID}" 2>/dev/null  # DeepSpeed's launcher ends its ranks
    fi
    true
}
trap on_usr1 USR1
trap on_term TERM

echo "oppo-train: job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}:" \
     "config ${CONFIG}, output ${OUTPUT_DIR}, launcher ${LAUNCHER}"
ARGS=(--config "${CONFIG}" "logging.output_dir=${OUTPUT_DIR}" checkpoint.resume=auto)
# shellcheck disable=SC2206  # OVERRIDES is a list of words
ARGS+=(${OVERRIDES})
mkdir -p "${OUTPUT_DIR}"
rm -f "${STOPPED_MARK}"  # an earlier run's, already requeued on
# the launchers run in the background so that the shell can run the traps when a signal arrives
# (bash defers traps until a foreground child exits)
case ${LAUNCHER} in
    srun)
        srun --kill-on-bad-exit=1 "${PYTHON}" -m oppo_ds.train "${ARGS[@]}" &
        ;;
    deepspeed)
        HOSTFILE=${HOSTFILE:-${OUTPUT_DIR}/hostfile}
        SLOTS=${SLOTS:-${SLURM_GPUS_ON_NODE:-${SLURM_NTASKS_PER_NODE:-1}}}
        [[ ${SLOTS} == 0 ]] && SLOTS=${SLURM_NTASKS_PER_NODE:-1}  # a CPU-only allocation
        scontrol show hostnames "${SLURM_JOB_NODELIST}" | sed "s/\$/ slots=${SLOTS}/" > "${HOSTFILE}"
        MASTER=$(head -n 1 "${HOSTFILE}" | cut -d' ' -f1)
        # as oppo_ds.rendezvous derives it under srun: below Linux's ephemeral ports (32768+)
        PORT=${MASTER_PORT:-$(( 10000 + SLURM_JOB_ID % 20000 ))}
        if [[ $(wc -l < "${HOSTFILE}") == 1 ]]; then
            DS_ARGS=(--no_ssh_check)  # one node: DeepSpeed starts the ranks here, no ssh
        elif [[ ${DS_LAUNCHER:-pdsh} == slurm ]]; then
            # DeepSpeed 0.19.8's slurm runner drops --module (it runs `python oppo_ds.train`)
            echo "oppo-train: DS_LAUNCHER=slurm cannot start oppo_ds.train; LAUNCHER=srun" \
                 "starts the ranks with srun" >&2
            exit 2
        else
            DS_ARGS=(--launcher "${DS_LAUNCHER:-pdsh}")  # pdsh needs passwordless ssh
        fi
        "${PYTHON}" -m deepspeed.launcher.runner --hostfile "${HOSTFILE}" --master_addr "${MASTER}" \
            --master_port "${PORT}" "${DS_ARGS[@]}" --module oppo_ds.train "${ARGS[@]}" &
        ;;
    *)
        echo "oppo-train: LAUNCHER must be srun or deepspeed, got '${LAUNCHER}'" >&2
        exit 2
        ;;
esac
TRAIN_PID=$!
# wait returns early when a trapped signal arrives: wait again until the launcher exits
set +e
while true; do
    wait "${TRAIN_PID}"
    rc=$?
    kill -0 "${TRAIN_PID}" 2>/dev/null || break
done
# the launcher may have exited while the trap ran: then that wait returned the trap's 138,
# and this one returns the launcher's code (127 once it was collected)
wait "${TRAIN_PID}" 2>/dev/null
last=$?
[[ ${last} != 127 ]] && rc=${last}
set -e
if [[ ${rc} == "${PREEMPTED_EXIT}" || -f ${STOPPED_MARK} ]]; then
    echo "oppo-train: the ranks stopped on a signal ($(cat "${STOPPED_MARK}" 2>/dev/null ||
          echo "exit ${rc}"))"
    if [[ -n ${TERMINATED} ]]; then
        echo "oppo-train: not requeued by this script: Slurm ends the job (TERM to the batch" \
             "script; a preemption's requeue is Slurm's own); started again, it resumes there"
    elif [[ -z ${REQUEUED} ]]; then
        requeue
    fi
    exit 0
fi
exit "${rc}"
