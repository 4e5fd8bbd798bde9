"""Small collectives on host-side values (flags, counts, per-step means).

torch.distributed's group on a GPU is NCCL's, which takes CUDA tensors only: a CPU tensor
there raises "No backend type associated with device type cpu". Gloo (CPU) takes CPU
tensors. Every collective of ours that starts from a Python value goes through here, so
it runs on whichever device the group's backend needs and comes back where it started.
"""
from __future__ import annotations

import os
import socket
from typing import Sequence

import torch
import torch.distributed as dist


def active(group=None) -> bool:
    """Whether ``group`` (default: the world) has more than one rank to talk to."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def comm_device(group=None) -> torch.device:
    """The device a collective on ``group`` needs its tensors on: the current CUDA device
    under NCCL, the CPU otherwise (gloo, or no group at all)."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(t: torch.Tensor, *, op=None, group=None) -> torch.Tensor:
    """``t`` reduced over the ranks of ``group`` (default: the world) with ``op`` (default:
    sum), on ``t``'s own device; ``t`` itself is left as it was. One rank: ``t``."""
    if not active(group):
        return t
    out = t.detach().to(comm_device(group), copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return out.to(t.device)


def all_reduce_ints(values: Sequence[int], *, op=None, group=None) -> list[int]:
    """A list of ints reduced element-wise over the ranks of ``group`` (default: sum)."""
    return all_reduce(torch.tensor(list(values), dtype=torch.long), op=op, group=group).tolist()


def broadcast(t: torch.Tensor, src: int, *, group=None) -> torch.Tensor:
    """Global rank ``src``'s ``t`` on every rank of ``group`` (default: the world), on each
    rank's ``t``'s device and of its shape and dtype; ``t`` itself is left as it was."""
    if not active(group):
        return t
    out = t.detach().to(comm_device(group), copy=True)
    dist.broadcast(out, src, group=group)
    return out.to(t.device)


def gather_lists(values: list, group=None) -> list:
    """A per-rank list (of floats, rows of floats, small records) concatenated over the ranks
    of ``group`` (default: the world), in rank order, on every rank: per-sequence stats."""
    if not active(group):
        return list(values)
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, list(values), group=group)
    return [v for part in out for v in part]


def check_local_device() -> None:
    """``RuntimeError`` saying what to do when this process cannot be put on GPU LOCAL_RANK,
    where ``deepspeed.initialize`` puts every engine (ZeRO-3 its partitions too) and the
    stage placement its scorer rank: it sees fewer GPUs than that. Each task of ``srun
    --gpus-per-task`` sees one; a node launched with more processes than GPUs (the scorer
    rank with no GPU of its own) has one too many. DeepSpeed would fail with CUDA's "invalid
    device ordinal", naming neither the variable nor the launch. Nothing to check without
    CUDA, or when DeepSpeed is told to use another accelerator (DS_ACCELERATOR)."""
    if not torch.cuda.is_available() or os.environ.get("DS_ACCELERATOR", "cuda") != "cuda":
        return
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise RuntimeError(
            f"rank {os.environ.get('RANK', '?')} ({socket.gethostname()}) has LOCAL_RANK="
            f"{local} but sees {count} GPU(s) (CUDA_VISIBLE_DEVICES={visible}): each process "
            f"runs on GPU LOCAL_RANK, so it must see all GPUs of its node, and a node runs no "
            f"more processes than it has GPUs (with oppo.placement: stage, the scorer rank "
            f"too). Under Slurm request --gpus-per-node, not --gpus-per-task (each task then "
            f"sees one GPU); do not narrow CUDA_VISIBLE_DEVICES per process")


def set_local_cuda_device() -> torch.device:
    """Make this process's GPU the current CUDA device and return it (the CPU without CUDA):
    the launcher's LOCAL_RANK, modulo the GPUs this process sees (under Slurm's
    ``--gpus-per-task`` each task sees one, whatever its local rank). Called before anything
    lands on a GPU: torch and DeepSpeed's init_distributed leave every process on cuda:0,
    and only ``deepspeed.initialize`` moves an engine to its rank's GPU, so models built
    before it (reference, reward) or a device read before it would sit on GPU 0."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())
