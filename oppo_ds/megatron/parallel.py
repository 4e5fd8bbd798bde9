"""Process groups of the Megatron backend, and the communication its forward needs.

``init_model_parallel`` sets up megatron-core's groups once per process (its GPTModel reads
them through a ``ProcessGroupCollection``) and returns them as a ``ParallelGroups`` that the
rest of oppo-ds passes around explicitly; nothing below reads megatron's globals.

Rank layout (megatron's default order ``tp-cp-ep-dp-pp``): tensor-parallel ranks are
consecutive, then data-parallel replicas, then pipeline stages. With 4 ranks, tp=2, pp=2:
stage 0 is ranks {0, 1}, stage 1 ranks {2, 3}; rank 0 sends its activations to rank 2.

The autograd functions move activations between pipeline stages (``send_to_next_stage`` /
``recv_from_prev_stage``: the backward sends the gradient the other way) and bring the last
stage's output to every stage (``from_last_stage``): each rank then holds the same logits or
values, computes the same loss, and its backward reaches its own stage's layers through the
activation it sent. Gloo on CPU, NCCL on GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class ParallelGroups:
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any
    mp_group: Any            # tensor x pipeline: every rank holding a part of one replica
    pp_ranks: list[int]      # global ranks of this rank's pipeline, stage by stage
    pg_collection: Any       # megatron's ProcessGroupCollection, for building GPTModels

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.pp_ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> int:
        return self.pp_ranks[self.pp_rank + 1]

    @property
    def last_rank(self) -> int:
        return self.pp_ranks[-1]


def init_model_parallel(tp: int, pp: int, *, seed: int = 0) -> ParallelGroups:
    """megatron-core's groups for tensor size ``tp`` and pipeline size ``pp`` over the world
    (torch.distributed must be up; the rest is data parallel; under the stage placement the
    world is the actor ranks alone). A second call with the same sizes returns the same
    groups; other sizes raise ``ValueError``."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from .compat import apply_cpu_compat

    apply_cpu_compat()
    # imported after the patches: the name would otherwise be bound to the CUDA version
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"a world of {world} ranks cannot hold tensor_parallel={tp} x "
                         f"pipeline_parallel={pp}")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(f"megatron-core is already initialised with (tp, pp) = {have}, "
                             f"asked for {(tp, pp)}")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                     pipeline_model_parallel_size=pp,
                                     create_gloo_process_groups=False)
        model_parallel_cuda_manual_seed(seed)
    pp_group = ps.get_pipeline_model_parallel_group()
    return ParallelGroups(
        tp=tp, pp=pp, dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(), tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=pp_group, dp_group=ps.get_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        pp_ranks=list(dist.get_process_group_ranks(pp_group)),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups())


# ------------------------------------------------------------------------------ pipeline

class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, shape, dtype, src, group):
        ctx.src, ctx.group = src, group
        buf = torch.empty(shape, dtype=dtype, device=anchor.device)
        dist.recv(buf, src=src, group=group)
        return buf

    @staticmethod
    def backward(ctx, grad):
        dist.send(grad.contiguous(), dst=ctx.src, group=ctx.group)
        return None, None, None, None, None


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, dst, group):
        ctx.dst, ctx.group, ctx.shape, ctx.dtype = dst, group, hidden.shape, hidden.dtype
        dist.send(hidden.contiguous(), dst=dst, group=group)
        return hidden.new_zeros(0)  # a token that ties this stage's graph to the loss

    @staticmethod
    def backward(ctx, _):
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=_.device)
        dist.recv(grad, src=ctx.dst, group=ctx.group)
        return grad, None, None


