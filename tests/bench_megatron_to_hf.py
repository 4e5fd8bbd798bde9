"""What the stage placement's Megatron critic costs in host work before every rollout: not a
test (pytest does not collect it), the measurement behind docs/megatron.md.

    .venv/bin/python tests/bench_megatron_to_hf.py

One process, a world of one over gloo (tp = pp = 1, so no gather: only the host-side work
every step repeats): a 0.89B-parameter Llama value model in bf16 (1.78 GB) built as a
Megatron critic, then three times ``megatron_state`` (this rank's tensors), ``state_to_hf``
(the HF layout: the fused QKV and gate/up weights split), ``hf_model`` (the HF model around
them, no initialisation), and ``MegatronModel.to_hf`` (all three, what the trainer calls).
Prints each time and the median.
"""
from __future__ import annotations

import os
import statistics
import time

import torch


def main() -> None:
    import torch.distributed as dist
    from transformers import LlamaConfig
    from transformers.initialization import no_init_weights

    from oppo_ds.megatron.model import build_model, hf_model, state_to_hf
    from oppo_ds.megatron.parallel import init_model_parallel
    from oppo_ds.models import ValueHeadModel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    groups = init_model_parallel(1, 1)
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16)
    with no_init_weights():
        value = ValueHeadModel.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in value.parameters():
            p.normal_(0, 0.02)
    params = sum(p.numel() for p in value.parameters())
    critic = build_model(value, groups, "value", dtype=torch.bfloat16, device=torch.device("cpu"))
    del value
    print(f"{params / 1e9:.2f}B parameters, {params * 2 / 1e9:.2f} GB in bf16", flush=True)
    times: dict[str, list[float]] = {"megatron_state": [], "state_to_hf": [], "hf_model": [],
                                     "to_hf": []}
    for _ in range(3):
        t0 = time.perf_counter()
        mine = critic.megatron_state()
        t1 = time.perf_counter()
        state = state_to_hf([[mine]], critic.shape, critic.kind)
        t2 = time.perf_counter()
        model = hf_model(critic.config, state, critic.kind, critic.shape.tied)
        t3 = time.perf_counter()
        del model, state, mine
        t4 = time.perf_counter()
        model = critic.to_hf()
        t5 = time.perf_counter()
        del model
        for key, took in zip(times, (t1 - t0, t2 - t1, t3 - t2, t5 - t4)):
            times[key].append(took)
    for key, values in times.items():
        print(f"{key}: {' '.join(f'{v:.3f}' for v in values)} s, median "
              f"{statistics.median(values):.3f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
