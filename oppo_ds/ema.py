"""An exponential moving average of the actor's weights (``model.actor_ema``; DeepSpeed-Chat's
--enable_ema, OpenRLHF's --enable_ema): after every PPO step ``ema = beta * ema + (1 - beta) *
weights``, starting from the actor's weights at the start; exported beside the actor as
``output_dir/actor_ema``. A smoothed policy is often the better one to deploy or evaluate.

Each rank averages what it holds of the actor: its ZeRO-3 partition (``ds_tensor``), its
Megatron shard, or the whole weights under ZeRO 0-2, in fp32 whatever the training dtype (a
bf16 average would lose updates of (1 - beta) times a weight's change), on the weights'
device. The export swaps the average into those same tensors for the length of the actor's own
export, so whatever the engine does to save its actor (gathering partitions, collecting
shards, folding LoRA) it does for the average.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def local_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """What this rank holds of each parameter: its ZeRO-3 partition where there is one (the
    small parameters ZeRO-3 also keeps whole between steps included: their partition is what
    the optimizer updates, and their whole copy is not there before the first forward)."""
    return [p.ds_tensor if hasattr(p, "ds_tensor") else p.data for p in module.parameters()]


def _release_whole_copies(module: torch.nn.Module) -> None:
    """ZeRO-3 keeps its small parameters whole on every rank, and a gather leaves a whole
    parameter as it is: release those copies (a local free, no collective), so that the next
    gather, or the next forward, rebuilds them from the partitions."""
    for p in module.parameters():
        if hasattr(p, "ds_tensor") and p.data.numel() > 0:
            p.partition(has_been_updated=False)


class ActorEMA:
    def __init__(self, module: torch.nn.Module, beta: float):
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        self.beta = beta
        self.tensors = [t.detach().float().clone() for t in local_tensors(module)]

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        for ema, t in zip(self.tensors, local_tensors(module)):
            ema.mul_(self.beta).add_(t.float(), alpha=1.0 - self.beta)

    @contextlib.contextmanager
    def swapped_in(self, module: torch.nn.Module) -> Iterator[None]:
        """The average in place of the weights, the weights back afterwards (exactly)."""
        _release_whole_copies(module)  # else a gather would hand out the weights, not these
        tensors = local_tensors(module)
        saved = [t.detach().clone() for t in tensors]
        try:
            with torch.no_grad():
                for t, ema in zip(tensors, self.tensors):
                    t.copy_(ema)
            yield
        finally:
            _release_whole_copies(module)
            with torch.no_grad():
                for t, old in zip(tensors, saved):
                    t.copy_(old)

    def state_dict(self) -> dict:
        return {"beta": self.beta, "tensors": [t.cpu() for t in self.tensors]}

    def load_state_dict(self, state: dict) -> None:
        """Raises ValueError when the saved average is of other tensors."""
        shapes = [tuple(t.shape) for t in state["tensors"]]
        mine = [tuple(t.shape) for t in self.tensors]
        if shapes != mine:
            raise ValueError(f"the saved average holds {len(shapes)} tensors of other shapes "
                             f"than this rank's {len(mine)}")
        self.tensors = [t.to(device=m.device, dtype=torch.float32)
                        for t, m in zip(state["tensors"], self.tensors)]
