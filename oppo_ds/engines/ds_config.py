"""DeepSpeed JSON configs, built by pure functions.

Nothing here imports deepspeed: the dicts are plain data, so every branch is unit-tested
without starting a process group (tests/test_ds_config.py). The shape follows what
DeepSpeed-Chat's step 3 uses for its actor/critic (train) and reference/reward (inference)
models, written anew for DeepSpeed 0.19.

Invalid values raise ``ValueError`` naming the argument and the allowed values; nothing is
fixed up silently.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from oppo_ds.config_checks import (grad_accum_dtype_problem, resolved_grad_accum_dtype,
                                   uses_bf16_optimizer)

logger = logging.getLogger(__name__)

ZERO_STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "bf16", "fp16")
GRAD_ACCUM_DTYPES = ("auto",) + DTYPES

# ZeRO-3 knobs, same order of magnitude as DeepSpeed-Chat: parameters smaller than the
# persistence threshold (biases, norms) stay gathered on every rank, which saves many tiny
# all-gathers per layer; the live-parameter and prefetch budgets bound the memory that
# gathered-but-not-yet-released parameters may hold.
STAGE3_PARAM_PERSISTENCE_THRESHOLD = 10_000
STAGE3_MAX_LIVE_PARAMETERS = 30_000_000
STAGE3_PREFETCH_BUCKET_SIZE = 30_000_000

# The hybrid engine's defaults: layers gathered per group under inference tensor parallelism,
# and the inference kernels' KV workspace (prompt + response tokens; DeepSpeed's own default,
# for an engine built without a run: a run's is ``hybrid_max_out_tokens``)
TP_GATHER_PARTITION_SIZE = 8
MAX_OUT_TOKENS = 512

# DeepSpeed's throughput timer is on by default, and the engine starts it in a hook before
# every forward of its module when no training dataloader was given to it (ours never are):
# from the third optimizer step on, each forward then synchronizes the whole device. A decode
# paid that once a token, waiting for the other models' kernels on their own streams (the
# colocated scorers), and a CUDA-graph capture cannot synchronize at all. Our telemetry times
# the phases, so the timer is off.
NO_THROUGHPUT_TIMER = {"throughput": {"enabled": False}}


def hybrid_max_out_tokens(generation, overcommits: bool) -> int:
    """``hybrid_engine.max_out_tokens`` of a run's actor: the positions its inference kernels'
    KV workspace holds (DeepSpeed sizes the workspace by it and gives the kernels its
    ``max_out_tokens``). DeepSpeed-Chat passes prompt + answer length; a rollout here can reach
    more, as the static cache is sized (``rollout.static_length.run_cache_length``): a
    carried row's partial response after its prompt, ``sync_every`` - 1 tokens past an end in
    a block decode, rounded up to 64. ``generation``: the run's ``generation`` section."""
    from oppo_ds.rollout.static_length import run_cache_length

    return run_cache_length(generation.max_prompt_len, generation.max_new_tokens,
                            generation.sync_every, overcommits)


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    # bool is an int subclass: zero_stage=True must not pass as stage 1.
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be one of [True, False], got {value!r}")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def grad_accum_dtype_for(grad_accum_dtype: str, *, dtype: str, zero_stage: int,
                         offload: bool) -> str:
    """The dtype the gradients accumulate in, for ``grad_accum_dtype`` (``auto`` or a dtype)
    with a model in ``dtype`` under ``zero_stage``; ``ValueError`` for a mix DeepSpeed 0.19
    refuses (:func:`~oppo_ds.config_checks.grad_accum_dtype_problem`).

    DeepSpeed accumulates in the model's dtype unless told otherwise. A bf16 model under ZeRO-1
    without offload whose gradients accumulate in fp32 gets DeepSpeed's BF16 optimizer:
    gradients, fp32 master weights and Adam's moments in flat buffers. ``auto`` takes it. Its
    other optimizers for a bf16 model work parameter by parameter; on the CPU, for 290
    parameters, ZeRO-0's step ran 8420 small ops and 585 host reads an update, the BF16
    optimizer's 631 and 5 (tests/bench_optimizer_step.py, docs/benchmarks.md). ZeRO-2 and 3
    accumulate in fp32 too when told, with their own optimizers (with offload: untested here,
    refused).
    """
    _check_choice("grad_accum_dtype", grad_accum_dtype, GRAD_ACCUM_DTYPES)
    problem = grad_accum_dtype_problem(grad_accum_dtype, dtype=dtype, zero_stage=zero_stage,
                                       offload=offload)
    if problem:
        raise ValueError(f"grad_accum_dtype {problem}")
    return resolved_grad_accum_dtype(grad_accum_dtype, dtype=dtype, zero_stage=zero_stage,
                                     offload=offload)


