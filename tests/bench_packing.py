"""What ``system.packing_samples`` saves in the PPO update's forward and backward: not a test
(pytest does not collect it), the measurement behind docs/memory.md ("Packed sequences").

    .venv/bin/python tests/bench_packing.py [ARCH] [LAYERS] [BATCHES]

ARCH: ``tiny-llama`` (the built-in workload's shape; default) or a real shape of
``oppo_ds.models.SHAPES`` (``qwen2.5-0.5b``) cut to LAYERS layers (default 4) with a vocabulary
of 4096, random weights, fp32. BATCHES micro-batches (default 8) of 8 rows each, as the
built-in workload draws them: prompts of 8-32 tokens left-padded to 32, responses of the
workload's long-tailed lengths (log-normal, median 16, sigma 0.9, at most 192) right-padded to
the micro-batch's longest. Each micro-batch's actor log-probs (``response_logprobs``) and the
backward of their masked sum, padded and then packed, twice in turn: the medians over the
micro-batches of each pass, and the tokens the forwards hold (padded rows, packed rows, real
tokens)."""
import math
import random
import sys
import time

import torch

from oppo_ds.experience import packed_inputs, response_logprobs
from oppo_ds.models import disable_dropout, shape_config, tiny_config

ROWS, PROMPT, RESPONSE = 8, 32, 192


def micro_batch(rng: random.Random, vocab: int, rows: int = ROWS):
    """(prompt ids, prompt mask, response ids, response mask) of ``rows`` rows of the built-in
    workload's lengths: prompts left-padded to 32, responses right-padded to their longest."""
    prompts = [rng.randint(8, PROMPT) for _ in range(rows)]
    responses = [min(RESPONSE, max(1, int(16 * math.exp(0.9 * rng.gauss(0, 1)))))
                 for _ in range(rows)]
    width = max(responses)
    prompt_mask = torch.zeros(rows, PROMPT, dtype=torch.long)
    response_mask = torch.zeros(rows, width)
    for i in range(rows):
        prompt_mask[i, PROMPT - prompts[i]:] = 1
        response_mask[i, :responses[i]] = 1
    prompt_ids = torch.randint(3, vocab, (rows, PROMPT)) * prompt_mask
    response_ids = torch.randint(3, vocab, (rows, width)) * response_mask.long()
    return prompt_ids, prompt_mask, response_ids, response_mask


def bench_model(arch: str, layers: int):
    """(model, config): ``arch``'s causal LM with random weights (seed 0), fp32: a tiny-*
    built-in shape, or a real one cut to ``layers`` layers with a vocabulary of 4096."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if arch.startswith("tiny"):
        config = tiny_config(arch, 512)
    else:
        config = shape_config(arch, 4096)
        config.num_hidden_layers = layers
    return disable_dropout(AutoModelForCausalLM.from_config(config)), config


def main() -> None:
    arch = sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    model, config = bench_model(arch, layers)
    rng = random.Random(0)
    batches = [micro_batch(rng, config.vocab_size) for _ in range(count)]
    padded = sum(ROWS * (b[0].shape[1] + b[2].shape[1]) for b in batches)
    packed = sum(packed_inputs(*b)[0]["input_ids"].numel() for b in batches)
    real = sum(int(b[1].sum() + b[3].sum()) for b in batches)
    print(f"{arch}, {config.num_hidden_layers} layers, {count} micro-batches of {ROWS} rows; "
          f"tokens: padded {padded}, packed rows {packed} ({packed / padded:.2f}), "
          f"real {real} ({real / padded:.2f})")
    times: dict[str, list[float]] = {"padded": [], "packed": []}
    for name in ("padded", "packed", "padded", "packed"):
        passes = []
        for batch in batches:
            start = time.perf_counter()
            logprobs, _ = response_logprobs(model, *batch, 1.0, packed=name == "packed")
            (logprobs * batch[3]).sum().backward()
            passes.append(time.perf_counter() - start)
        times[name].append(sorted(passes)[len(passes) // 2])
    for name, medians in times.items():
        print(f"{name}: forward + backward, median per micro-batch: "
              + ", ".join(f"{1000 * t:.1f} ms" for t in medians))


if __name__ == "__main__":
    main()
