"""The ``system`` section of the configuration (``oppo_ds.config.Config.system``): the
training backend (DeepSpeed or Megatron-core) and how it holds the models, ZeRO and offload,
precision, the hybrid engine, DeepSpeed entries of the user's own, threads. Like every
section it is a dataclass with a docstring under each field (``docs/config.md`` is made of
them) and checks in ``__post_init__`` that name the key; ``oppo_ds.config`` loads it with the
others and checks what spans sections.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .config_checks import grad_accum_dtype_problem
from .config_types import require as _require


@dataclass
class SystemConfig:
    backend: Literal["deepspeed", "megatron"] = "deepspeed"
    """Training engine: DeepSpeed (ZeRO, hybrid engine) or Megatron-core (tensor and pipeline
    parallel GPTModels; see docs/megatron.md). Under megatron, DeepSpeed's settings (zero_stage,
    offload, hybrid_engine, partition_reference, deepspeed_config, grad_accum_dtype), LoRA and
    fp16 are refused."""
    tensor_parallel: int = 1
    """Tensor-parallel size of the Megatron-core models (backend: megatron only)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size of the Megatron-core models (backend: megatron only)."""
    megatron_layers: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer implementation of the Megatron-core models: TransformerEngine's fused modules
    (needs the transformer_engine package and CUDA GPUs), megatron-core's own `local` ones, or
    `auto` = TransformerEngine where it imports and a GPU is visible, else local. Checkpoints
    of the Megatron engine resume only under the spec that wrote them."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """DeepSpeed ZeRO stage for actor and critic."""
    offload: bool = False
    """Offload optimizer states (and at stage 3 parameters) to CPU memory. Needs zero_stage
    1, 2 or 3."""
    partition_reference: bool = False
    """Partition the frozen reference model over the data-parallel ranks with ZeRO-3 and
    gather it one layer at a time in its forward (DeepSpeed-Chat's evaluation config), for
    when a full copy per GPU does not fit (70B). Needs zero_stage 3; the reference then scores
    whole sequences after generation (not in oppo.stream_to)."""
    offload_reference: bool = False
    """Keep the reference model's weights in CPU memory (ZeRO-3 parameter offload; DeepSpeed-
    Chat's --offload_reference_model). Needs partition_reference."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward of actor and critic (less memory, ~30% more
    compute per training forward): HF's gradient checkpointing under DeepSpeed; under
    Megatron every layer's input is kept and the layer runs again (full recomputation)."""
    packing_samples: bool = False
    """Pack the sequences of each micro-batch without padding in every forward over whole
    sequences (OpenRLHF's --packing_samples, verl's use_remove_padding): the PPO update's
    forwards and backwards of actor and critic, and the old log-probs, reference log-probs,
    values and reward scores computed after the rollout (an evaluation's scores too). They go
    into rows as wide as the longest sequence, first-fit: with long-tailed responses about
    half the padded tokens, and never a wider or taller forward (docs/memory.md). The outputs
    are the padded batch's up to rounding. A sequence attends to itself only: its positions
    start again at 0 and no attention mask is given, as transformers' architectures under
    their default attention, sdpa, (and the Megatron models) tell packed sequences apart.
    Checked at start with a forward of each model, which stops the run when one lets packed
    sequences see each other (code of a checkpoint's own, flash-attention-2 with several
    rows). The decode and the streaming scorers, on KV caches, are as before."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Training and inference precision."""
    grad_accum_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """The dtype actor and critic accumulate their gradients in (DeepSpeed's
    `data_types.grad_accum_dtype`, OpenRLHF's --grad_accum_dtype). `auto`: fp32 for a bf16
    model under zero_stage 1 without offload, else `dtype`. There fp32 gets DeepSpeed's flat
    BF16 optimizer; its other bf16 optimizers work parameter by parameter (measured on the CPU
    for 290 parameters: 631 small ops and 5 host reads an update, against 8420 and 585 under
    ZeRO-0 and 4461 and 8 under ZeRO-1 with bf16 gradients; docs/benchmarks.md). It keeps the
    whole model's gradients in fp32 on every rank (4 bytes a parameter, twice bf16's; oppo-plan
    counts them), and reduces them across ranks in bf16 as DeepSpeed does: with bf16 on one GPU
    prefer zero_stage 1, which partitions nothing there; where memory is short, bf16, or
    ZeRO-2/3. fp32 is also allowed with bf16 under ZeRO-2/3 (their optimizers then accumulate
    in fp32 partitions); DeepSpeed refuses it under ZeRO-0, and with offload it is untested
    here. Backend deepspeed."""
    hybrid_engine: bool = False
    """Run the actor under DeepSpeed's hybrid engine (inference kernels for generation where
    DeepSpeed has them for the architecture, on a GPU, without LoRA: DeepSpeed's kernels would
    decode with the base weights; the model's own forward otherwise). The kernels' KV
    workspace (`hybrid_engine.max_out_tokens`) holds the longest sequence a rollout reaches:
    generation.max_prompt_len + max_new_tokens + sync_every (with the rollout pool a carried
    response of up to max_new_tokens - 1 more), rounded up to 64."""
    inference_tp_size: int = 1
    """Tensor-parallel size of the hybrid engine's inference containers."""
    deepspeed_config: Optional[dict] = None
    """DeepSpeed config entries merged into the config oppo-ds builds for each DeepSpeed
    engine (actor, critic, an evaluation's actor, and with partition_reference the
    reference), for what no key here sets: ZeRO's buckets and prefetching (`zero_optimization: {reduce_bucket_size: 5e8,
    overlap_comm: true, stage3_prefetch_bucket_size: ...}`), ZeRO++ (`zero_hpz_partition_size`,
    `zero_quantized_weights`), `communication_data_type`, `comms_logger`, `flops_profiler`.
    Mappings merge key by key; a value replaces the built one (logged). Checked at start
    against the configs the run builds: what DeepSpeed's own check refuses stops the run;
    what another key sets (batch sizes, ZeRO stage and offload device, dtype, optimizer and
    scheduler, gradient clipping, the hybrid engine's switch; compared as DeepSpeed parses
    it) is refused unless it restates the run's value, naming the key to use; a top-level
    key DeepSpeed does not read is a warning, or an error when it is spelled nearly as one it
    reads. Backend deepspeed. Null: none."""
    torch_threads: int = 0
    """torch intra-op threads per process (0 = torch's default; set 1 per rank when several
    ranks share a small CPU)."""
    cudnn_attention: bool = False
    """Let torch's scaled-dot-product attention use its cuDNN backend (on GPUs). Off: cuDNN
    builds a plan for every new input shape, and a rollout meets new shapes nearly every
    forward (rows end, chunks and prompts change width): on an H100 the decode at new shapes
    took 72 ms a token with it and 25 ms without (Qwen2.5-0.5B, batch 32; docs/benchmarks.md).
    The other backends (flash, memory-efficient, math) then serve. Process-wide."""
    switch_interval_ms: float = 0.0
    """Python's thread switch interval during each PPO step, in milliseconds (0 = Python's
    own, 5 ms). Under `oppo.placement: colocated` the decoding thread and the scorers' thread
    share the interpreter, and a thread that wants it back may wait up to one interval, about
    a replayed token's time with `generation.cuda_graph`. On one H200, 0.5 and 0.1 ms left the
    colocated decode's time unchanged (docs/benchmarks.md, the fifth GPU run): for hosts where
    the threads' contention is worse. Process-wide while a step runs."""

    def __post_init__(self):
        _require(self.inference_tp_size >= 1, "inference_tp_size", "must be >= 1")
        _require(self.torch_threads >= 0, "torch_threads", "must be >= 0")
        _require(self.switch_interval_ms >= 0, "switch_interval_ms",
                 f"must be >= 0 (0 = Python's own), got {self.switch_interval_ms}")
        for key in ("tensor_parallel", "pipeline_parallel"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
            _require(self.backend == "megatron" or getattr(self, key) == 1, key,
                     f"needs backend: megatron (DeepSpeed's tensor parallel for generation is "
                     f"inference_tp_size), got {getattr(self, key)} with backend: {self.backend}")
        _require(self.backend == "megatron" or self.megatron_layers == "auto", "megatron_layers",
                 f"needs backend: megatron, got {self.megatron_layers} with backend: "
                 f"{self.backend}")
        if self.backend == "megatron":  # its models are sharded by tensor x pipeline parallel
            for key, off in (("zero_stage", 0), ("offload", False), ("hybrid_engine", False),
                             ("partition_reference", False)):
                value = getattr(self, key)
                _require(value == off, key, (
                    f"needs backend: deepspeed (megatron shards the models by tensor_parallel "
                    f"and pipeline_parallel; leave it at {str(off).lower()}), got "
                    f"{str(value).lower()} with backend: megatron"))
            _require(self.dtype != "fp16", "dtype", "backend megatron supports fp32 and bf16 "
                     "(fp16 would need loss scaling), got fp16")
        _require(not self.offload or self.zero_stage >= 1 or self.backend != "deepspeed", "offload",
                 "needs zero_stage 1, 2 or 3 (ZeRO-Offload moves the partitioned optimizer "
                 f"states), got zero_stage: {self.zero_stage}")
        _require(self.backend == "deepspeed" or self.grad_accum_dtype == "auto",
                 "grad_accum_dtype", f"needs backend: deepspeed (allowed with backend "
                 f"{self.backend}: auto), got {self.grad_accum_dtype}")
        if self.backend == "deepspeed":
            problem = grad_accum_dtype_problem(self.grad_accum_dtype, dtype=self.dtype,
                                               zero_stage=self.zero_stage, offload=self.offload)
            _require(problem is None, "grad_accum_dtype", str(problem))
        _require(not self.partition_reference or self.zero_stage == 3, "partition_reference",
                 f"needs zero_stage: 3, got zero_stage: {self.zero_stage}")
        _require(not self.offload_reference or self.partition_reference, "offload_reference",
                 "needs partition_reference: true (the offloaded weights are ZeRO-3 partitions)")
        _require(self.deepspeed_config is None or self.backend == "deepspeed",
                 "deepspeed_config", f"needs backend: deepspeed, got backend: {self.backend}")

    def check_world(self, processes: int) -> None:
        """``ConfigError`` when ``processes`` (the run's actor ranks) cannot be cut into whole
        model replicas of tensor_parallel x pipeline_parallel ranks."""
        per_replica = self.tensor_parallel * self.pipeline_parallel
        _require(processes % per_replica == 0, "tensor_parallel", (
            f"{self.tensor_parallel} x pipeline_parallel {self.pipeline_parallel} = {per_replica} "
            f"processes per model replica, but this run has {processes}: launch a multiple of "
            f"{per_replica} (deepspeed --num_gpus {per_replica} --module oppo_ds.train ..., or "
            f"torchrun --nproc_per_node {per_replica} -m oppo_ds.train ...), or set smaller sizes"))
