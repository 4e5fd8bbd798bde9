"""What DeepSpeed's update costs on the host for a model of many small parameters, by ZeRO stage,
dtype and gradient dtype: not a test (pytest does not collect it), the measurement behind
``system.grad_accum_dtype`` (docs/benchmarks.md, "DeepSpeed's flat BF16 optimizer").

    .venv/bin/python tests/bench_optimizer_step.py [STEPS]
    .venv/bin/python tests/bench_optimizer_step.py trainer [STEPS]

A Qwen2 language model with Qwen2.5-0.5B's 24 layers and 290 parameters but a width of 64 and
a vocabulary of 512, so that the per-parameter work of the optimizer's wrapper, not its
arithmetic, is what the update costs. Each configuration is built in a process of its own (a
``DeepSpeedTrainEngine``: torch's AdamW, gradient clipping at 1.0) and makes STEPS updates of
one micro-batch (8 sequences of 64 tokens). Printed per configuration: the optimizer DeepSpeed
wrapped AdamW in; the medians (after 2 warm-up updates) of the forward and backward and of
``engine.step()``; and, from torch's profile of one more update, the leaf ops each ran that
compute (about the kernels they would launch on a GPU; views and allocations not counted) and
how many of those copy a value to the host (``.item()``, a wait for the GPU there). On a CPU
torch's AdamW updates parameter by parameter (on a GPU it is multi-tensor by default): its own
ops are in every count here.

``trainer``: ``oppo-train`` on the length-oracle workload with the tiny Qwen2 models made 24
layers deep (290 parameters each, as Qwen2.5-0.5B), bf16, batch 16 in 4 mini-batches, under
ZeRO-0 and under ZeRO-1 (``system.grad_accum_dtype`` auto: fp32 there), twice each in turn:
the medians of the training phase (``time/phase/train``: actor and critic updates) over STEPS
steps after the first.

DeepSpeed 0.19.8 wraps AdamW for a bf16 model in ``FP16_UnfusedOptimizer`` under ZeRO-0 (a
loop over the parameters: each gradient cast to fp32, its norm read to the host, unscaled,
each fp32 master copied back), in ``DeepSpeedZeroOptimizer`` under ZeRO-1/2 with bf16
gradients (flat buffers, an overflow check per parameter), and in ``BF16_Optimizer`` under
ZeRO-1 with fp32 gradients (flat buffers throughout); an fp32 model in nothing under ZeRO-0.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

# (ZeRO stage, dtype, system.grad_accum_dtype): auto is fp32 for bf16 under ZeRO-1 alone
CONFIGS = [(0, "bf16", "auto"), (1, "bf16", "bf16"), (1, "bf16", "auto"), (2, "bf16", "auto"),
           (3, "bf16", "auto"), (0, "fp32", "auto")]
WARMUP = 2
# leaf ops that launch no kernel on a GPU (views, allocations): not counted
METADATA_OPS = {"aten::" + name for name in (
    "as_strided", "view", "empty", "empty_strided", "detach", "resolve_conj", "_unsafe_view", "t",
    "transpose", "slice", "narrow", "select", "unsqueeze", "reshape", "alias", "result_type",
    "_has_compatible_shallow_copy_type", "lift_fresh", "expand", "permute", "squeeze")}


def launches(run) -> tuple[int, int]:
    """The leaf aten ops ``run()`` calls that compute (about the kernels it would launch on a
    GPU) and how many of them copy a value to the host (``.item()``: a wait on a GPU)."""
    import collections
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"
                  and e["name"].startswith("aten::")), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    counts = collections.Counter()
    for i, e in enumerate(ops):
        nested = i + 1 < len(ops) and ops[i + 1]["tid"] == e["tid"] and \
            ops[i + 1]["ts"] < e["ts"] + e["dur"]
        if not nested and e["name"] not in METADATA_OPS:
            counts[e["name"]] += 1
    return sum(counts.values()), counts["aten::_local_scalar_dense"]


def measure(stage: int, dtype: str, grad_accum_dtype: str, steps: int) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from oppo_ds.engines.deepspeed_engine import DeepSpeedTrainEngine

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=24,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    parameters = len(list(model.parameters()))
    engine = DeepSpeedTrainEngine(model, lr=1e-4, total_steps=steps + 1, micro_batch_size=8,
                                  zero_stage=stage, dtype=dtype, grad_clip=1.0,
                                  grad_accum_dtype=grad_accum_dtype)
    ds = engine.ds_engine
    ids = torch.randint(0, config.vocab_size, (8, 64))
    forward_backward, update = [], []
    for i in range(steps):
        start = time.perf_counter()
        ds.backward(ds(input_ids=ids).logits.float().mean())
        middle = time.perf_counter()
        ds.step()
        end = time.perf_counter()
        if i >= WARMUP:
            forward_backward.append(middle - start)
            update.append(end - middle)
    backward_ops, backward_waits = launches(
        lambda: ds.backward(ds(input_ids=ids).logits.float().mean()))
    step_ops, step_waits = launches(ds.step)
    return (f"ZeRO-{stage} {dtype}, gradients in {engine.grad_accum_dtype}:"
            f" {type(ds.optimizer).__name__} over {parameters}"
            f" parameters; forward+backward {statistics.median(forward_backward) * 1e3:.1f} ms,"
            f" {backward_ops} ops, {backward_waits} waits; step"
            f" {statistics.median(update) * 1e3:.1f} ms, {step_ops} ops, {step_waits} waits"
            f" (medians of {steps - WARMUP})")


# oppo-train with the built-in tiny models 24 layers deep, in a process of its own
TRAINER = """
import sys
import oppo_ds.models as models
tiny_config = models.tiny_config
models.tiny_config = lambda arch, vocab, **kw: tiny_config(arch, vocab, **{**kw, "num_layers": 24})
from oppo_ds.cli.train import entry
sys.argv = ["oppo-train"] + sys.argv[1:]
entry()
"""
TRAINER_SETTINGS = ["workload.kind=length_oracle", "model.builtin_arch=tiny-qwen2",
                    "system.dtype=bf16", "generation.max_new_tokens=32", "workload.median_len=8",
                    "ppo.batch_size=16", "ppo.mini_batch_size=4", "ppo.micro_batch_size=4",
                    "logging.progress=false", "checkpoint.resume=never", "checkpoint.final=false",
                    "checkpoint.export_hf=false", "eval.prompts=null", "oppo.placement=inline"]


def trainer(steps: int) -> None:
    import json
    import tempfile

    for stage in (0, 1, 0, 1):
        with tempfile.TemporaryDirectory() as out:
            done = subprocess.run([sys.executable, "-c", TRAINER, f"steps={steps + 1}",
                                   f"system.zero_stage={stage}", f"logging.output_dir={out}",
                                   *TRAINER_SETTINGS], capture_output=True, text=True)
            if done.returncode != 0:
                print(f"ZeRO-{stage}: failed ({done.returncode}): {done.stderr[-800:]}")
                continue
            rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        train = [r["time/phase/train"] for r in rows if "time/phase/train" in r][1:]
        print(f"oppo-train, bf16 ZeRO-{stage}: training phase median "
              f"{statistics.median(train):.3f} s over {len(train)} steps "
              f"({', '.join(f'{t:.3f}' for t in train)})", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "trainer":
        trainer(int(sys.argv[2]) if len(sys.argv) > 2 else 5)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(measure(int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])), flush=True)
        return
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    if steps <= WARMUP:
        sys.exit(f"STEPS must exceed the {WARMUP} warm-up updates, got {steps}")
    for stage, dtype, grad_accum_dtype in CONFIGS:
        out = subprocess.run([sys.executable, __file__, "--one", str(stage), dtype,
                              grad_accum_dtype, str(steps)], capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("ZeRO-")]
        print(lines[-1] if out.returncode == 0 and lines else
              f"ZeRO-{stage} {dtype}: failed ({out.returncode}): {out.stderr[-500:]}")


if __name__ == "__main__":
    main()
