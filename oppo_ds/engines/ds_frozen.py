"""Frozen models (reference, reward) for the DeepSpeed backend: whole on every rank
(:func:`prepare_frozen`) or partitioned by ZeRO-3 (:func:`prepare_partitioned`)."""
from __future__ import annotations

from typing import Optional

import torch

from oppo_ds.engines.deepspeed_engine import (_TORCH_DTYPES, _destroy, _initialize, deepspeed,
                                              get_accelerator, init_distributed_if_needed)
from oppo_ds.engines.ds_config import DTYPES, build_inference_ds_config, merged_config


def engine_buffer_dtype(dtype: str, overrides: dict | None = None) -> torch.dtype | None:
    """The dtype DeepSpeed's engine of ``dtype`` casts a model's floating buffers to, or None
    where it keeps them as built (a rotary ``inv_freq`` in fp32, as transformers loads it).
    Since deepspeedai/DeepSpeed#8066 (0.19) it casts the parameters alone unless
    ``data_types.buffer_dtype`` (in ``overrides``, ``system.deepspeed_config``) names one;
    before, ``module.half()`` / ``module.bfloat16()`` cast the buffers too. In fp32 it casts
    nothing."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if dtype == "fp32":
        return None
    if not hasattr(deepspeed.DeepSpeedEngine, "_mixed_precision_dtypes"):
        return _TORCH_DTYPES[dtype]
    given = ((overrides or {}).get("data_types") or {}).get("buffer_dtype")
    if given is None:
        return None
    from deepspeed.runtime.config import DtypeEnum
    return DtypeEnum(given).value


def prepare_frozen(model: torch.nn.Module, dtype: str, device: torch.device | str | None = None,
                   overrides: dict | None = None) -> torch.nn.Module:
    """Make ``model`` (in place) a frozen scorer: eval mode, no gradients, parameters cast to
    ``dtype``, on ``device`` (default: the accelerator's current device). Returns ``model``.

    Its buffers are held as DeepSpeed's engine holds a trained model's
    (:func:`engine_buffer_dtype`; ``overrides``: ``system.deepspeed_config``): a reference
    with the actor's weights gives the actor's log-probs to the bit, and the stage's critic
    copy the critic's values. Casting them as well (``model.to(dtype)``, as before) rounded a
    loaded model's rotary ``inv_freq`` to bf16, and a reference that started as the actor
    differed from it by up to 2e-3 in a token's log-prob at step 1.

    Every rank holds the full weights; :func:`prepare_partitioned` shards them instead.
    """
    buffer_dtype = engine_buffer_dtype(dtype, overrides)
    if device is None:
        device = get_accelerator().current_device_name()
    model.eval()
    model.requires_grad_(False)
    model.to(device=device)
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(_TORCH_DTYPES[dtype])
    for b in model.buffers() if buffer_dtype is not None else ():
        if b.is_floating_point():
            b.data = b.data.to(buffer_dtype)
    return model


def prepare_partitioned(model: torch.nn.Module, dtype: str, *, offload: bool = False,
                        overrides: dict | None = None) -> torch.nn.Module:
    """Make ``model`` a frozen scorer partitioned over the data-parallel ranks by ZeRO-3
    (DeepSpeed-Chat's evaluation config for its reference model); ``offload`` keeps the
    partitions in CPU memory; ``overrides`` are merged into its DeepSpeed config
    (``system.deepspeed_config``). Returns the module: ZeRO-3's hooks on its submodules gather
    each layer's weights for its forward and release them after, so a rank holds 1 / world
    of the weights plus one layer at a time.

    Every forward is collective over the data-parallel group: all ranks must call it the
    same number of times (the trainer scores its B sequences in the same number of
    micro-batches on every rank; a partitioned model is refused as a streaming scorer).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    init_distributed_if_needed()
    config = build_inference_ds_config(zero_stage=3, offload=offload, dtype=dtype,
                                       world_size=deepspeed.comm.get_world_size())
    if overrides:
        config = merged_config(config, overrides, log=deepspeed.comm.get_rank() == 0)
    model.requires_grad_(False)
    engine = _initialize(model=model, config=config)
    engine.eval()
    module = engine.module
    module.eval()
    # the engine owns the partitioning coordinator behind the hooks: keep it alive
    module.__dict__["_oppo_zero3_engine"] = engine
    return module


def release_frozen(model: Optional[torch.nn.Module]) -> None:
    """Destroy the DeepSpeed engine behind a :func:`prepare_partitioned` model (a no-op for
    any other model, or ``None``); the model cannot score after."""
    engine = getattr(model, "__dict__", {}).pop("_oppo_zero3_engine", None)
    if engine is not None:
        _destroy(engine)
