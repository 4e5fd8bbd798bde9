"""What ``oppo-train --evaluate`` saves by loading the actor's weights alone: not a test
(pytest does not collect it), the measurement behind docs/benchmarks.md ("An evaluation reads
the weights alone").

    .venv/bin/python tests/bench_evaluate_load.py [ROUNDS]

One process, a DeepSpeed engine (ZeRO-2, fp32, AdamW) on a 104M-parameter Llama language model
(VOCAB 1000, 8 layers of width 1024), one update so that Adam's moments exist, saved. Then, per
round, a fresh engine loads the checkpoint in full (what ``--evaluate`` did before
2026-11-27) and another its weights alone (``weights_only=True``), in alternating order, each
after dropping the page cache when this process may (root; said in the output), so that each
load reads its bytes from the disk. Printed: the checkpoint's files and sizes, each load's
seconds and the medians.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

VOCAB = 1000


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8)
    torch.manual_seed(3)
    return LlamaForCausalLM(config)


def _engine():
    from oppo_ds.engines.deepspeed_engine import DeepSpeedTrainEngine
    return DeepSpeedTrainEngine(_model(), lr=1e-4, total_steps=10, micro_batch_size=2,
                                gradient_accumulation_steps=1, zero_stage=2, offload=False,
                                dtype="fp32", grad_clip=1.0, seed=0)


def _drop_page_cache() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        engine = _engine()
        ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))

        def lm_loss(model, batch):
            return model(input_ids=batch, labels=batch).loss, {}
        engine.train_step([ids], lm_loss)
        engine.save(root, tag="step1")
        engine.close()
        for path in sorted(Path(root, "step1").iterdir()):
            print(f"{path.name}: {path.stat().st_size / 2**20:.0f} MiB")
        times = {"full": [], "weights": []}
        dropped = True
        for r in range(rounds):
            for kind in (("full", "weights") if r % 2 == 0 else ("weights", "full")):
                fresh = _engine()
                dropped &= _drop_page_cache()
                start = time.perf_counter()
                fresh.load(root, "step1", weights_only=kind == "weights")
                times[kind].append(time.perf_counter() - start)
                fresh.close()
                print(f"round {r + 1} {kind:7s} {times[kind][-1]:.2f} s")
        print(f"page cache dropped before each load: {'yes' if dropped else 'no (not root)'}")
        for kind, seconds in times.items():
            print(f"median {kind:7s} {statistics.median(seconds):.2f} s over {rounds}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
