"""What ``ppo.micro_batch_tokens`` changes in the PPO update's forwards and backwards: not a
test (pytest does not collect it), the measurement behind docs/memory.md ("Micro-batches sized
by tokens").

    .venv/bin/python tests/bench_micro_batches.py [ARCH] [LAYERS] [ROWS] [PASSES]

ARCH: ``tiny-llama`` (the built-in workload's shape) or a real shape of
``oppo_ds.models.SHAPES`` (default ``qwen2.5-0.5b``) cut to LAYERS layers (default 4) with a
vocabulary of 4096, random weights, fp32. One mini-batch of ROWS rows (default 32) of the
built-in workload's lengths: prompts of 8-32 tokens, responses log-normal around 16 tokens
(sigma 0.9, at most 192). Its actor log-probs and the backward of their masked sum, split as the
update splits it (each micro-batch trimmed to its own widths): 2 rows each (what a budget of 2
sequences of the longest, 2 x 224 positions, allows with a fixed size), 8 rows each, and
micro-batches of at most 448 positions padded and packed. Per split: the forwards, the positions
they computed, the largest forward, and the seconds of the whole mini-batch (median of PASSES
passes, default 3, the splits taking turns)."""
import random
import sys
import time

import torch

from bench_packing import bench_model, micro_batch
from oppo_ds.experience import response_logprobs, used_widths
from oppo_ds.micro_batches import forward_tokens, split_by_tokens

BUDGET = 2 * (32 + 192)  # two sequences of the longest


def trimmed(batch, rows):
    prompt_ids, prompt_mask, response_ids, response_mask = (t[rows] for t in batch)
    p, r = used_widths(prompt_mask, response_mask)
    return prompt_ids[:, -p:], prompt_mask[:, -p:], response_ids[:, :r], response_mask[:, :r]


def main() -> None:
    arch = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-0.5b"
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    passes = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    model, config = bench_model(arch, layers)
    batch = micro_batch(random.Random(0), config.vocab_size, rows)
    prompts, responses = batch[1].sum(1).tolist(), batch[3].long().sum(1).tolist()
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    splits = {"2 rows": (list(order.split(2)), False), "8 rows": (list(order.split(8)), False)}
    for packed in (False, True):
        groups = split_by_tokens(prompts, responses, BUDGET, packed)
        splits[f"{BUDGET} positions{', packed' if packed else ''}"] = (
            [torch.tensor(g) for g in groups], packed)
    print(f"{arch}, {config.num_hidden_layers} layers, a mini-batch of {rows} rows "
          f"(responses {min(responses)}-{max(responses)} tokens, median "
          f"{sorted(responses)[rows // 2]}); medians of {passes} passes")
    times: dict[str, list[float]] = {name: [] for name in splits}
    for _ in range(passes):
        for name, (groups, packed) in splits.items():
            start = time.perf_counter()
            for g in groups:
                part = trimmed(batch, g)
                logprobs, _ = response_logprobs(model, *part, 1.0, packed=packed)
                (logprobs * part[3]).sum().backward()
            times[name].append(time.perf_counter() - start)
    for name, (groups, packed) in splits.items():
        costs = [forward_tokens([prompts[i] for i in g.tolist()],
                                [responses[i] for i in g.tolist()], packed) for g in groups]
        print(f"{name}: {len(groups)} forwards, {sum(costs)} positions, largest {max(costs)}; "
              f"{sorted(times[name])[passes // 2]:.2f} s ("
              + ", ".join(f"{t:.2f}" for t in times[name]) + ")")


if __name__ == "__main__":
    main()
