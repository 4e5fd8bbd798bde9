"""What the stage's critic weights cost with two actor ranks: not a test (pytest does not
collect it), the measurement behind docs/benchmarks.md ("One critic copy per update").

    .venv/bin/python tests/bench_stage_weights.py every one none

Three processes over gloo as the trainer lays them out (``spawn_stage``): actor ranks 0 and 1
and the scorer rank, which holds a reward model and the critic's copy, both a 104M-parameter
Llama value model in fp32 (416 MB). Four rounds; in each both actor ranks change the critic
alike (an "update"), then

- ``every``: both send the weights (the protocol before 2026-11-24: the stage loads the first
  copy and drains the second),
- ``one``: rank 0 sends them, rank 1 names the version (``await_weights``),
- ``none``: nothing is sent after round 0 (the rollout alone),

and each runs a rollout of 4 rows, 6 tokens in two chunks. Printed: per round the time from a
barrier of the actor ranks to both holding their results (the slower rank), and the median of
rounds 2-4 (round 1 warms up).
"""
from __future__ import annotations

import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _builders import left_padded_prompts, spawn_stage  # noqa: E402

VOCAB = 1000
ROUNDS = 4


def _critic():
    from transformers import LlamaConfig

    from oppo_ds.models import ValueHeadModel
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8)
    torch.manual_seed(3)
    return ValueHeadModel.from_config(config).eval()


def _worker(rank, _layout, links, out, mode):
    import torch.distributed as dist

    from oppo_ds.rollout.stage import RemoteScorers, ScorerStage, StageWeights, serve_round
    from oppo_ds.rollout.streaming import StreamingScorer
    critic = _critic()
    timeout = timedelta(seconds=300)
    if rank == 2:
        weights = StageWeights(critic)
        stages = [ScorerStage([StreamingScorer(_critic(), "reward"),
                               StreamingScorer(weights.model, "critic")], links[a],
                              timeout=timeout, weights=weights) for a in (0, 1)]
        while stages[0].stopped_by is None:
            serve_round(stages)
        return
    ids, mask = left_padded_prompts([3, 5, 4, 6], VOCAB, 0, 1 + rank)
    rows, three = torch.arange(4), torch.full((4,), 3)
    tokens = torch.randint(3, VOCAB, (4, 6), generator=torch.Generator().manual_seed(rank))
    remote = RemoteScorers(links[rank], timeout=timeout)
    times = []
    for round_ in range(ROUNDS):
        with torch.no_grad():
            for p in critic.parameters():
                p.add_(1e-3)
        dist.barrier()
        start = time.perf_counter()
        if mode == "none" and round_ > 0:
            remote.await_weights(version=0)
        elif rank == 0 or mode == "every":
            remote.send_weights(critic, version=round_)
        else:
            remote.await_weights(version=round_)
        remote.begin(ids, mask)
        remote.chunk("0", rows, tokens[:, :3], three, torch.zeros(0, dtype=torch.long))
        remote.chunk("1", rows, tokens[:, 3:], three, rows)
        remote.results()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(took.item())
    remote.close()
    if rank == 0:
        out.put(("times", sum(p.numel() for p in critic.parameters()), times))


def main(modes):
    for mode in modes:
        for kind, params, times in spawn_stage(_worker, 2, mode, join_s=900,
                                               link_timeout_s=300):
            if kind == "times":
                print(f"{mode}: {params / 1e6:.0f}M parameters, rounds "
                      f"{' '.join(f'{t:.3f}' for t in times)} s, median of rounds 2-{ROUNDS} "
                      f"{statistics.median(times[1:]):.3f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["every", "one", "none"])