class _FromLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mine, shape, dtype, groups: ParallelGroups):
        ctx.last, ctx.token_shape = groups.last_stage, mine.shape
        out = mine.clone(memory_format=torch.contiguous_format) if groups.last_stage else \
            torch.empty(shape, dtype=dtype, device=mine.device)
        dist.broadcast(out, src=groups.last_rank, group=groups.pp_group)
        return out

    @staticmethod
    def backward(ctx, grad):
        # only the last stage's copy carries the loss's gradient into a model; the others
        # reach their layers through _Send's backward, which this zero starts
        if ctx.last:
            return grad, None, None, None
        return grad.new_zeros(ctx.token_shape), None, None, None


def recv_from_prev_stage(shape, dtype, device, groups: ParallelGroups) -> torch.Tensor:
    anchor = torch.empty(0, device=device, requires_grad=torch.is_grad_enabled())
    return _Recv.apply(anchor, tuple(shape), dtype, groups.prev_rank, groups.pp_group)


def send_to_next_stage(hidden: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Send this stage's output on; returns the token to pass to :func:`from_last_stage`."""
    return _Send.apply(hidden, groups.next_rank, groups.pp_group)


def from_last_stage(mine: torch.Tensor, shape, dtype, groups: ParallelGroups) -> torch.Tensor:
    """The last stage's output on every stage (``mine``: the output there, the token of
    :func:`send_to_next_stage` elsewhere)."""
    if groups.pp == 1:
        return mine
    return _FromLast.apply(mine, tuple(shape), dtype, groups)


# ------------------------------------------------------------------------------ tensor parallel

class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part, group, size, rank):
        ctx.size, ctx.rank = size, rank
        parts = [torch.empty_like(part) for _ in range(size)]
        dist.all_gather(parts, part.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        # every tensor-parallel rank computes the same loss from the same gathered tensor:
        # its shard's gradient is its slice, no reduction
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None, None, None


def gather_tensor_parallel(part: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """Concatenate the tensor-parallel ranks' last-dimension shards (vocabulary logits)."""
    if groups.tp == 1:
        return part
    return _GatherLastDim.apply(part, groups.tp_group, groups.tp, groups.tp_rank)


# ------------------------------------------------------------------------------ weights

def gather_states(mine: dict[str, torch.Tensor], tag, group) -> Optional[list]:
    """Every rank's ``(tag, state)`` of ``group`` on its first (lowest) rank, in group order;
    None on the others. The tensors travel as raw bytes, one rank's at a time by
    point-to-point on the group's device (the current CUDA device under NCCL: one rank's
    shard in GPU memory at once), and arrive on the CPU; only names, shapes and dtypes are
    pickled. ``torch.distributed.gather_object`` would pickle the tensors too: between two
    gloo processes on the 2-core development VM a 256 MB state took it 3.6-4.1 s, this
    0.68-0.72 s (3 runs each, 2026-11-24)."""
    ranks = dist.get_process_group_ranks(group)
    first = min(ranks)
    on_device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == "nccl" else torch.device("cpu")
    layout = [(name, tuple(t.shape), t.dtype) for name, t in mine.items()]
    size = sum(t.numel() * t.dtype.itemsize for t in mine.values())
    heads = [None] * len(ranks) if dist.get_rank() == first else None
    dist.gather_object((tag, layout, size), heads, dst=first, group=group)
    if heads is None:  # only the senders flatten their tensors into bytes
        raw = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8)
                         for t in mine.values()]) if mine else torch.empty(0, dtype=torch.uint8)
        dist.send(raw.to(on_device), dst=first, group=group)
        return None
    out = []
    for rank, (their_tag, their_layout, size) in zip(ranks, heads):
        if rank == first:
            out.append((their_tag, dict(mine)))
            continue
        buf = torch.empty(size, dtype=torch.uint8, device=on_device)
        dist.recv(buf, src=rank, group=group)
        buf, state, offset = buf.cpu(), {}, 0
        for name, shape, dtype in their_layout:
            n = math.prod(shape) * dtype.itemsize
            # a copy of its own: aligned for the dtype, and not holding the whole buffer
            state[name] = buf[offset:offset + n].clone().view(dtype).reshape(shape)
            offset += n
        out.append((their_tag, state))
    return out
