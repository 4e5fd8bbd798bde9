"""How many weights ZeRO-3 keeps gathered through a training step, against ``oppo-plan``'s rule
(the largest module's weights and gradients): not a test (pytest does not collect it), the
measurement behind docs/memory.md's "What ZeRO-3 keeps gathered".

    .venv/bin/python tests/bench_zero3_gathered.py REUSE LIVE PREFETCH

One process over gloo, DeepSpeed's own ZeRO-3 engine (AdamW) on a tiny Llama (8 layers, width
128, a vocabulary of 8192, untied head: the LM head is its largest module, as in Llama-3 8B
and 70B), the persistence threshold at 0 so that every parameter is partitioned. REUSE, LIVE
and PREFETCH are ``stage3_max_reuse_distance``, ``stage3_max_live_parameters`` and
``stage3_prefetch_bucket_size`` in parameters; scale them by the model, as 1e9 / 3e7 / 3e7 are
to Llama-3 8B (LM head 0.525e9 parameters): about 2e6 / 6e4 / 6e4 here. Printed: the most
parameters DeepSpeed's coordinator held gathered at once in the third training step (its
trace of the step complete), read after each of its fetches, beside the LM head's and the
whole model's. Parameters are counted, not bytes, so a CPU measures what a GPU would hold.
"""
from __future__ import annotations

import json
import os
import sys

import torch


def main(reuse: int, live: int, prefetch: int) -> dict:
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import deepspeed
    from deepspeed.runtime.zero.partitioned_param_coordinator import \
        PartitionedParameterCoordinator as Coordinator
    from transformers import LlamaConfig, LlamaForCausalLM

    peak = [0]
    fetch = Coordinator.fetch_sub_module

    def counted(self, *args, **kwargs):
        out = fetch(self, *args, **kwargs)
        peak[0] = max(peak[0], self._PartitionedParameterCoordinator__n_available_params)
        return out

    Coordinator.fetch_sub_module = counted
    deepspeed.init_distributed("gloo")
    cfg = LlamaConfig(vocab_size=8192, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
                      tie_word_embeddings=False)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "stage3_max_live_parameters": live,
                                "stage3_prefetch_bucket_size": prefetch,
                                "stage3_max_reuse_distance": reuse}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = LlamaForCausalLM(cfg)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    for _ in range(3):
        peak[0] = 0
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return {"reuse": reuse, "live": live, "prefetch": prefetch, "peak_gathered": peak[0],
            "lm_head": cfg.vocab_size * cfg.hidden_size,
            "model": sum(p.ds_numel for p in model.parameters())}


if __name__ == "__main__":
    print(json.dumps(main(*(int(float(x)) for x in sys.argv[1:4]))))
