"""Tier 0-1: packed sequences (``system.packing_samples``). A micro-batch's sequences packed
into one row, without padding, give the padded batch's log-probs, values, scores and
gradients; a model whose attention lets packed sequences see each other is refused; a run
with packing trains as one without."""
import json
import os

import pytest
import torch

from _builders import left_padded_prompts, random_lm, sharpen, tiny_run_overrides

from oppo_ds.config import ConfigError, load_config
from oppo_ds.experience import (packed_inputs, packing_problem, response_logprobs,
                                response_values, sequence_scores)
from oppo_ds.models import build_value_model, disable_dropout

pytestmark = pytest.mark.usefixtures("torch_one_thread")

VOCAB, PAD = 40, 0
ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-gpt2"]
ATOL = 1e-5  # fp32, the streaming tests' bound: only the order of sums differs


def _batch():
    """Four rows: prompts of 6, 3, 2 and 5 tokens left-padded to 6, responses of 5, 2, 1 and 4
    right-padded to 5 (each row has padding on one side or both)."""
    prompt_ids, prompt_mask = left_padded_prompts([6, 3, 2, 5], VOCAB, PAD, seed=4)
    lengths = torch.tensor([5, 2, 1, 4])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).float()
    drawn = torch.randint(3, VOCAB, (4, 5), generator=torch.Generator().manual_seed(5))
    return prompt_ids, prompt_mask, torch.where(mask.bool(), drawn, PAD), mask


