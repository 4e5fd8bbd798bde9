"""DeepSpeed implementation of :class:`~oppo_ds.engines.base.TrainEngine`.

ZeRO stages 0-3, optional CPU offload, fp32/bf16/fp16, and DeepSpeed's hybrid engine
(one engine that trains and generates). Everything DeepSpeed-specific in oppo-ds lives
in this file, in ``ds_frozen.py`` (the frozen reference and reward models) and in
``ds_checkpoint.py`` (checkpoint files read for the weights alone).

Hybrid engine paths (``DeepSpeedTrainEngine.hybrid_engine_path``):

* ``"off"``: a plain ``DeepSpeedEngine``.
* ``"kernels"``: DeepSpeed replaced the transformer layers' forward with its fused
  inference kernels for generation (GPU only; architectures with an injection policy in
  ``deepspeed.module_inject.replace_policy.replace_policies``: GPT-2, Llama, OPT, BLOOM,
  GPT-NeoX, GPT-J, ...).
* ``"no-kernels (...)"``: a ``DeepSpeedHybridEngine`` whose generation runs the model's own
  forward. DeepSpeed 0.19.8 chooses this itself for architectures without a policy (Qwen2,
  OPT with Cache-based layers). On CPU it must be forced: the kernels do not exist there and
  ``deepspeed.initialize`` fails with "This op had not been implemented on CPU backend" for
  GPT-2/Llama. With LoRA it is forced too (:func:`_kernel_choice`: the kernels would decode
  with the base weights). See :func:`_hybrid_engine_without_kernels` for how it is forced.

Unverified (no GPU when this was written): the "kernels" path with transformers >= 5. The
injected layer (``deepspeed/model_implementations/transformers/ds_transformer.py``) keeps
its KV cache inside DeepSpeed's workspace and returns a tuple, while transformers 5 layers
take a ``Cache`` object (GPT-2 passes it positionally, where the injected forward expects
``input_mask``) and return a tensor. DeepSpeed 0.19.8 already keeps OPT off its kernels for
exactly this reason. ``tests/test_engines.py::test_hybrid_engine_kernels_on_gpu`` checks it
on a GPU; if it fails there, pass ``inject_kernels=False``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import socket
import sys
import threading
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

# Without CUDA, DeepSpeed picks Apple's MPS backend where torch has one (a Mac laptop, where
# users try the demo first), and would put the trained models there while the frozen ones,
# the host-side statistics (float64, which MPS lacks) and the gloo collectives are on the CPU:
# ask for its CPU accelerator unless the user chose one. Before anything imports deepspeed.
if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
    os.environ["DS_ACCELERATOR"] = "cpu"

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

from oppo_ds.comm import check_local_device, set_local_cuda_device
from oppo_ds.engines.base import (
    LossFn,
    ModelCallable,
    TrainEngine,
    check_schedule,
    eval_mode,
    lr_multiplier,
    reapply_hyperparameters,
)
# pure functions of the environment, kept importable from here
from oppo_ds.rendezvous import expand_hostlist, slurm_rendezvous  # noqa: F401
from oppo_ds.engines.ds_checkpoint import load_weights_alone, tag_folder
from oppo_ds.engines.ds_config import (MAX_OUT_TOKENS, build_ds_config,
                                      build_inference_ds_config, merged_config)

logger = logging.getLogger(__name__)

HYBRID_OFF = "off"
HYBRID_KERNELS = "kernels"
HYBRID_NO_KERNELS_CPU = "no-kernels (CPU: model's own forward)"
HYBRID_NO_KERNELS_NO_POLICY = "no-kernels (no DeepSpeed policy for this architecture: model's own forward)"
HYBRID_NO_KERNELS_REQUESTED = "no-kernels (inject_kernels=False: model's own forward)"
HYBRID_NO_KERNELS_LORA = ("no-kernels (LoRA: DeepSpeed's kernels would decode with the base "
                          "weights alone; model's own forward)")

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------------------
# Process group
# --------------------------------------------------------------------------------------

def find_free_port() -> int:
    """A TCP port that was free a moment ago, drawn at random below the kernel's ephemeral
    range (never a fixed number). A port from that range, which is what binding port 0 gives,
    can be taken before the rendezvous server binds it by any process's outgoing connection,
    its own clients' included: a client connecting to a port nobody listens on yet may be
    given that same port as its local one and connect to itself (TCP self-connect), which
    torch's TCPStore reports as "Connection reset by peer". Below the range no outgoing
    connection is given it, and a random draw keeps concurrent callers (tests run side by
    side, runs started together) apart. Where the range leaves no room below it, the OS picks
    as before."""
    low = _ephemeral_port_floor()
    draw = random.SystemRandom()
    for _ in range(64 if low > 2048 else 0):
        port = draw.randint(max(1024, low - 12000), low - 1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # taken: draw again
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_port_floor() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's
    ``net.ipv4.ip_local_port_range``; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# DeepSpeed builds its ops (the CPU all-reduce's shared-memory op at the first init of an
# environment, CPU Adam) under torch's lock files, and a build interrupted by Ctrl-C leaves its
# lock behind: every later start then waits on it forever, printing nothing. Past this many
# seconds of such a wait, say which file it is.
BUILD_LOCK_WARN_S = 180.0


def _extension_locks() -> list[str]:
    """The lock files in torch's extension build directory (TORCH_EXTENSIONS_DIR or its
    default), one per op being built, or left by a build that was interrupted."""
    import glob

    from torch.utils.cpp_extension import _get_build_directory

    try:
        root = os.path.dirname(_get_build_directory("deepspeed_shm_comm", verbose=False))
    except Exception:  # a torch without the helper: nothing to say
        return []
    return sorted(glob.glob(os.path.join(root, "*", "lock")))


@contextlib.contextmanager
def _warn_if_a_build_lock_holds(delay: Optional[float] = None) -> Iterator[None]:
    """Around a DeepSpeed call that may build an op: if it is still going after ``delay``
    seconds (default BUILD_LOCK_WARN_S) while a build lock exists, warn naming the lock."""
    def check():
        locks = _extension_locks()
        if locks:
            message = (f"still waiting after {delay:.0f} s while {', '.join(locks)} exist(s): the "
                       f"lock of a DeepSpeed op's build. Another process of this run may be building "
                       f"it (a first start in an environment takes about a minute); if none is, a "
                       f"build interrupted earlier left it: remove the file and start again")
            logger.warning(message)
            print(f"oppo-train: warning: {message}", file=sys.stderr, flush=True)
    delay = BUILD_LOCK_WARN_S if delay is None else delay
    timer = threading.Timer(delay, check)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def init_distributed_if_needed() -> None:
    """Initialise ``deepspeed.comm`` (and torch.distributed) once per process.

    Under a launcher (``deepspeed``, ``torchrun``) the rendezvous variables are set and used
    as they are. Under ``srun`` without such a launcher they are derived from Slurm's
    variables (:func:`slurm_rendezvous`) and stay set for the life of the job, as a
    launcher's would. A bare ``python script.py`` (no ``WORLD_SIZE``, no MPI or srun
    variables) is a single-process group: only the missing variables among MASTER_ADDR,
    MASTER_PORT (a free port), RANK, WORLD_SIZE, LOCAL_RANK are filled in, and all but
    LOCAL_RANK are removed again once the group exists. The backend is the accelerator's
    (NCCL on CUDA, gloo on CPU). Calling it again is a no-op.
    """
    if deepspeed.comm.is_initialized():
        return
    added = []
    if not torch.distributed.is_initialized():
        from_slurm = slurm_rendezvous(dict(os.environ))
        launched_by_mpi = any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))
        if from_slurm is not None:
            # before the MPI check: srun --mpi=pmi2/pmix also sets PMI_SIZE, and DeepSpeed's MPI
            # discovery would then need mpi4py for what Slurm already says
            os.environ.update(from_slurm)
        elif "WORLD_SIZE" not in os.environ and not launched_by_mpi:
            defaults = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": None, "RANK": "0",
                        "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
            for key, value in defaults.items():
                if key not in os.environ:
                    os.environ[key] = value if value is not None else str(find_free_port())
                    added.append(key)
    # each process on its own GPU before anything lands on one (the models built next)
    set_local_cuda_device()
    # If torch.distributed is already up, deepspeed.comm wraps the existing group.
    shm_name = _shm_buffer_name()
    with _warn_if_a_build_lock_holds():  # its CPU all-reduce builds an op on first use
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    set_local_cuda_device()  # again: under mpirun DeepSpeed's MPI discovery sets LOCAL_RANK
    if shm_name is not None:
        _unlink_shm_buffer(shm_name)
    # The group exists now: drop the rendezvous variables we invented, so that processes this
    # one starts (a benchmark's runs, a test's launcher) do not inherit and collide on this
    # port. LOCAL_RANK stays: every deepspeed.initialize reads it.
    for key in added:
        if key != "LOCAL_RANK":
            os.environ.pop(key, None)


def _shm_buffer_name() -> str | None:
    """The /dev/shm file DeepSpeed's CPU communication op creates for this rank when every
    rank of the job is on this machine (deepspeed/ops/csrc/cpu/comm/shm.cpp and
    shm_interface.cpp: ``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``,
    under the condition WORLD_SIZE == LOCAL_SIZE), or None when it creates none."""
    if get_accelerator().device_name() != "cpu":
        return None
    env = os.environ
    world, local = env.get("WORLD_SIZE"), env.get("LOCAL_SIZE")
    if world is None or world != local or "RANK" not in env:
        return None
    return (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
            f"{env.get('MASTER_PORT', '')}_{env['RANK']}")


def _unlink_shm_buffer(path: str) -> None:
    """DeepSpeed never removes its ~66 MB shared-memory buffer: on a machine that runs many
    jobs they pile up in /dev/shm (RAM) until it is full (seen: 21 GB after a day of test
    runs). Every rank maps all ranks' buffers during init; after a barrier no rank needs the
    names any more, and the mappings stay valid after the unlink, so each rank removes its own."""
    if not torch.distributed.is_initialized():
        return
    torch.distributed.barrier()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:  # not ours to fail a run over
        logger.warning("could not remove DeepSpeed's shared-memory buffer %s: %s", path, err)


# --------------------------------------------------------------------------------------
# Hybrid engine without inference kernels
# --------------------------------------------------------------------------------------

class _HybridEngineWithoutKernels(DeepSpeedHybridEngine):
    """A hybrid engine that injects no inference kernels: generation uses the model's own
    forward (and its own KV cache), training is unchanged.

    ``DeepSpeedHybridEngine.__init__`` calls ``create_inference_module``, which calls
    ``populate_all_inference_policies`` and wraps every layer that has a policy in a kernel
    container. With no policies no container is built: the same state DeepSpeed 0.19.8
    reaches by itself for architectures it has no policy for.
    """

    def populate_all_inference_policies(self):
        self.inference_policies = {}


@contextlib.contextmanager
def _hybrid_engine_without_kernels() -> Iterator[None]:
    """Make ``deepspeed.initialize`` build :class:`_HybridEngineWithoutKernels`.

    ``deepspeed.initialize`` (deepspeed/__init__.py, 0.19.8) instantiates the hybrid engine
    through the module-level name ``deepspeed.DeepSpeedHybridEngine``. That one name is
    rebound for the duration of the call and restored in ``finally``. DeepSpeed's class is
    never modified, so engines built before, after or without this context keep their
    kernels; only the engine built inside is an instance of the subclass (still an
    ``isinstance`` of ``DeepSpeedHybridEngine``). Not thread-safe: do not build engines
    from two threads at once.
    """
    if "DeepSpeedHybridEngine" not in deepspeed.initialize.__code__.co_names:
        # A DeepSpeed that builds the engine some other way would silently inject kernels
        # (and fail on CPU); say so instead.
        raise RuntimeError(
            f"deepspeed {deepspeed.__version__}: deepspeed.initialize no longer refers to "
            "deepspeed.DeepSpeedHybridEngine; oppo_ds cannot disable the hybrid engine's "
            "inference kernels with this version")
    original = deepspeed.DeepSpeedHybridEngine
    deepspeed.DeepSpeedHybridEngine = _HybridEngineWithoutKernels
    try:
        yield
    finally:
        deepspeed.DeepSpeedHybridEngine = original


# --------------------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------------------

def _param_groups(model: torch.nn.Module, weight_decay: float,
                  lora_lr: float | None = None) -> list[dict]:
    """Weight decay on matrices only: biases and norm scales (1-D) are not decayed. With
    ``lora_lr`` the LoRA matrices (``oppo_ds.lora``) are a group of their own, last, at that
    learning rate, decayed (DeepSpeed-Chat's ``get_optimizer_grouped_parameters``)."""
    from oppo_ds.lora import LORA_KEYS

    decay, no_decay, lora = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if lora_lr is not None and name.rsplit(".", 1)[-1] in LORA_KEYS:
            lora.append(param)
        else:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0},
              {"params": lora, "weight_decay": weight_decay, "lr": lora_lr}]
    # ZeRO flattens each group; an empty one breaks its partitioning.
    return [g for g in groups if g["params"]]


