"""Tier 0: the Experience batch: trimming a micro-batch to the columns it uses keeps every
score and every real token."""
import pytest
import torch

from _builders import left_padded_prompts, random_lm

from oppo_ds.experience import (Experience, response_logprobs, response_token_logprobs,
                                used_widths)

pytestmark = pytest.mark.usefixtures("torch_one_thread")

VOCAB, PAD = 40, 0


def _experience():
    # rows 1 and 2 form a micro-batch with prompts of 2-3 tokens and responses of 1-2, inside
    # a batch padded to prompts of 6 and responses of 5
    prompt_ids, prompt_mask = left_padded_prompts([6, 3, 2], VOCAB, PAD)
    lengths = torch.tensor([5, 2, 1])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).float()
    response_ids = torch.where(mask.bool(), torch.randint(3, VOCAB, (3, 5), generator=torch.Generator().manual_seed(0)), PAD)
    per_token = torch.arange(15, dtype=torch.float32).reshape(3, 5) * mask
    return Experience(prompt_keys=["a", "b", "c"], prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                      response_ids=response_ids, response_mask=mask, behaviour_logprobs=-per_token,
                      old_logprobs=-per_token, ref_logprobs=-per_token, old_values=per_token,
                      scores=torch.tensor([1.0, 2.0, 3.0]), gold=None, advantages=per_token)


def test_trimmed_keeps_real_tokens_and_drops_shared_padding():
    exp = _experience()
    assert used_widths(exp.prompt_mask, exp.response_mask) == (6, 5)
    micro = exp.select(torch.tensor([1, 2])).trimmed()
    assert micro.prompt_ids.shape == (2, 3) and micro.response_ids.shape == (2, 2)
    assert micro.prompt_mask.sum().item() == 5 and micro.response_mask.sum().item() == 3
    assert micro.old_values.tolist() == [[5.0, 6.0], [10.0, 0.0]]
    assert micro.advantages.shape == (2, 2) and micro.scores.tolist() == [2.0, 3.0]
    assert micro.prompt_keys == ["b", "c"] and micro.gold is None


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gpt2"])
def test_trimmed_scores_equal_padded_scores(arch):
    """Log-probs of the trimmed micro-batch equal those of the padded one within 1e-5, the
    streaming tests' bound: only the number of masked columns in the attention sums differs
    (measured 1.4e-6 on log-probs of magnitude ~6, 2e-7 relative)."""
    model = random_lm(arch, VOCAB, seed=1)
    micro = _experience().select(torch.tensor([1, 2]))
    trimmed = micro.trimmed()
    with torch.no_grad():
        padded, _ = response_logprobs(model, micro.prompt_ids, micro.prompt_mask,
                                      micro.response_ids, micro.response_mask, 1.0)
        short, _ = response_logprobs(model, trimmed.prompt_ids, trimmed.prompt_mask,
                                     trimmed.response_ids, trimmed.response_mask, 1.0)
    real = trimmed.response_mask.bool()
    torch.testing.assert_close(short[real], padded[:, :2][real], atol=1e-5, rtol=0)


def test_policy_log_probs_upcast_before_the_temperature_in_every_path():
    """The decode's log-probs (old, when the actor streams), the update's and the reference's
    are log-softmax of fp32(logits) / T, from one rule (``algo.policy_logits``): the same bf16
    logits give the same log-probs bit for bit in every path. Dividing in bf16 first rounds the
    quotient again; on these logits that moves a log-prob by more than 1e-3, which the last
    assertion shows (so the rule is not a no-op this test could not tell from the old one)."""
    from oppo_ds.algo import logprobs_from_logits, policy_logits
    from oppo_ds.rollout.generate import SamplingParams, sample_tokens
    from oppo_ds.rollout.scorer import StreamingScorer

    temperature = 0.7
    model = random_lm("tiny-llama", VOCAB, seed=0).to(torch.bfloat16)
    prompt_ids, prompt_mask = left_padded_prompts([4, 2, 3], VOCAB, PAD)
    response_ids = torch.randint(3, VOCAB, (3, 4), generator=torch.Generator().manual_seed(1))
    response_mask = torch.ones(3, 4)
    with torch.no_grad():
        logprobs, scaled = response_logprobs(model, prompt_ids, prompt_mask, response_ids,
                                             response_mask, temperature)
    assert scaled.dtype == torch.float32
    # the logits the update read, unscaled again, are the model's bf16 ones (fp32 holds a
    # bf16 number and its quotient with room to spare: the round trip is exact)
    raw = (scaled * temperature).to(torch.bfloat16)
    assert torch.equal(logprobs, logprobs_from_logits(policy_logits(raw, temperature), response_ids))
    # the decode's draw from those logits reports the same log-probs
    params = SamplingParams(max_new_tokens=4, eos_token_ids=(), pad_token_id=PAD,
                            temperature=temperature)
    flat = raw.reshape(-1, VOCAB)
    tokens, drawn = sample_tokens(flat, params, None, uniforms=torch.rand(flat.shape[0]))
    assert torch.equal(drawn, logprobs_from_logits(policy_logits(flat, temperature)[:, None],
                                                   tokens[:, None])[:, 0])
    # the reference scorer's per-token rule is the same
    scorer = StreamingScorer(model, "reference", temperature=temperature)
    # (the outputs before the chunk's first token, then the chunk's own: the last is unread)
    chunk = torch.cat([raw[:, 1:], raw[:, :1]], dim=1)
    assert torch.equal(scorer._per_token(raw[:, 0], chunk, response_ids), logprobs)
    # and the scoring forwards', which take the fp32 copies a block of rows at a time
    assert torch.equal(response_token_logprobs(model, prompt_ids, prompt_mask, response_ids,
                                               response_mask, temperature), logprobs)
    rounded = logprobs_from_logits((raw / temperature).float(), response_ids)
    assert (rounded - logprobs).abs().max() > 1e-3


class _EveryPosition(torch.nn.Module):
    """The model without ``logits_to_keep`` in its forward: it returns every position's."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gpt2"])
def test_scoring_forwards_keep_the_response_positions_logits_only(arch):
    """The update's and the scoring forwards' log-probs ask the model for the last T + 1
    positions' logits (the prompts' are never made: (B, P, V) at a real vocabulary), and
    equal those read from every position's within 1e-6 (fp32; the LM head's matmul runs on
    fewer rows, which may round differently)."""
    model = random_lm(arch, VOCAB, seed=0)
    prompt_ids, prompt_mask = left_padded_prompts([4, 2, 3], VOCAB, PAD)
    response_ids = torch.randint(3, VOCAB, (3, 5), generator=torch.Generator().manual_seed(1))
    response_mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0]])
    widths = []
    hook = model.register_forward_hook(lambda m, a, out: widths.append(out.logits.shape[1]))
    args = (prompt_ids, prompt_mask, response_ids, response_mask, 0.7)
    try:
        with torch.no_grad():
            kept, _ = response_logprobs(model, *args)
            scored = response_token_logprobs(model, *args)
            every = response_token_logprobs(_EveryPosition(model), *args)
    finally:
        hook.remove()
    assert widths == [6, 6, 4 + 5]
    assert torch.equal(kept, scored)
    torch.testing.assert_close(scored, every, atol=1e-6, rtol=0)