def _zero_section(zero_stage: int, offload: bool) -> dict:
    """The ``zero_optimization`` section: stage, CPU offload, ZeRO-3 budgets."""
    section: dict[str, Any] = {"stage": zero_stage}
    if offload:
        # The optimizer states (and fp32 master weights) live in CPU memory and the
        # optimizer step runs there; stages 1-3 support it.
        section["offload_optimizer"] = {"device": "cpu"}
        if zero_stage == 3:
            # Only ZeRO-3 partitions the parameters themselves, so only it can offload them.
            section["offload_param"] = {"device": "cpu"}
    if zero_stage == 3:
        section.update({
            "stage3_param_persistence_threshold": STAGE3_PARAM_PERSISTENCE_THRESHOLD,
            "stage3_max_live_parameters": STAGE3_MAX_LIVE_PARAMETERS,
            "stage3_prefetch_bucket_size": STAGE3_PREFETCH_BUCKET_SIZE,
            # DeepSpeed's memory-efficient linear re-implements nn.Linear's autograd; the
            # hybrid engine and HF models are tested with the plain one.
            "memory_efficient_linear": False,
        })
    return section


def _dtype_sections(dtype: str) -> dict:
    """``fp16`` / ``bf16`` sections; fp32 needs neither."""
    if dtype == "fp16":
        # Dynamic loss scaling (loss_scale 0), starting at 2**16 and growing after 100
        # overflow-free steps, as DeepSpeed-Chat does.
        return {"fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 100,
                         "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1}}
    if dtype == "bf16":
        return {"bf16": {"enabled": True}}
    return {}


def build_ds_config(
    *,
    train_micro_batch_size_per_gpu: int,
    gradient_accumulation_steps: int,
    world_size: int,
    zero_stage: int,
    offload: bool,
    dtype: str,
    grad_clip: float | None,
    hybrid_engine: bool = False,
    inference_tp_size: int = 1,
    release_inference_cache: bool = False,
    pin_parameters: bool = True,
    tp_gather_partition_size: int = TP_GATHER_PARTITION_SIZE,
    max_out_tokens: int = MAX_OUT_TOKENS,
    tensorboard_dir: str | None = None,
    steps_per_print: int = 10**9,
    force_ds_cpu_optimizer: bool = True,
    grad_accum_dtype: str = "auto",
) -> dict:
    """DeepSpeed config of a model that trains (actor, critic).

    Args:
        train_micro_batch_size_per_gpu: sequences per forward/backward on one rank.
        gradient_accumulation_steps: micro-batches per optimizer update.
        world_size: data-parallel ranks; ``train_batch_size`` is the product of the three.
        zero_stage: 0 (plain data parallel), 1 (optimizer states partitioned),
            2 (+ gradients), 3 (+ parameters).
        offload: optimizer states (stages 1-3) and, at stage 3, parameters in CPU memory.
        dtype: "fp32", "bf16" or "fp16" (fp16 with dynamic loss scaling).
        grad_clip: global gradient-norm clip; ``None`` or 0 disables it.
        hybrid_engine: add DeepSpeed's hybrid-engine section (train + generate in one
            engine); the other ``hybrid``-related arguments only matter when it is on.
        inference_tp_size: tensor-parallel degree of the hybrid engine's inference kernels.
        release_inference_cache: free the inference KV workspace after each generation.
        pin_parameters: under ZeRO-3, gather all layers at once for generation (faster,
            more memory) instead of layer by layer.
        tp_gather_partition_size: layers gathered per group when ``inference_tp_size > 1``.
        max_out_tokens: size of the inference kernels' KV workspace (prompt + response).
        tensorboard_dir: if set, DeepSpeed's own TensorBoard monitor writes there.
        steps_per_print: DeepSpeed's periodic log line (default: effectively never; our
            telemetry logs instead).
        force_ds_cpu_optimizer: with offload, DeepSpeed refuses an optimizer that is not
            DeepSpeedCPUAdam unless this is False.
        grad_accum_dtype: the gradients' dtype, ``auto`` or one of DTYPES; see
            :func:`grad_accum_dtype_for`. A ``data_types`` section is written only when it
            differs from ``dtype`` (with the BF16 optimizer, ``bf16.immediate_grad_update``).

    Returns:
        The config dict for ``deepspeed.initialize(config=...)``.
    """
    _check_positive_int("train_micro_batch_size_per_gpu", train_micro_batch_size_per_gpu)
    _check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
    _check_positive_int("world_size", world_size)
    _check_choice("zero_stage", zero_stage, ZERO_STAGES)
    _check_bool("offload", offload)
    _check_choice("dtype", dtype, DTYPES)
    if offload and zero_stage == 0:
        raise ValueError("offload=True needs zero_stage in [1, 2, 3] (ZeRO-Offload moves the "
                         "partitioned optimizer states); got zero_stage=0")
    if grad_clip is not None and (isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float))
                                  or not grad_clip >= 0):
        raise ValueError(f"grad_clip must be None or a float >= 0, got {grad_clip!r}")
    _check_positive_int("steps_per_print", steps_per_print)

    config: dict[str, Any] = {
        "train_batch_size": train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size,
        "train_micro_batch_size_per_gpu": train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "steps_per_print": steps_per_print,
        "zero_optimization": _zero_section(zero_stage, offload),
        "gradient_clipping": float(grad_clip) if grad_clip else 0.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "timers": NO_THROUGHPUT_TIMER,
    }
    config.update(_dtype_sections(dtype))
    accumulate = grad_accum_dtype_for(grad_accum_dtype, dtype=dtype, zero_stage=zero_stage,
                                      offload=offload)
    if accumulate != dtype:
        config["data_types"] = {"grad_accum_dtype": accumulate}
        if uses_bf16_optimizer(accumulate, dtype, zero_stage, offload):
            # the BF16 optimizer adds each bf16 gradient into its fp32 buffer as backward
            # makes it and frees it; by default it keeps them all until the step (2 bytes a
            # parameter more)
            config["bf16"]["immediate_grad_update"] = True
    if offload and not force_ds_cpu_optimizer:
        config["zero_force_ds_cpu_optimizer"] = False
    if hybrid_engine:
        config["hybrid_engine"] = _hybrid_engine_section(
            inference_tp_size=inference_tp_size,
            release_inference_cache=release_inference_cache,
            pin_parameters=pin_parameters,
            tp_gather_partition_size=tp_gather_partition_size,
            max_out_tokens=max_out_tokens,
            world_size=world_size,
        )
    if tensorboard_dir:
        config["tensorboard"] = {"enabled": True, "output_path": tensorboard_dir,
                                 "job_name": "deepspeed"}
    return config


