#!/bin/bash
# PPO-RLHF with oppo-ds on Slurm, with either launcher:
#   LAUNCHER=srun (default): one `srun` task per GPU (per CPU rank without GPUs); each task
#     derives RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from Slurm's variables
#     (oppo_ds.engines.deepspeed_engine.slurm_rendezvous).
#   LAUNCHER=deepspeed: the `deepspeed` launcher on the first node with a hostfile written
#     from SLURM_JOB_NODELIST (one line per node, `slots` = GPUs or tasks per node) under
#     $OUTPUT_DIR; across nodes it reaches the others by pdsh over passwordless ssh (DeepSpeed's
#     default), or DS_LAUNCHER=slurm makes DeepSpeed start them with srun instead.
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
# Preemption and time limit: Slurm sends USR1 to this script 300 s before the time limit
# (--signal=B:USR1@300). With srun the trap forwards it to the tasks: the trainer finishes
# the step it is in, every rank saves the same checkpoint and exits with code 75, and the
# script requeues the job (--requeue), which resumes from that checkpoint exactly
# (checkpoint.resume=auto; checkpoint.on_signals lists the signals). Choose the lead time
# to cover one step plus a checkpoint save. With LAUNCHER=deepspeed the job is requeued at
# once and resumes from the latest periodic checkpoint (checkpoint.every): the launcher does
# not pass USR1 on to its ranks.
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

# one rank per task: torch's intra-op threads from the CPUs Slurm gave the task
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
# first host of the allocation hosts rank 0; the port is derived from SLURM_JOB_ID unless set
# here (export MASTER_PORT=29500 to fix it). sbatch exports the submitting shell's variables:
# a launcher's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR left there would make every task take
# them for its own, so they go; Slurm's say who is who.
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR

PREEMPTED_EXIT=75  # oppo_ds.preemption.PREEMPTED_EXIT: stopped on a signal after a checkpoint
requeue() {
    echo "oppo-train: requeueing job ${SLURM_JOB_ID}; it resumes from the latest checkpoint" \
         "under ${OUTPUT_DIR}/checkpoints"
    scontrol requeue "${SLURM_JOB_ID}"
}
on_usr1() {
    if [[ ${LAUNCHER} == srun ]]; then
        echo "oppo-train: USR1 (time limit or preemption): the ranks checkpoint after this step"
        kill -USR1 "${TRAIN_PID}" 2>/dev/null || true  # srun passes it on to every task
    else
        echo "oppo-train: USR1 (time limit or preemption)"
        requeue
    fi
}
trap on_usr1 USR1

echo "oppo-train: job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}:" \
     "config ${CONFIG}, output ${OUTPUT_DIR}, launcher ${LAUNCHER}"
ARGS=(--config "${CONFIG}" "logging.output_dir=${OUTPUT_DIR}" checkpoint.resume=auto)
# shellcheck disable=SC2206  # OVERRIDES is a list of words
ARGS+=(${OVERRIDES})
# the launchers run in the background so that the shell can run the trap when USR1 arrives
# (bash defers traps until a foreground child exits)
case ${LAUNCHER} in
    srun)
        srun --kill-on-bad-exit=1 "${PYTHON}" -m oppo_ds.train "${ARGS[@]}" &
        ;;
    deepspeed)
        mkdir -p "${OUTPUT_DIR}"
        HOSTFILE=${HOSTFILE:-${OUTPUT_DIR}/hostfile}
        SLOTS=${SLOTS:-${SLURM_GPUS_ON_NODE:-${SLURM_NTASKS_PER_NODE:-1}}}
        [[ ${SLOTS} == 0 ]] && SLOTS=${SLURM_NTASKS_PER_NODE:-1}  # a CPU-only allocation
        scontrol show hostnames "${SLURM_JOB_NODELIST}" | sed "s/\$/ slots=${SLOTS}/" > "${HOSTFILE}"
        MASTER=$(head -n 1 "${HOSTFILE}" | cut -d' ' -f1)
        PORT=${MASTER_PORT:-$(( 20000 + SLURM_JOB_ID % 20000 ))}
        if [[ $(wc -l < "${HOSTFILE}") == 1 ]]; then
            DS_ARGS=(--no_ssh_check)  # one node: DeepSpeed starts the ranks here, no ssh
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
set -e
if [[ ${rc} == "${PREEMPTED_EXIT}" ]]; then
    requeue
    exit 0
fi
exit "${rc}"