def _build_optimizer(model: torch.nn.Module, *, use_cpu_adam: bool, lr: float,
                     weight_decay: float, betas: tuple[float, float],
                     eps: float, lora_lr: float | None = None) -> torch.optim.Optimizer:
    groups = _param_groups(model, weight_decay, lora_lr)
    if use_cpu_adam:
        # Imported here: the first construction JIT-compiles the op (~1 min, cached), and
        # waits for good on the lock of a build that was stopped part-way: it names the lock
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        with _warn_if_a_build_lock_holds():
            return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def _build_lr_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int,
                        total_steps: int, scheduler: str) -> torch.optim.lr_scheduler.LambdaLR:
    # Passed to deepspeed.initialize, it is stepped once per update by engine.step() and its
    # state is saved/loaded with the engine's checkpoints.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_multiplier, warmup_steps=warmup_steps,
                                     total_steps=total_steps, scheduler=scheduler))


# --------------------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------------------

def _zero3_offload(engine):
    """The object that owns a ZeRO-3 engine's module hooks: the engine's optimizer for a
    frozen (inference-only) engine, its ``parameter_offload`` for a trained one."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    optimizer = engine.optimizer
    return optimizer if isinstance(optimizer, DeepSpeedZeRoOffload) else optimizer.parameter_offload


@contextlib.contextmanager
def gathered_without_hooks(engines: list) -> Iterator[None]:
    """Every parameter of the ZeRO-3 ``engines`` whole on every rank until the context ends,
    and their modules' forwards inside it free of collectives. Collective on entry and exit
    (every rank enters it once).

    ``GatheredParameters`` alone gathers the weights once, but ZeRO-3's module hooks still
    run on every forward: a submodule's post-forward hook re-partitions its parameters (unless
    the recorded trace says they are reused soon), the next forward all-gathers them again,
    and the root's pre-forward hook compares the recorded module order across ranks until the
    trace is complete. All of these are collectives, which hang or mismatch when ranks make
    different numbers of forwards (each rank's rollout ends at its own token and streams its
    own rows). So the hooks are taken off for the context and put back after it (the trace
    is then re-recorded, as after any change of hooks). Costs a full copy of each model's
    weights per rank, as the hybrid engine's gathered generation. No autograd inside."""
    from deepspeed.runtime.zero import parameter_offload

    params = [p for e in engines for p in e.module.parameters()]
    with torch.no_grad(), deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        offloads = [_zero3_offload(e) for e in engines]
        for offload in offloads:
            offload._remove_module_hooks()
            offload.forward_hooks.clear()
            offload.backward_hooks.clear()
            # setup_zero_stage3_hooks pushes the root again: keep the stack at one entry each
            stack = parameter_offload.FWD_MODULE_STACK
            if offload.module in stack:
                del stack[len(stack) - 1 - stack[::-1].index(offload.module)]
        try:
            yield
        finally:
            for offload in offloads:
                offload.setup_zero_stage3_hooks()


