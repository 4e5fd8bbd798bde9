"""Training engines: one interface (``base.TrainEngine``), one implementation per backend.

``import oppo_ds.engines`` stays light: the DeepSpeed engine (and so ``import deepspeed``)
loads only when one of its names is first used.
"""

from oppo_ds.engines.base import (SCHEDULERS, CheckpointMismatch, LossFn, ModelCallable,
                                  TrainEngine, lr_multiplier)
from oppo_ds.engines.ds_config import build_ds_config, build_inference_ds_config

_DEEPSPEED_NAMES = (
    "DeepSpeedTrainEngine",
    "prepare_frozen",
    "prepare_partitioned",
    "release_frozen",
    "open_engines",
    "close_engines",
    "init_distributed_if_needed",
    "find_free_port",
    "HYBRID_OFF",
    "HYBRID_KERNELS",
    "HYBRID_NO_KERNELS_CPU",
    "HYBRID_NO_KERNELS_NO_POLICY",
    "HYBRID_NO_KERNELS_REQUESTED",
    "HYBRID_NO_KERNELS_LORA",
)

__all__ = [
    "SCHEDULERS",
    "CheckpointMismatch",
    "LossFn",
    "ModelCallable",
    "TrainEngine",
    "lr_multiplier",
    "build_ds_config",
    "build_inference_ds_config",
    *_DEEPSPEED_NAMES,
]


_FROZEN_NAMES = ("prepare_frozen", "prepare_partitioned", "release_frozen")


def __getattr__(name: str):
    if name in _FROZEN_NAMES:
        from oppo_ds.engines import ds_frozen

        return getattr(ds_frozen, name)
    if name in _DEEPSPEED_NAMES:
        from oppo_ds.engines import deepspeed_engine

        return getattr(deepspeed_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
