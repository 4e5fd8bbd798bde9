#!/bin/bash
# PPO-RLHF with oppo-ds on Slurm: one `srun` task per GPU (per CPU rank without GPUs); each
# task derives RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from Slurm's variables
# (oppo_ds.engines.deepspeed_engine.slurm_rendezvous), so no `deepspeed` launcher is needed.
#
#   sbatch slurm/train.sh                                     # the values below
#   CONFIG=examples/configs/llama3_8b_zero3.yaml sbatch --nodes=2 slurm/train.sh
#   OVERRIDES="ppo.kl_coef=0.1 steps=1000" sbatch slurm/train.sh
#
# Nodes, tasks, GPUs, time: pass sbatch flags; they override the #SBATCH lines below
# (`sbatch --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 --time=24:00:00 slurm/train.sh`).
# Run it from the repository root (the job cds to the directory it was submitted from).
#
# Preemption and time limit: Slurm sends USR1 to this script 120 s before the time limit
# (--signal=B:USR1@120); the trap below requeues the job (--requeue). The trainer has no
# signal handler of its own: the requeued job resumes from the latest *periodic* checkpoint
# (checkpoint.every, checkpoint.resume=auto), so the steps after that checkpoint are redone.
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
#SBATCH --signal=B:USR1@120
##SBATCH --partition=YOUR_PARTITION
##SBATCH --account=YOUR_ACCOUNT

CONFIG=${CONFIG:-examples/configs/tiny.yaml}     # any YAML under examples/configs/
OUTPUT_DIR=${OUTPUT_DIR:-runs/${SLURM_JOB_NAME:-oppo-train}}  # keep it across requeues
OVERRIDES=${OVERRIDES:-}                          # extra key=value overrides, space separated
PYTHON=${PYTHON:-python}                          # the environment's python (venv, conda)
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

requeue() {
    echo "oppo-train: USR1 (time limit or preemption): requeueing job ${SLURM_JOB_ID}; it" \
         "resumes from the latest checkpoint under ${OUTPUT_DIR}/checkpoints"
    scontrol requeue "${SLURM_JOB_ID}"
}
trap requeue USR1

echo "oppo-train: job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}:" \
     "config ${CONFIG}, output ${OUTPUT_DIR}"
# srun runs in the background so that the shell can run the trap when USR1 arrives (bash
# defers traps until a foreground child exits)
# shellcheck disable=SC2086  # OVERRIDES is a list of words
srun --kill-on-bad-exit=1 "${PYTHON}" -m oppo_ds.train --config "${CONFIG}" \
    "logging.output_dir=${OUTPUT_DIR}" checkpoint.resume=auto ${OVERRIDES} &
wait $!