def _hybrid_engine_section(*, inference_tp_size: int, release_inference_cache: bool,
                           pin_parameters: bool, tp_gather_partition_size: int,
                           max_out_tokens: int, world_size: int) -> dict:
    _check_positive_int("inference_tp_size", inference_tp_size)
    if world_size % inference_tp_size != 0:
        raise ValueError(f"inference_tp_size must divide world_size={world_size}, "
                         f"got {inference_tp_size}")
    _check_positive_int("tp_gather_partition_size", tp_gather_partition_size)
    _check_positive_int("max_out_tokens", max_out_tokens)
    _check_bool("release_inference_cache", release_inference_cache)
    _check_bool("pin_parameters", pin_parameters)
    return {
        "enabled": True,
        "max_out_tokens": max_out_tokens,
        "inference_tp_size": inference_tp_size,
        "release_inference_cache": release_inference_cache,
        "pin_parameters": pin_parameters,
        "tp_gather_partition_size": tp_gather_partition_size,
    }


def build_inference_ds_config(*, zero_stage: int, offload: bool, dtype: str,
                              micro_batch_size: int = 1, world_size: int = 1,
                              hybrid_engine: bool = False, inference_tp_size: int = 1,
                              release_inference_cache: bool = False,
                              max_out_tokens: int = MAX_OUT_TOKENS) -> dict:
    """DeepSpeed config of a model without an optimizer: a frozen scorer (reference, reward)
    wrapped for ZeRO-3 sharding, or an actor built for its weights alone (an evaluation,
    with the hybrid engine's section as :func:`build_ds_config` writes it).

    Only ZeRO-3 changes anything for a model without an optimizer (its parameters are
    partitioned and gathered per layer); stages 0-2 give a replicated model. ``offload``
    keeps the partitioned parameters in CPU memory and so needs stage 3.
    DeepSpeed still requires batch-size keys; they do not matter without training.
    """
    _check_choice("zero_stage", zero_stage, ZERO_STAGES)
    _check_bool("offload", offload)
    _check_choice("dtype", dtype, DTYPES)
    _check_positive_int("micro_batch_size", micro_batch_size)
    _check_positive_int("world_size", world_size)
    if offload and zero_stage != 3:
        raise ValueError(f"offload=True for a frozen model needs zero_stage=3 (only ZeRO-3 "
                         f"partitions parameters); got zero_stage={zero_stage}")
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = STAGE3_PARAM_PERSISTENCE_THRESHOLD
        zero["memory_efficient_linear"] = False
        if offload:
            zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_batch_size": micro_batch_size * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "steps_per_print": 10**9,
        "zero_optimization": zero,
        "wall_clock_breakdown": False,
        "timers": NO_THROUGHPUT_TIMER,
    }
    if dtype == "fp16":
        config["fp16"] = {"enabled": True}
    elif dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if hybrid_engine:
        config["hybrid_engine"] = _hybrid_engine_section(
            inference_tp_size=inference_tp_size, release_inference_cache=release_inference_cache,
            pin_parameters=True, tp_gather_partition_size=TP_GATHER_PARTITION_SIZE,
            max_out_tokens=max_out_tokens, world_size=world_size)
    return config