# Every DeepSpeed engine this module started and has not destroyed. DeepSpeed keeps an engine
# alive after its last reference is gone (its hooks and globals hold it): measured on the CPU,
# a ZeRO-3 engine's 1.9 GB of buffers (its 5e8-element reduce bucket) stayed after ``del`` and
# ``gc.collect()``; its ``destroy()`` gave them back. Weak: the set keeps nothing alive.
_OPEN_ENGINES: "weakref.WeakSet[deepspeed.DeepSpeedEngine]" = weakref.WeakSet()


def _initialize(**kwargs) -> deepspeed.DeepSpeedEngine:
    """``deepspeed.initialize``, its engine recorded as open; first ``check_local_device``."""
    check_local_device()
    engine = deepspeed.initialize(**kwargs)[0]
    _OPEN_ENGINES.add(engine)
    return engine


def _destroy(engine: deepspeed.DeepSpeedEngine) -> bool:
    """Destroy ``engine`` if it is open; True if it was."""
    if engine not in _OPEN_ENGINES:
        return False
    _OPEN_ENGINES.discard(engine)
    engine.destroy()
    return True


def open_engines() -> list[deepspeed.DeepSpeedEngine]:
    """The DeepSpeed engines this package started in this process and has not closed."""
    return list(_OPEN_ENGINES)