def test_packed_inputs_hold_the_real_tokens_in_rows_as_wide_as_the_longest():
    prompt_ids, prompt_mask, response_ids, response_mask = _batch()
    inputs, index = packed_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    rows = [torch.cat([p[m.bool()], r[k.bool()]])
            for p, m, r, k in zip(prompt_ids, prompt_mask, response_ids, response_mask)]
    # sequences of 11, 5, 3 and 9 tokens: first-fit, longest first, into rows of 11:
    # [11], [9], [5, 3, and 3 of padding]
    assert [len(r) for r in rows] == [11, 5, 3, 9]
    ids, positions = inputs["input_ids"], inputs["position_ids"]
    assert ids.shape == positions.shape == (3, 11)
    assert ids[0].tolist() == rows[0].tolist() and ids[1, :9].tolist() == rows[3].tolist()
    assert ids[2, :8].tolist() == rows[1].tolist() + rows[2].tolist()
    assert positions.tolist() == [list(range(11)), list(range(9)) + [0, 1],
                                  list(range(5)) + list(range(3)) + list(range(3))]
    assert inputs["use_cache"] is False and "attention_mask" not in inputs
    # a real column's packed position holds its token
    full = torch.cat([prompt_ids, response_ids], 1)
    real = torch.cat([prompt_mask, response_mask.long()], 1).bool()
    assert torch.equal(ids.flatten()[index[real]], full[real])
    with pytest.raises(ValueError, match="no rows to pack"):
        packed_inputs(prompt_ids[:0], prompt_mask[:0], response_ids[:0], response_mask[:0])
    with pytest.raises(ValueError, match="not one run"):
        holed = prompt_mask.clone()
        holed[0, 2] = 0
        packed_inputs(prompt_ids, holed, response_ids, response_mask)


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_outputs_equal_the_padded_batchs(arch):
    """Log-probs (and the logits under them), per-token values and last-token scores of the
    packed row equal the padded batch's on every real response token within 1e-5."""
    batch = _batch()
    real = batch[3].bool()
    lm = random_lm(arch, VOCAB, seed=1)
    value = sharpen(build_value_model(arch, vocab_size=VOCAB, seed=2), seed=12)
    with torch.no_grad():
        padded, padded_logits = response_logprobs(lm, *batch, 0.7)
        packed, packed_logits = response_logprobs(lm, *batch, 0.7, packed=True)
        torch.testing.assert_close(packed[real], padded[real], atol=ATOL, rtol=0)
        # the logits within 1e-5 + 1e-5 relative (they reach ~10 with these weights)
        torch.testing.assert_close(packed_logits[real], padded_logits[real], atol=ATOL,
                                   rtol=1e-5)
        torch.testing.assert_close(response_values(value, *batch, packed=True)[real],
                                   response_values(value, *batch)[real], atol=ATOL, rtol=0)
        scores = sequence_scores(value, *batch)
        assert float(scores.std()) > 0.01  # scores that differ by context, not a constant
        torch.testing.assert_close(sequence_scores(value, *batch, packed=True), scores,
                                   atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_gradients_equal_the_padded_batchs(arch):
    """The gradient of a masked log-prob loss and of a masked value loss: every weight's
    within 1e-5 of its largest entry."""
    batch = _batch()
    mask = batch[3]
    grads = []
    for packed in (False, True):
        # in training mode with dropout off, as the trainer builds its models
        lm = disable_dropout(random_lm(arch, VOCAB, seed=1)).train()
        value = disable_dropout(sharpen(build_value_model(arch, vocab_size=VOCAB, seed=2),
                                        seed=12)).train()
        logprobs, _ = response_logprobs(lm, *batch, 1.0, packed=packed)
        values = response_values(value, *batch, packed=packed)
        ((logprobs * mask).sum() + (values.pow(2) * mask).sum()).backward()
        grads.append({**{"lm." + k: p.grad for k, p in lm.named_parameters()},
                      **{"value." + k: p.grad for k, p in value.named_parameters()}})
    for key, want in grads[0].items():
        scale = float(want.abs().max())
        assert scale > 0, key
        assert float((grads[1][key] - want).abs().max()) <= 1e-5 * max(scale, 1.0), key


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gpt2"])
def test_packed_bf16_is_as_close_to_fp32_as_the_padded_batch(arch):
    """In bf16 the packed and padded forwards round differently (other shapes), so they are
    compared with fp32: the packed log-probs are no further from fp32's than the padded ones
    are, within a factor 2 (measured: both about 0.02-0.05 on log-probs of magnitude ~4, the
    rounding of bf16's 8-bit mantissa through two layers)."""
    batch = _batch()
    real = batch[3].bool()
    lm = random_lm(arch, VOCAB, seed=1)
    with torch.no_grad():
        exact, _ = response_logprobs(lm, *batch, 1.0)
        lm = lm.to(torch.bfloat16)
        padded, _ = response_logprobs(lm, *batch, 1.0)
        packed, _ = response_logprobs(lm, *batch, 1.0, packed=True)
    padded_error = float((padded - exact)[real].abs().max())
    packed_error = float((packed - exact)[real].abs().max())
    assert 0 < padded_error < 0.2
    assert packed_error <= 2 * padded_error, (packed_error, padded_error)


class _OneMask(torch.nn.Module):
    """A model that gives packed inputs an attention mask of ones: the row is then one
    sequence, each token attending to every earlier one, the other sequences' included."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, position_ids=None, **kwargs):
        return self.lm(input_ids=input_ids, position_ids=position_ids,
                       attention_mask=torch.ones_like(input_ids), **kwargs)


class _OwnPositions(torch.nn.Module):
    """A model that keeps packed sequences apart (a block-diagonal causal mask of its own)
    but numbers the positions through the row, ignoring ``position_ids``."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, position_ids, **kwargs):
        from oppo_ds.megatron.model import _packed_mask, packed_segments

        mask = _packed_mask(packed_segments(position_ids))
        own = torch.arange(input_ids.shape[1])[None]
        return self.lm(input_ids=input_ids, position_ids=own, attention_mask=mask, **kwargs)


class _OneRowOnly(torch.nn.Module):
    """A model that tells packed sequences apart in a batch of one row only, as transformers'
    flash-attention-2 path does (``_is_packed_sequence``); several rows get plain causal
    attention, as ones for a mask gives."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, position_ids=None, **kwargs):
        mask = None if input_ids.shape[0] == 1 else torch.ones_like(input_ids)
        return self.lm(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                       **kwargs)


def test_a_model_that_does_not_keep_packed_sequences_apart_is_found():
    gpt2 = random_lm("tiny-gpt2", VOCAB, seed=1)  # absolute positions: each one shows

    def logits(model):
        return lambda inputs: model(**inputs).logits

    cpu = torch.device("cpu")
    with torch.no_grad():
        for arch in ARCHS:
            assert packing_problem(logits(random_lm(arch, VOCAB, seed=1)), VOCAB, cpu,
                                   half=False) is None, arch
        value = sharpen(build_value_model("tiny-llama", vocab_size=VOCAB, seed=2), seed=12)
        assert packing_problem(lambda i: value(**i).values, VOCAB, cpu, half=False) is None
        assert packing_problem(logits(_OneMask(gpt2)), VOCAB, cpu, half=False) == (
            "the tokens of one packed sequence changed the outputs of the next: its attention "
            "does not keep sequences apart by position_ids")
        assert packing_problem(logits(_OneRowOnly(gpt2)), VOCAB, cpu, half=True) == (
            "the tokens of one packed sequence changed the outputs of the next: its attention "
            "does not keep sequences apart by position_ids")
        assert packing_problem(logits(_OwnPositions(gpt2)), VOCAB, cpu, half=False) == (
            "a packed sequence's outputs changed with where it sits in the row: the model does "
            "not take its positions from position_ids")


def _run(root, *extra, steps=3):
    from oppo_ds.trainer import PPOTrainer

    cfg = load_config(None, [*tiny_run_overrides(root, steps), "logging.tensorboard=false",
                             *extra])
    trainer = PPOTrainer(cfg)
    trainer.train()
    with open(os.path.join(root, "run", "metrics.jsonl")) as f:
        return trainer, [json.loads(line) for line in f]


@pytest.mark.parametrize("extra", [(), ("oppo.streaming=true", "oppo.overcommit=2")],
                         ids=["sequential", "oppo"])
def test_a_run_with_packing_trains_as_one_without(tmp_path, extra):
    """Three PPO steps (tiny Llama actor and critic, micro-batches of 2) with and without
    packing: the same responses, and every loss, reward, KL and value metric within 1e-4 of
    each other (fp32; the updates move the weights by rounding-sized amounts apart)."""
    _, plain = _run(tmp_path / "plain", *extra)
    trainer, packed = _run(tmp_path / "packed", "system.packing_samples=true", *extra)
    assert trainer.cfg.system.packing_samples
    assert [m["step"] for m in packed] == [m["step"] for m in plain] == [1, 2, 3]
    compared = 0
    for want, got in zip(plain, packed):
        assert got["response/lengths"] == want["response/lengths"]
        for key, value in want.items():
            # timings: the streaming scorers' busy time, the share of it hidden, ...
            if key.startswith(("time/", "stream/")) or not isinstance(value, float):
                continue
            assert got[key] == pytest.approx(value, abs=1e-4, rel=1e-4), key
            compared += 1
    assert compared > 30


_ONE_MASK_CODE = """import torch
from transformers import LlamaModel


class OneMaskModel(LlamaModel):
    \"\"\"A Llama body that fills in an attention mask of ones where none is given: packed
    sequences then attend to each other.\"\"\"

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        if attention_mask is None and input_ids is not None:
            attention_mask = torch.ones_like(input_ids)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
"""


def test_packing_is_refused_for_a_model_that_does_not_take_it(tmp_path):
    """A reward model with code of its own (``auto_map``, trust_remote_code) whose body gives
    packed rows a mask of ones: the start's check names the model and the key, before the
    first step."""
    from _builders import tiny_reward_dir

    reward = tiny_reward_dir(tmp_path)
    with open(os.path.join(reward, "onemask.py"), "w") as f:
        f.write(_ONE_MASK_CODE)
    with open(os.path.join(reward, "config.json")) as f:
        config = json.load(f)
    config["auto_map"] = {"AutoModel": "onemask.OneMaskModel"}
    with open(os.path.join(reward, "config.json"), "w") as f:
        json.dump(config, f)
    common = ("model.critic=tiny-llama", "model.trust_remote_code=true")
    _run(tmp_path, *common, steps=1)  # without packing the model runs
    with pytest.raises(ConfigError) as err:
        _run(tmp_path, *common, "system.packing_samples=true", "checkpoint.resume=never",
             steps=1)
    assert str(err.value) == (
        "system.packing_samples: model.reward: the tokens of one packed sequence changed the "
        "outputs of the next: its attention does not keep sequences apart by position_ids; "
        "set system.packing_samples: false for this model")