def merged_config(base: dict, overrides: dict, log: bool = True, path: str = "") -> dict:
    """``base`` with ``overrides`` merged in recursively (mappings merge, values replace);
    each value replaced is logged with its path unless not ``log`` (the first rank logs)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged_config(out[key], value, log, f"{path}{key}.")
        else:
            if key in out and log:
                logger.info("DeepSpeed config: %s%s = %r (built: %r)", path, key, value,
                            out[key])
            out[key] = value
    return out


# what other keys decide, as DeepSpeed's parsed config holds it: (attribute path, the entry
# as written in DeepSpeed's JSON, the key that sets it). Compared parsed, so that an entry
# restating the run's value is taken; DeepSpeed's older names are refused by name first
# (``_OLD_NAMES``)
OWNED_SETTINGS = (
    ("train_batch_size", "train_batch_size", "ppo.mini_batch_size (per rank here)"),
    ("train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu", "ppo.micro_batch_size"),
    ("gradient_accumulation_steps", "gradient_accumulation_steps",
     "ppo.mini_batch_size and ppo.micro_batch_size"),
    ("zero_optimization_stage", "zero_optimization.stage", "system.zero_stage"),
    ("zero_config.offload_optimizer.device", "zero_optimization.offload_optimizer.device",
     "system.offload"),
    ("zero_config.offload_param.device", "zero_optimization.offload_param.device",
     "system.offload or system.offload_reference"),
    # a ratio under 1 steps part of the partitions with a torch AdamW of DeepSpeed's, whose
    # learning rate the schedule never moves; super_offload swaps in another optimizer
    ("zero_config.offload_optimizer.ratio", "zero_optimization.offload_optimizer.ratio",
     "system.offload (the whole optimizer is offloaded)"),
    ("zero_config.offload_optimizer.super_offload",
     "zero_optimization.offload_optimizer.super_offload", "system.offload (DeepSpeedCPUAdam)"),
    ("bfloat16_config.enabled", "bf16.enabled", "system.dtype"),
    ("float16_config.enabled", "fp16.enabled", "system.dtype"),
    ("bfloat16_config.bf16_master_weights_and_grads", "bf16.bf16_master_weights_and_grads",
     "system.dtype and system.grad_accum_dtype"),
    ("bfloat16_config.bf16_optimizer_states", "bf16.bf16_optimizer_states",
     "system.dtype and system.grad_accum_dtype"),
    ("float16_config.fp16_master_weights_and_grads", "fp16.fp16_master_weights_and_grads",
     "system.dtype and system.grad_accum_dtype"),
    ("torch_autocast_enabled", "torch_autocast.enabled", "system.dtype"),
    ("grad_accum_dtype", "data_types.grad_accum_dtype", "system.grad_accum_dtype"),
    ("optimizer_name", "optimizer", "ppo.actor_lr, ppo.critic_lr, ppo.weight_decay, "
                                    "ppo.adam_betas and ppo.adam_eps (AdamW, built here)"),
    ("scheduler_name", "scheduler", "ppo.lr_schedule and ppo.warmup_steps"),
    ("gradient_clipping", "gradient_clipping", "ppo.grad_clip"),
    ("hybrid_engine.enabled", "hybrid_engine.enabled", "system.hybrid_engine"),
    ("hybrid_engine.inference_tp_size", "hybrid_engine.inference_tp_size",
     "system.inference_tp_size"),
    ("timers_config.enabled", "timers.throughput.enabled",
     "logging.profile_step (its timer syncs the device every forward, a decoded token's too)"),
    ("load_universal_checkpoint", "checkpoint.load_universal",
     "checkpoint.resume (oppo-ds loads its own checkpoints)"),
)
# the sections of those entries whose whole value another key sets, as written (of an
# offload section only the device is: its pin_memory, buffer_count are the user's)
_OWNED_SECTIONS = ("optimizer", "scheduler")
# DeepSpeed's older names of owned entries: refused by name (the check compares the actor's
# config, and another engine's could read them otherwise)
_OLD_NAMES = {"bfloat16": "bf16", "zero_optimization.cpu_offload": "zero_optimization."
              "offload_optimizer", "zero_optimization.cpu_offload_param": "zero_optimization."
              "offload_param", "zero_optimization.cpu_offload_use_pin_memory":
              "zero_optimization.offload_optimizer.pin_memory"}


def without_owned(overrides: dict) -> dict:
    """``overrides`` without the entries another key sets (``OWNED_SETTINGS``, as written):
    what is merged into each engine's config. The check accepted them only where they restate
    the actor's settings, and other engines have their own (the critic no hybrid engine, an
    evaluation's actor and the partitioned reference their own stage, offload and batch
    sizes)."""
    drop = [entry.split(".") for _, entry, _ in OWNED_SETTINGS] + \
        [section.split(".") for section in _OWNED_SECTIONS]

    def keep(node: dict, path: list[str]) -> dict:
        out = {}
        for key, value in node.items():
            here = path + [key]
            if here in drop:
                continue
            out[key] = keep(value, here) if isinstance(value, dict) else value
        return out
    return keep(overrides, [])


def engine_entries(overrides: dict, zero_stage: int) -> dict:
    """What an engine at ZeRO ``zero_stage`` gets of ``system.deepspeed_config``: the entries
    ``without_owned``, and at stage 0 none of ZeRO's section (its entries are for stages
    1-3, and DeepSpeed refuses some at 0): an evaluation's actor of a ZeRO-1/2 run is built
    at stage 0."""
    out = without_owned(overrides)
    if zero_stage == 0:
        out.pop("zero_optimization", None)
    return out


class _OneRank:
    """An ``mpu`` for DeepSpeedConfig: one data-parallel rank, as the configs checked here
    are built for (it asks torch.distributed otherwise, once that is up)."""

    @staticmethod
    def get_data_parallel_world_size() -> int:
        return 1


def deepspeed_overrides_problem(overrides: dict, trained: dict,
                                others: list[tuple[dict, int]] = ()) -> str | None:
    """Why ``overrides`` (``system.deepspeed_config``) cannot be merged into the configs
    built here, or None. ``trained``: the actor's config as built for one rank from the
    run's keys (the critic's is the same without the hybrid engine); ``others``: (config,
    ZeRO stage) of models that do not train, which get the ``engine_entries`` of that stage.
    Each is parsed by DeepSpeed with the overrides: an error is DeepSpeed refusing an entry
    (its pydantic check of a section, its own ValueErrors). The trained config is also
    parsed without them, and a setting of ``OWNED_SETTINGS`` that differs is one another key
    decides. A top-level key DeepSpeed does not read is an error when it is spelled nearly as
    one it reads (a typo), else a warning (once per process, on the first rank): DeepSpeed
    ignores such keys, and some are read by its parts outside the check."""
    import difflib

    from deepspeed.runtime.config import DeepSpeedConfig

    if "zero_optimization" in overrides and not isinstance(overrides["zero_optimization"], dict):
        return ("zero_optimization must be a mapping of ZeRO's entries (DeepSpeed's old form "
                f"{overrides['zero_optimization']!r} sets the stage, which system.zero_stage sets)")
    for old, new in _OLD_NAMES.items():
        node = overrides
        for part in old.split("."):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            return f"{old} is DeepSpeed's old name of {new}: write {new}"
    read: set[str] = set()

    class _Reading(dict):  # the top-level keys DeepSpeed's config reader asks for
        def get(self, key, *default):
            read.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            read.add(key)
            return super().__contains__(key)

    parsed = []
    configs = [(trained, overrides)] + [(c, engine_entries(overrides, st)) for c, st in others]
    for built, entries in configs:
        try:
            parsed.append(DeepSpeedConfig(_Reading(merged_config(built, entries, log=False)),
                                          mpu=_OneRank()))
        except Exception as err:  # pydantic's ValidationError, DeepSpeed's own ValueErrors
            return f"DeepSpeed refuses it: {type(err).__name__}: {' '.join(str(err).split())}"
    own = DeepSpeedConfig(trained, mpu=_OneRank())
    for attribute, entry, key in OWNED_SETTINGS:
        given, set_here = _attribute(parsed[0], attribute), _attribute(own, attribute)
        if given != set_here:
            return (f"{entry} is set by {key} ({_shown(set_here)} here, {_shown(given)} as "
                    f"DeepSpeed reads the entries given): set it there")
    for key in sorted(set(overrides) - read):
        close = difflib.get_close_matches(key, sorted(read), n=1, cutoff=0.9)
        if close:
            return f"{key}: DeepSpeed reads no such key; did you mean {close[0]!r}?"
        if key not in _WARNED and os.environ.get("RANK", "0") == "0":
            _WARNED.add(key)
            logger.warning("system.deepspeed_config.%s: DeepSpeed's config check does not read "
                           "it; it has an effect only if another part of DeepSpeed does", key)
    return None


def _shown(value) -> str:
    return "none" if value is None else repr(value)


def _attribute(obj, path: str):
    """The setting at ``path`` of a parsed DeepSpeedConfig, an enum by its value; None under
    an offload section whose device is "none" (as no section: options given for one that
    offloads nothing change nothing)."""
    for part in path.split("."):
        obj = getattr(obj, part, None)
        device = getattr(obj, "device", None)
        if getattr(device, "value", device) == "none":
            return None
    obj = getattr(obj, "value", obj)
    return None if obj == "none" else obj


_WARNED: set[str] = set()
_MISSING = object()