def close_engines(engines: Optional[list] = None) -> int:
    """Destroy ``engines`` (default: every open one, see :func:`open_engines`): their ZeRO
    buffers, optimizer state and hooks are given back. Their models cannot train or be
    gathered after. For a process that builds trainers one after another (a notebook, a test
    suite); :meth:`PPOTrainer.close` closes its own. Returns how many were open."""
    return sum(_destroy(engine) for engine in list(_OPEN_ENGINES if engines is None else engines))


def _kernel_choice(model: torch.nn.Module, device_type: str, inject_kernels: bool | None) -> str:
    """The hybrid engine's path to build (``HYBRID_KERNELS``: DeepSpeed injects its kernels
    where it has a policy for the architecture), or ``ValueError`` for ``inject_kernels=True``
    where they cannot serve.

    Not with LoRA (``oppo_ds.lora``): DeepSpeed's containers fold the update into the weights
    only inside ``DeepSpeedHybridEngine.generate()``, which oppo-ds does not call (its decode
    runs the module's forward), and Llama's looks for the LoRA tensors on each layer's weight
    (``maybe_get_lora``), where ours are on the layer: the kernels would decode with the base
    weights while the log-probs come from the LoRA model, an off-policy rollout. Folding
    around the decode would not be exact either (``param += s L^T R^T``, then ``-=``, in
    bf16 / fp16, moves the base weights a little every rollout)."""
    if device_type == "cpu":
        if inject_kernels:
            raise ValueError("inject_kernels=True needs a GPU: DeepSpeed's inference kernels "
                             "are not implemented on CPU; use None or False")
        return HYBRID_NO_KERNELS_CPU
    if inject_kernels is False:
        return HYBRID_NO_KERNELS_REQUESTED
    from oppo_ds.lora import has_lora

    if has_lora(model):
        if inject_kernels:
            raise ValueError("inject_kernels=True with LoRA layers: DeepSpeed's kernels would "
                             "decode with the base weights alone; use None or False")
        return HYBRID_NO_KERNELS_LORA
    return HYBRID_KERNELS


