"""Tier 0/2: the length-oracle workload: real model shapes from config (parameter counts of
the published models), target lengths that end decoding, and a whole PPO run on it."""
import statistics

import pytest
import torch

from _builders import left_padded_prompts, random_lm

from oppo_ds import workload as wl
from oppo_ds.models import SHAPES, shape_config
from oppo_ds.rollout.generate import SamplingParams, decode_steps, start_decode

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.mark.parametrize("arch, billions", [("qwen2.5-0.5b", 0.494), ("qwen2.5-1.5b", 1.544),
                                            ("qwen2.5-7b", 7.616)])
def test_shapes_have_the_published_parameter_counts(arch, billions):
    """Built on the meta device (no memory): the counts of Qwen2.5's model cards (0.49B,
    1.54B, 7.61B, embeddings included)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(arch))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.002)
    assert set(SHAPES) == {"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"}


def test_targets_end_rows_at_their_length():
    model = random_lm("tiny-llama", 64, seed=0)
    ids, mask = left_padded_prompts([3, 5, 2, 4], 64, 0)
    params = SamplingParams(max_new_tokens=12, eos_token_ids=(), pad_token_id=0)
    targets = torch.tensor([1, 7, 12, 30])  # 30 is past max_new_tokens: ends at 12
    state = start_decode(model, ids, mask, params, targets=targets)
    decode_steps(model, state, params, torch.Generator().manual_seed(0))
    assert state.lengths.tolist() == [1, 7, 12, 12]
    assert state.finish_order[0] == 0 and state.finish_order[1] == 1


def test_oracle_prompts_and_tokenizer():
    prompts = wl.oracle_prompts(2000, vocab_size=500, seed=3, median_len=16, tail_sigma=0.9,
                                max_new_tokens=192)
    targets = [p.target_len for p in prompts]
    assert all(1 <= t <= 192 for t in targets)
    assert statistics.median(targets) == pytest.approx(16, abs=2)
    # p99 / median = exp(2.33 sigma) = 8.1 for sigma 0.9 (less the clip at 192)
    p99 = sorted(targets)[int(0.99 * len(targets))]
    assert 5.5 < p99 / statistics.median(targets) < 11
    assert all(p.input_ids[0] == wl.BOS_ID and max(p.input_ids) < 500 for p in prompts)
    assert wl.oracle_prompts(5, 500, 3, 16, 0.9, 192)[0] == prompts[0]  # seeded
    tok = wl.build_oracle_tokenizer(1000)
    assert len(tok) == 1000 and tok.pad_token_id == 0 and tok.eos_token_id == wl.EOS_ID


SMALL = ["workload.kind=length_oracle", "model.builtin_arch=tiny-qwen2", "workload.num_prompts=64",
         "generation.max_new_tokens=24", "ppo.batch_size=8", "ppo.mini_batch_size=4",
         "ppo.micro_batch_size=4", "logging.progress=false", "logging.log_every=0",
         "checkpoint.export_hf=false", "steps=2"]


@pytest.mark.parametrize("extra", [[], ["oppo.streaming=true", "oppo.overcommit=4"]])
def test_ppo_on_the_length_oracle(tmp_path, extra):
    """Models from config with random weights train on random prompts, and every response
    ends exactly at its prompt's target length (sequential), or each trained one does (with
    the pool and streaming)."""
    from oppo_ds.config import load_config
    from oppo_ds.data import PromptStream
    from oppo_ds.telemetry import read_history
    from oppo_ds.trainer import PPOTrainer

    cfg = load_config(None, SMALL + [f"logging.output_dir={tmp_path}", *extra])
    trainer = PPOTrainer(cfg)
    assert len(trainer.tokenizer) == wl.ORACLE_TINY_VOCAB and trainer.sampling.eos_token_ids == ()
    assert not (tmp_path / "workload").exists()  # nothing prepared, nothing cached
    targets = {p.id: p.target_len for p in trainer.prompts}
    trained = []
    if trainer.pool is not None:
        real_take = trainer.pool.take

        def take(*args, **kwargs):
            batch = real_take(*args, **kwargs)
            trained.extend((e.key, len(e.tokens)) for e in batch)
            return batch
        trainer.pool.take = take
    trainer.train()
    history = read_history(str(tmp_path / "metrics.jsonl"))
    assert len(history) == 2 and all("gold/mean" not in r for r in history)
    if trainer.pool is None:
        stream = PromptStream(trainer.prompts, 8, cfg.seed, 0, 1, shuffle=cfg.data.shuffle)
        for row in history:
            assert row["response/lengths"] == [targets[p.id] for p in stream.next_batch()]
    else:
        assert len(trained) == 16 and all(n == targets[key] for key, n in trained)
