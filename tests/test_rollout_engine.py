"""OppoRolloutEngine against DeepSpeed's own rollout interface (deepspeed.runtime.rollout):
its dataclasses, and DeepSpeed's HybridEngineRollout on the same model as the reference."""
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.rollout import (HybridEngineRollout, RolloutBatch, RolloutEngine,
                                       RolloutRequest, SamplingConfig)

from oppo_ds.algo import logprobs_from_logits
from oppo_ds.integrations.rollout_engine import OppoRolloutEngine
from oppo_ds.models import build_value_model
from oppo_ds.rollout.generate import position_ids_from_mask

from _builders import left_padded_prompts, random_lm, sharpen

VOCAB, PAD, EOS = 24, 0, 2
TOKENIZER = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)


@pytest.fixture(scope="module")
def models(torch_one_thread):
    actor = random_lm("tiny-llama", VOCAB, seed=4)
    reference = random_lm("tiny-llama", VOCAB, seed=4)
    reward = sharpen(build_value_model("tiny-llama", vocab_size=VOCAB, seed=0), seed=5)
    critic = sharpen(build_value_model("tiny-llama", vocab_size=VOCAB, seed=0), seed=6)
    return actor, reference, reward, critic


def never_pad(model):
    """Like a trained model, never sample the pad token (its logit far below the others)."""
    with torch.no_grad():
        model.get_output_embeddings().weight[PAD] = 0.0
    return model


def request_of(lens, seed=1):
    ids, mask = left_padded_prompts(lens, VOCAB, PAD, seed=seed)
    return RolloutRequest(prompt_ids=ids, prompt_attention_mask=mask)


def test_greedy_batch_equals_deepspeeds_hybrid_engine_rollout(models):
    """Same tokens, mask and response start as DeepSpeed's reference engine (which decodes
    to max_new_tokens ignoring EOS, then pads after it): ours stops at the longest
    response, so its batch is theirs cut to that width, with nothing but padding cut."""
    actor, *_ = models
    request, sampling = request_of([3, 7, 5, 2]), SamplingConfig(max_new_tokens=12, temperature=0.0)
    ours = OppoRolloutEngine(actor, TOKENIZER, chunk_size=4).generate(request, sampling)
    reference = HybridEngineRollout(SimpleNamespace(module=actor), TOKENIZER)
    theirs = reference.generate(request, sampling)
    assert isinstance(ours, RolloutBatch)
    width = ours.seq_len
    assert torch.equal(ours.input_ids, theirs.input_ids[:, :width])
    assert torch.equal(ours.attention_mask, theirs.attention_mask[:, :width])
    assert not theirs.attention_mask[:, width:].any()
    assert torch.equal(ours.response_start_idx, theirs.response_start_idx)
    response = ours.input_ids[:, request.prompt_ids.shape[1]:]
    assert (response == EOS).any(1).any(), "the test needs a row that ends at EOS"
    assert (response == PAD).logical_and(ours.attention_mask[:, 7:].bool()).sum() == 0


def test_the_static_cache_gives_the_same_batch_and_scores(models, monkeypatch):
    """``static_cache=True`` (the actor's decode at one shape): the same sampled batch and
    streamed scores as the default decode (fp32; scores within 1e-5)."""
    from oppo_ds.rollout import static_decode

    monkeypatch.setattr(static_decode, "_KEEP_WITHOUT_GRAPH", True)  # to see them used
    actor, reference, reward, critic = models
    request = request_of([3, 7, 5, 2, 6])
    sampling = SamplingConfig(max_new_tokens=10, temperature=1.0)
    out = {}
    for static in (False, True):
        engine = OppoRolloutEngine(actor, TOKENIZER, reward=reward, reference=reference,
                                   critic=critic, chunk_size=3, seed=7, static_cache=static)
        out[static] = engine.generate_with_scores(request, sampling)
    (batch, scores), (static_batch, static_scores) = out[False], out[True]
    assert static_decode._KEPT[actor].batch == 5  # the static engine decoded in its buffers
    assert torch.equal(static_batch.input_ids, batch.input_ids)
    assert torch.equal(static_batch.attention_mask, batch.attention_mask)
    assert set(static_scores) == set(scores) == {"reward", "reference", "critic"}
    for kind in scores:
        torch.testing.assert_close(static_scores[kind], scores[kind], atol=1e-5, rtol=0)


def test_streamed_scores_beside_the_batch_equal_whole_sequence_scoring(models):
    _, reference, reward, critic = models
    actor = never_pad(random_lm("tiny-llama", VOCAB, seed=4))
    engine = OppoRolloutEngine(actor, TOKENIZER, reward=reward, reference=reference,
                               critic=critic, chunk_size=3, seed=7)
    request = request_of([4, 6, 3])
    batch, scores = engine.generate_with_scores(request, SamplingConfig(max_new_tokens=10))
    assert engine.last_scores is scores and set(scores) == {"reward", "reference", "critic"}
    ids, mask = batch.input_ids, batch.attention_mask
    start = int(batch.response_start_idx[0])
    response_mask = mask[:, start:].float()
    assert not (ids[:, start:] == PAD).logical_and(mask[:, start:].bool()).any()
    positions = position_ids_from_mask(mask)
    with torch.no_grad():
        values = reward(ids, attention_mask=mask, position_ids=positions).values
        last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # each row's last real column
        torch.testing.assert_close(scores["reward"], values[torch.arange(len(ids)), last],
                                   atol=1e-5, rtol=0)
        logits = reference(ids, attention_mask=mask, position_ids=positions).logits
        whole = logprobs_from_logits(logits[:, start - 1:-1], ids[:, start:]) * response_mask
        torch.testing.assert_close(scores["reference"], whole, atol=1e-5, rtol=0)
        v = critic(ids, attention_mask=mask, position_ids=positions).values[:, start - 1:-1]
        torch.testing.assert_close(scores["critic"], v * response_mask, atol=1e-5, rtol=0)
    assert engine.last_timing.chunks >= 2


def test_interface_rules(models):
    actor, *_ = models
    engine = OppoRolloutEngine(actor, TOKENIZER, chunk_size=2, seed=3)
    assert isinstance(engine, RolloutEngine) and engine.name == "oppo"
    assert engine.host_timed == []  # an HF module has no DeepSpeed timer to quiet
    request = request_of([2, 5])
    batch = engine.generate(request, SamplingConfig(max_new_tokens=6, temperature=0.7, top_k=5,
                                                    n_samples_per_prompt=3))
    assert batch.batch_size == 6 and (batch.response_start_idx == 5).all()
    assert torch.equal(batch.input_ids[:3, :5], request.prompt_ids[[0, 0, 0]])
    assert torch.equal(batch.attention_mask[3:, :5], request.prompt_attention_mask[[1, 1, 1]])
    assert batch.seq_len <= 5 + 6
    with pytest.raises(NotImplementedError, match="continuous_batch_size"):
        engine.generate(request, SamplingConfig(max_new_tokens=4, continuous_batch_size=2))
    engine.sync_weights(3)
    assert engine.weights_step == 3 and not actor.training