class DeepSpeedTrainEngine(TrainEngine):
    """A model trained with DeepSpeed (``deepspeed.initialize`` with a built config).

    Args:
        model: the HF model (or any ``nn.Module`` called with keyword tensors); DeepSpeed
            moves it to the accelerator and casts it to ``dtype``. Under ZeRO-3 its
            parameters are partitioned in place: do not reuse the object elsewhere.
        lr, weight_decay, betas, eps: AdamW (decoupled weight decay, matrices only).
        warmup_steps, total_steps, scheduler: LR schedule, see
            :func:`~oppo_ds.engines.base.lr_multiplier`; counted in optimizer updates.
        micro_batch_size: sequences per micro-batch on one rank.
        gradient_accumulation_steps: micro-batches per update.
        zero_stage, offload, dtype, grad_clip: see
            :func:`~oppo_ds.engines.ds_config.build_ds_config`.
        hybrid_engine: use DeepSpeed's hybrid engine (see the module docstring).
        inference_tp_size: tensor-parallel degree of the hybrid engine's kernels.
        cpu_adam: ``None``: DeepSpeedCPUAdam when ``offload``, else ``torch.optim.AdamW``.
        seed: seeds torch's RNGs (dropout) before DeepSpeed starts.
        inject_kernels: hybrid engine only. ``None``: inject DeepSpeed's inference kernels
            where DeepSpeed has them, except on CPU where none exist and for a model with LoRA
            layers (see :func:`_kernel_choice`). ``False``: never
            (e.g. an architecture whose kernels misbehave). ``True``: require them
            (``ValueError`` on CPU or with LoRA).
        release_inference_cache: hybrid engine with kernels: free their KV workspace after
            each generation.
        max_out_tokens: hybrid engine with kernels: the positions their KV workspace holds,
            prompt and response (:func:`~oppo_ds.engines.ds_config.hybrid_max_out_tokens`).
        tensorboard_dir: DeepSpeed's own TensorBoard monitor.
        ds_config_overrides: merged (recursively) into the built config last; for keys this
            class does not expose. Overridden values are logged.
        weights_only: the weights alone, for an evaluation (``oppo-train --evaluate``): no
            optimizer, no schedule, so no fp32 master copy or Adam moments are allocated
            (under ZeRO-1/2 DeepSpeed allocates the master partition when the engine is
            built, the moments at the first update or load). ZeRO-1/2
            run as ZeRO-0 (they partition the optimizer alone: every rank holds the whole
            weights either way); ZeRO-3 partitions the parameters as in training, and
            :meth:`load` reads each rank's own partitions. It loads any of these stages'
            checkpoints of the same ranks and cannot train or save.
        grad_accum_dtype: the gradients' dtype (``auto``: fp32 for a bf16 model under ZeRO-1
            without offload, DeepSpeed's flat BF16 optimizer; else the model's dtype); see
            :func:`~oppo_ds.engines.ds_config.grad_accum_dtype_for`. Unused with
            ``weights_only``.
        lora_lr: the LoRA matrices' peak learning rate, in a parameter group of their own
            (``model.lora_learning_rate``); ``None``: ``lr``, in the other groups. The same
            schedule scales both.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        total_steps: int,
        scheduler: str = "constant",
        micro_batch_size: int,
        gradient_accumulation_steps: int = 1,
        zero_stage: int = 0,
        offload: bool = False,
        dtype: str = "fp32",
        grad_clip: float | None = 1.0,
        hybrid_engine: bool = False,
        inference_tp_size: int = 1,
        cpu_adam: bool | None = None,
        seed: int = 0,
        inject_kernels: bool | None = None,
        release_inference_cache: bool = False,
        max_out_tokens: int = MAX_OUT_TOKENS,
        tensorboard_dir: str | None = None,
        ds_config_overrides: dict | None = None,
        weights_only: bool = False,
        grad_accum_dtype: str = "auto",
        lora_lr: float | None = None,
    ) -> None:
        check_schedule(warmup_steps=warmup_steps, total_steps=total_steps, scheduler=scheduler)
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        for name, value in (("cpu_adam", cpu_adam), ("inject_kernels", inject_kernels)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be one of [None, True, False], got {value!r}")

        init_distributed_if_needed()
        self.world_size = deepspeed.comm.get_world_size()
        self.rank = deepspeed.comm.get_rank()
        self.device = torch.device(get_accelerator().current_device_name())
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.zero_stage = zero_stage
        self.dtype = dtype

        self.weights_only = weights_only
        use_cpu_adam = offload if cpu_adam is None else cpu_adam
        hybrid = dict(hybrid_engine=hybrid_engine, inference_tp_size=inference_tp_size,
                      release_inference_cache=release_inference_cache,
                      max_out_tokens=max_out_tokens)
        if weights_only:
            self.config = build_inference_ds_config(
                zero_stage=3 if zero_stage == 3 else 0, offload=offload and zero_stage == 3,
                dtype=dtype, micro_batch_size=micro_batch_size, world_size=self.world_size,
                **hybrid)
        else:
            self.config = build_ds_config(
                train_micro_batch_size_per_gpu=micro_batch_size,
                gradient_accumulation_steps=gradient_accumulation_steps,
                world_size=self.world_size, zero_stage=zero_stage, offload=offload,
                dtype=dtype, grad_clip=grad_clip, tensorboard_dir=tensorboard_dir,
                force_ds_cpu_optimizer=use_cpu_adam, grad_accum_dtype=grad_accum_dtype, **hybrid)
        if ds_config_overrides:
            self.config = merged_config(self.config, ds_config_overrides, log=self.rank == 0)

        torch.manual_seed(seed)
        get_accelerator().manual_seed_all(seed)
        optimizer = lr_scheduler = None
        if not weights_only:
            optimizer = _build_optimizer(model, use_cpu_adam=use_cpu_adam, lr=lr,
                                         weight_decay=weight_decay, betas=betas, eps=eps,
                                         lora_lr=lora_lr)
            self._group_decay = [g["weight_decay"] for g in optimizer.param_groups]
            self._group_lrs = [g["lr"] for g in optimizer.param_groups]
            lr_scheduler = _build_lr_scheduler(optimizer, warmup_steps=warmup_steps,
                                               total_steps=total_steps, scheduler=scheduler)
        self._peak_lr, self._adam = lr, (tuple(betas), eps)
        path = _kernel_choice(model, self.device.type, inject_kernels) if hybrid_engine \
            else HYBRID_OFF
        without_kernels = hybrid_engine and path != HYBRID_KERNELS
        with _hybrid_engine_without_kernels() if without_kernels else contextlib.nullcontext():
            self._engine = _initialize(model=model, optimizer=optimizer,
                                       lr_scheduler=lr_scheduler, config=self.config)
        self.module = self._engine.module
        # DeepSpeed records the global grad norm in its ZeRO and fp16/bf16 optimizers only;
        # with plain fp32 data parallel it clips with a norm it then drops. Its fp16 optimizers
        # of ZeRO-0 record it times the loss scale (FP16_UnfusedOptimizer) or divided by the
        # scale it sets for the next step (FP16_Optimizer): measured here too, unscaled.
        self._untracked_grad_norm = zero_stage == 0 and dtype in ("fp32", "fp16")
        self._last_grad_norm: float | None = None
        self.optimizer_name = "none (weights only)" if weights_only else type(optimizer).__name__
        # what DeepSpeed wrapped it in (its ZeRO, bf16 or fp16 optimizer), and the gradients'
        # dtype: the wrapper decides how many small ops an update costs
        self.optimizer_wrapper = type(self._engine.optimizer).__name__ \
            if self._engine.optimizer is not None and self._engine.optimizer is not optimizer \
            else None
        self.grad_accum_dtype = self.config.get("data_types", {}).get("grad_accum_dtype", dtype)
        # DeepSpeed injects its kernels where it has a policy for the architecture
        self.hybrid_engine_path = HYBRID_NO_KERNELS_NO_POLICY if path == HYBRID_KERNELS and \
            not self._engine._inference_containers else path
        if self.rank == 0:
            logger.info("DeepSpeed engine: ZeRO-%d, %s, offload=%s, optimizer=%s%s, "
                        "hybrid engine: %s", zero_stage, dtype, offload, self.optimizer_name,
                        f" in {self.optimizer_wrapper}, gradients in {self.grad_accum_dtype}"
                        if self.optimizer_wrapper else "", self.hybrid_engine_path)

    # -- TrainEngine ---------------------------------------------------------------------

    @property
    def ds_engine(self) -> deepspeed.DeepSpeedEngine:
        """The underlying DeepSpeed engine, for what this interface does not cover."""
        return self._engine

    def train_step(self, micro_batches: list, loss_fn: LossFn) -> list[dict]:
        self._refuse_without_optimizer("train")
        self._check_micro_batches(micro_batches)
        self._engine.train()
        all_stats = []
        for i, micro_batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # the accumulation boundary is this call's last micro-batch, however many there
            # are (DeepSpeed would count gradient_accumulation_steps of them): step() updates
            # there only, and ZeRO reduces the gradients there. backward() divides by
            # gradient_accumulation_steps either way.
            self._engine.set_gradient_accumulation_boundary(last)
            loss, stats = loss_fn(self._engine, micro_batch)
            scale = self._backward(loss)
            if last and self._untracked_grad_norm:
                norm = _total_grad_norm(self.module)
                if norm is not None and self.dtype == "fp16" and not math.isfinite(norm):
                    norm = math.inf  # an overflow (NaN too), skipped: inf as DeepSpeed logs it
                self._last_grad_norm = None if norm is None else norm / scale
            self._engine.step()
            all_stats.append(stats)
        return all_stats

    def _backward(self, loss: torch.Tensor) -> float:
        """``engine.backward(loss)``, the loss multiplied by the fp16 loss scale where DeepSpeed
        does not do it (see :func:`_fp16_loss_scale`); returns the factor the gradients carry."""
        scale = _fp16_loss_scale(self._engine.optimizer) if self.dtype == "fp16" else None
        if scale is None:
            self._engine.backward(loss)
            return 1.0
        with _optimizer_backward_unscaled(self._engine.optimizer):
            self._engine.backward(loss.float() * scale)
        return scale

    def forward_no_grad(self, fn: Callable[[ModelCallable], Any]) -> Any:
        # module.eval(), not engine.eval(): the hybrid engine's eval() would switch to its
        # inference kernels, and old log-probs must come from the training forward.
        with eval_mode(self.module), torch.no_grad():
            return fn(self._engine)

    @contextlib.contextmanager
    def generation_context(self) -> Iterator[torch.nn.Module]:
        was_training = self.module.training
        kernels = self.hybrid_engine_path == HYBRID_KERNELS
        if kernels:
            self._engine.eval()  # swaps the layers' forward for the inference kernels
        else:
            self.module.eval()
        try:
            with torch.no_grad(), self._gathered_for_generation():
                if kernels:
                    self._engine.retake_inference_cache()
                yield self.module
        finally:
            if kernels:
                if self.config["hybrid_engine"]["release_inference_cache"]:
                    self._engine.workspace.release_workspace()
                self._engine.train()  # restores the layers' own forward
            self.module.train(was_training)

    def _gathered_for_generation(self) -> contextlib.AbstractContextManager:
        """Under ZeRO-3, every parameter gathered once for the whole decode, and the module
        run without ZeRO-3's hooks (``gathered_without_hooks``), so that the forwards issue no
        collective and ranks may decode different numbers of steps (a rank whose rows all
        ended stops while the others go on). Gathering alone is not enough: the hooks would
        release and all-gather layers again on later forwards unless the trace keeps them,
        which it does for tiny models only. Costs one full copy of the weights per rank, as
        the hybrid engine's ``pin_parameters`` does. With the hybrid engine's inference
        kernels (GPU), its own containers run the decode: only the gather is ours.
        """
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        if self.hybrid_engine_path == HYBRID_KERNELS:
            return deepspeed.zero.GatheredParameters(list(self.module.parameters()),
                                                     modifier_rank=None)
        return gathered_without_hooks([self._engine])

    def save(self, ckpt_dir: str, tag: str, client_state: dict | None = None) -> None:
        self._refuse_without_optimizer("save a checkpoint")
        self._engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client_state or {})

    def load(self, ckpt_dir: str, tag: str | None = None, *, weights_only: bool = False) -> dict:
        """``weights_only`` (see :meth:`TrainEngine.load`): the module's weights from the model
        file; under ZeRO-1/2 the optimizer files are not read (under ZeRO-0 the optimizer's
        state lies in the model file: read, not applied). Not under ZeRO-3: there DeepSpeed's
        weights-only load assembles the whole fp32 model on every rank from every rank's
        optimizer files (``get_fp32_state_dict_from_zero_checkpoint``, where the full load
        reads this rank's own partition), and of the tag ``latest`` names, not the one asked
        for; the full load it is. An engine built ``weights_only`` reads its weights alone
        whatever it is asked (see :func:`~oppo_ds.engines.ds_checkpoint.load_weights_alone`)."""
        if self.weights_only:
            load_weights_alone(self._engine, tag_folder(ckpt_dir, tag), self.zero_stage,
                               self.rank)
            return {}
        module_only = weights_only and self.zero_stage != 3
        path, client_state = self._engine.load_checkpoint(
            ckpt_dir, tag=tag, load_optimizer_states=not module_only,
            load_lr_scheduler_states=not module_only, load_module_only=module_only)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {ckpt_dir!r} (tag={tag!r})")
        if not module_only:
            self.resumed_changes = reapply_hyperparameters(
                self._engine.optimizer.param_groups, self._engine.lr_scheduler, self._peak_lr,
                self._group_decay, *self._adam, group_lrs=self._group_lrs)
        return client_state or {}

    def lr(self) -> float:
        self._refuse_without_optimizer("report a learning rate")
        return float(self._engine.get_lr()[0])

    def grad_norm(self) -> float | None:
        norm = self._last_grad_norm if self._untracked_grad_norm else self._engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def close(self) -> None:
        """Destroy the DeepSpeed engine (see :func:`close_engines`); idempotent."""
        _destroy(self._engine)


def _total_grad_norm(module: torch.nn.Module) -> float | None:
    """L2 norm of all gradients (already all-reduced at the accumulation boundary), summed in
    fp32: fp16 gradients times the loss scale have norms beyond fp16's range."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return None
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def _fp16_loss_scale(optimizer) -> float | None:
    """The factor DeepSpeed's fp16 optimizer of ZeRO-0 (``FP16_Optimizer``,
    ``FP16_UnfusedOptimizer``) expects the loss to carry, or None for any other optimizer.

    Its ``step()`` divides the gradients by its loss scale (2**16 to start with, dynamic), and
    its ``backward(loss)`` multiplies the loss by it; DeepSpeed 0.19's ``engine.backward`` no
    longer calls that backward (since deepspeedai/DeepSpeed#7665; #8393 would route it back)
    and multiplies by the scale for ZeRO's optimizers alone. Without the factor every update
    was 65536 times too small against Adam's eps, and clipping, which compares the norm
    divided by the scale, never fired. ZeRO's optimizers scale the loss themselves."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        return None
    scale = optimizer.loss_scale  # its external scale where one is set, else the dynamic one
    return 1.0 if scale is None else float(scale)


@contextlib.contextmanager
def _optimizer_backward_unscaled(optimizer) -> Iterator[None]:
    """``optimizer.backward`` a plain ``loss.backward`` for the context, so that a DeepSpeed
    whose ``engine.backward`` goes through it (before #7665, or with #8393) does not scale a
    loss :func:`_fp16_loss_scale` already scaled a second time."""
    def backward(loss, create_graph=False, retain_graph=False):
        loss.backward(create_graph=create_graph, retain_graph=retain_graph)

    optimizer.backward = backward  # an instance attribute, in front of the class's method
    try:
        yield
    finally:
        del optimizer.backward
