"""What ``oppo-train --evaluate`` saves by building and loading the actor for its weights alone:
not a test (pytest does not collect it), the measurement behind docs/benchmarks.md ("An
evaluation reads the weights alone" and its "The actor's engine holds its weights alone").

    .venv/bin/python tests/bench_evaluate_load.py [ROUNDS] [ZERO_STAGE]

A DeepSpeed engine (ZeRO-2 unless ZERO_STAGE says otherwise, fp32, AdamW) on a 104M-parameter
Llama language model (VOCAB 1000, 8 layers of width 1024) makes one update, so that Adam's
moments exist, and is saved.
Then, per round, three fresh processes each build an engine and load the checkpoint, in
rotating order, each after dropping the page cache when it may (root; said in the output), so
that each load reads its bytes from the disk:

* ``full``: the training engine, loaded in full (what ``--evaluate`` did first);
* ``weights``: the training engine, its weights alone (``load(weights_only=True)``, what it
  did next; under ZeRO-3 the full load again);
* ``alone``: an engine built for the weights alone (``weights_only=True``: no optimizer, what
  it builds now), loaded.

Printed: the checkpoint's files and sizes; per process the load's seconds and the process's
peak resident memory (build and load: the model, DeepSpeed's buffers and, where built, the
optimizer's fp32 partition and Adam's moments); the medians.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

VOCAB = 1000
KINDS = ("full", "weights", "alone")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8)
    torch.manual_seed(3)
    return LlamaForCausalLM(config)


def _engine(stage: int, weights_only: bool = False):
    from oppo_ds.engines.deepspeed_engine import DeepSpeedTrainEngine
    return DeepSpeedTrainEngine(_model(), lr=1e-4, total_steps=10, micro_batch_size=2,
                                gradient_accumulation_steps=1, zero_stage=stage, offload=False,
                                dtype="fp32", grad_clip=1.0, seed=0, weights_only=weights_only)


def _drop_page_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _peak_resident_mib() -> float:
    """This process's peak resident memory (``VmHWM``: its own address space's; getrusage's
    ``ru_maxrss`` would carry the parent's peak into a child over fork and exec)."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib / 2**10


def _one(kind: str, root: str, stage: int) -> None:
    """In its own process: build the engine ``kind`` needs, load, print a JSON line."""
    engine = _engine(stage, weights_only=kind == "alone")
    dropped = _drop_page_cache()
    start = time.perf_counter()
    engine.load(root, "step1", weights_only=kind != "full")
    seconds = time.perf_counter() - start
    peak = _peak_resident_mib()
    print(json.dumps({"seconds": seconds, "peak_mib": peak, "dropped": dropped}), flush=True)
    engine.close()


def main(rounds: int, stage: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        engine = _engine(stage)
        ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))

        def lm_loss(model, batch):
            return model(input_ids=batch, labels=batch).loss, {}
        engine.train_step([ids], lm_loss)
        engine.save(root, tag="step1")
        engine.close()
        for path in sorted(Path(root, "step1").iterdir()):
            print(f"{path.name}: {path.stat().st_size / 2**20:.0f} MiB")
        found = {kind: [] for kind in KINDS}
        dropped = True
        for r in range(rounds):
            for kind in KINDS[r % 3:] + KINDS[:r % 3]:
                proc = subprocess.run([sys.executable, __file__, "--one", kind, root, str(stage)],
                                      capture_output=True, text=True, check=True)
                line = json.loads(proc.stdout.strip().splitlines()[-1])
                found[kind].append(line)
                dropped &= line["dropped"]
                print(f"round {r + 1} {kind:7s} load {line['seconds']:.2f} s, "
                      f"peak {line['peak_mib']:.0f} MiB")
        print(f"page cache dropped before each load: {'yes' if dropped else 'no (not root)'}")
        for kind, lines in found.items():
            print(f"median {kind:7s} load {statistics.median(x['seconds'] for x in lines):.2f} s, "
                  f"peak {statistics.median(x['peak_mib'] for x in lines):.0f} MiB "
                  f"over {rounds}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        _one(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 3,
             int(sys.argv[2]) if len(sys.argv) > 2 else 2)
