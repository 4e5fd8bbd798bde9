"""LoRA for the trained models (``model.actor_lora_dim``, ``critic_lora_dim``).

Every ``nn.Linear`` (and GPT-2 ``Conv1D``) whose qualified name contains
``model.lora_module_name`` gains two matrices, R (in x rank) and L (rank x out), and computes
``x W^T + b + s * (x R) L`` with ``s = lora_alpha / rank``. L starts at zero, so a fresh LoRA
model computes exactly what its base model does (PPO's first ratio against the reference is 1).
The layer's own weight W is frozen (its bias, and every layer without LoRA, still train), as
in DeepSpeed-Chat's ``LinearLayer_LoRA`` and PEFT: the layer learns through R and L alone.

The names and layout are DeepSpeed-Chat's (``lora_right_weight`` = R, ``lora_left_weight``
= L, ``lora_scaling`` = s, as ``deepspeed/module_inject/policy.py`` ``maybe_get_lora`` reads
them). DeepSpeed's hybrid engine folds such an update into its inference kernels' weights
only inside its own ``generate()``, which oppo-ds does not call (and Llama's container looks
for it on the weight, not the layer): with LoRA the engine decodes with the model's own
forward instead (``engines.deepspeed_engine._kernel_choice``), never with the base weights
alone. The layer keeps its class's parameter names (``q_proj.weight`` stays
``q_proj.weight``): the object's class is switched to :class:`LoRALinear`, a subclass of
``nn.Linear``, so HF code that checks ``isinstance(module, nn.Linear)`` and DeepSpeed's
ZeRO-3 hooks see an ordinary linear layer.

``only_optimize_lora`` freezes everything else except the parameters named in ``keep``
(the critic's value head), so the optimizer holds states for the LoRA matrices only.
For export, :func:`merged_state_dict` folds ``s * R L`` into each weight and drops the LoRA
keys: the exported checkpoint is a plain HF model of the base architecture.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

LORA_KEYS = ("lora_right_weight", "lora_left_weight")


class LoRALayer:
    """A layer with a low-rank update (mixin of both kinds: nn.Linear, GPT-2 Conv1D)."""

    lora_right_weight: nn.Parameter  # R: (in, rank)
    lora_left_weight: nn.Parameter   # L: (rank, out)
    lora_scaling: float              # s

    def _lora(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling

    def _update(self) -> torch.Tensor:
        """``s * R L``: (in, out)."""
        return (self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, lora_rank={self.lora_right_weight.shape[1]}, "
                f"lora_scaling={self.lora_scaling:g}")


class LoRALinear(LoRALayer, nn.Linear):
    """``nn.Linear`` plus a low-rank update; built by :func:`add_lora`, not directly."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self._lora(x)

    def delta_weight(self) -> torch.Tensor:
        """The update shaped like ``weight`` (out, in)."""
        return self._update().t()


def _conv1d_class():
    """GPT-2's projections are ``transformers``' Conv1D (weight stored (in, out))."""
    from transformers.pytorch_utils import Conv1D

    class LoRAConv1D(LoRALayer, Conv1D):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Conv1D.forward(self, x) + self._lora(x)

        def delta_weight(self) -> torch.Tensor:
            """The update shaped like ``weight`` (in, out)."""
            return self._update()

    return Conv1D, LoRAConv1D


_CONV1D = None


def _lora_class_for(module: nn.Module):
    """The LoRA class a layer becomes, or None when it is not a plain linear layer."""
    global _CONV1D
    if type(module) is nn.Linear:
        return LoRALinear
    if _CONV1D is None:
        _CONV1D = _conv1d_class()
    return _CONV1D[1] if type(module) is _CONV1D[0] else None


def _features(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]  # Conv1D: (in, out)


def add_lora(model: nn.Module, rank: int, module_name: str, *, alpha: Optional[float] = None,
             seed: int = 0) -> list[str]:
    """Turn (in place) every ``nn.Linear`` (or GPT-2 ``Conv1D``) of ``model`` whose name contains ``module_name``
    into a :class:`LoRALinear` of rank ``rank``, its weight frozen. Returns the names of the
    layers changed.

    Raises ``ValueError`` when no layer matches (a LoRA that trains nothing is a config
    mistake, e.g. GPT-2's blocks are ``h.N``, not ``layers.N``).
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    scale = (alpha if alpha is not None else rank) / rank
    gen = torch.Generator().manual_seed(seed)
    changed = []
    for name, module in list(model.named_modules()):
        cls = _lora_class_for(module)
        if module_name not in name or cls is None:
            continue
        weight = module.weight
        fan_in, fan_out = _features(module)
        right = torch.empty(fan_in, rank, dtype=torch.float32)
        # R as nn.Linear initialises a weight of fan-in `in` (kaiming uniform, a=sqrt(5)); L = 0
        bound = 1.0 / math.sqrt(fan_in)
        right.uniform_(-bound, bound, generator=gen)
        module.lora_right_weight = nn.Parameter(right.to(device=weight.device, dtype=weight.dtype))
        module.lora_left_weight = nn.Parameter(torch.zeros(rank, fan_out, device=weight.device,
                                                           dtype=weight.dtype))
        module.lora_scaling = scale
        module.weight.requires_grad_(False)  # the update is R L's (its bias still trains)
        module.__class__ = cls
        changed.append(name)
    if not changed:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if _lora_class_for(m) is not None})
        raise ValueError(f"model.lora_module_name {module_name!r} matches no linear layer "
                         f"(the model's linear layers are named {', '.join(linears)} under its "
                         f"blocks; e.g. Llama/Qwen2 blocks are `layers.`, GPT-2's `h.`)")
    return changed


def only_optimize_lora(model: nn.Module, keep: Iterable[str] = ()) -> int:
    """Freeze every parameter except the LoRA matrices and those whose name starts with one
    of ``keep``. Returns the number of trainable parameters left."""
    keep = tuple(keep)
    trainable = 0
    for name, param in model.named_parameters():
        train = name.rsplit(".", 1)[-1] in LORA_KEYS or name.startswith(keep)
        param.requires_grad_(train)
        trainable += param.numel() if train else 0
    return trainable


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALayer) for m in model.modules())


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with each LoRA update folded into its weight and the LoRA keys
    removed: the weights of a plain model of the base architecture. The model is unchanged.
    Under ZeRO-3 call it where the parameters are gathered."""
    state = {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1] not in LORA_KEYS}
    for name, module in model.named_modules():
        if isinstance(module, LoRALayer):
            key = f"{name}.weight" if name else "weight"
            with torch.no_grad():
                state[key] = (module.weight + module.delta_weight().to(module.weight.dtype)).detach()
    return state
