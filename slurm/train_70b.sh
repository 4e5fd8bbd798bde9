#!/bin/bash
# A Llama-3-70B actor and a Llama-3-8B reward/critic (examples/configs/megatron_70b.yaml) on
# N nodes of 8 GPUs: the Megatron-core backend, tensor parallel 8 inside a node, pipeline
# parallel 4 over nodes (one model replica = 4 nodes; more nodes add replicas), bf16.
# Only the allocation and the config differ from slurm/train.sh, which this job runs (its
# header explains the environment variables, USR1, preemption and scancel (TERM) and what a
# checkpoint holds).
#
#   sbatch --nodes=4 slurm/train_70b.sh
#   OVERRIDES="steps=1000" sbatch --nodes=8 slurm/train_70b.sh        # two replicas
#
# Not examples/configs/llama3_70b.yaml (DeepSpeed ZeRO-3): its rollout gathers the 70B actor
# whole on every GPU (141 GB in bf16), which no 80 GB GPU holds (`oppo-plan` says so).
# Before the first run: set model.actor, model.reward and data.prompts in
# examples/configs/megatron_70b.yaml to your local checkpoints and prompts (or pass them in
# OVERRIDES). Run it from the repository root.

# ======================= change these ======================================================
#SBATCH --job-name=oppo-llama3-70b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
##SBATCH --partition=YOUR_PARTITION
##SBATCH --account=YOUR_ACCOUNT

export CONFIG=${CONFIG:-examples/configs/megatron_70b.yaml}
export OUTPUT_DIR=${OUTPUT_DIR:-runs/llama3-70b}
# ===========================================================================================

cd "${REPO_DIR:-${SLURM_SUBMIT_DIR:-.}}"
# exec: same process, so the USR1 and TERM that Slurm sends to the batch shell reach its traps
exec bash slurm/train.sh
