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
    # top_p 0 would cut every token (the likeliest too): refused, as the trainer's config does
    for top_p in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="top_p must lie in"):
            engine.generate(request, SamplingConfig(max_new_tokens=4, top_p=top_p))
    engine.sync_weights(3)
    assert engine.weights_step == 3 and not actor.training


def _zero3_ranks_end_apart(rank, world, out):
    """A ZeRO-3 actor on two ranks whose responses end at different steps (at 5 and 30
    tokens): each rank records its forwards, its tokens, and the same decode by an HF model
    holding the same weights whole."""
    import os

    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    os.environ.setdefault("LOCAL_RANK", "0")
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    whole = LlamaForCausalLM(config)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = LlamaForCausalLM(config)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        model.load_state_dict(whole.state_dict())
    engine, *_ = deepspeed.initialize(model=model, config=ds,
                                      model_parameters=model.parameters())
    calls = [0]
    engine.module.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=15)
    rollout = OppoRolloutEngine(engine, tokenizer, chunk_size=4)
    prompt = torch.tensor([[7, 8, 9]]) if rank == 0 else torch.tensor([[11, 12, 13]])
    request = RolloutRequest(prompt_ids=prompt, prompt_attention_mask=torch.ones_like(prompt))
    # ended apart: at another step on each rank (as at each rank's own EOS)
    sampling = SamplingConfig(max_new_tokens=5 if rank == 0 else 30, temperature=0.0)
    batch = rollout.generate(request, sampling)
    alone = OppoRolloutEngine(whole, tokenizer, chunk_size=4).generate(request, sampling)
    out.put((rank, calls[0], batch.input_ids.tolist(), alone.input_ids.tolist()))


def test_zero3_ranks_whose_responses_end_apart_decode_without_collectives():
    """Under ZeRO-3 each forward all-gathers the layers: ranks whose responses end at
    different steps make different numbers of forwards, and their collectives paired up
    wrong until both timed out (a review reproduced it). The engine decodes on the gathered
    weights, hooks off, as oppo-train's rollout does: each rank's tokens are those of the
    whole model decoding alone."""
    from _builders import spawn_gloo

    results = sorted(spawn_gloo(_zero3_ranks_end_apart, 2, join_s=240, group_timeout_s=60))
    (_, calls0, ids0, alone0), (_, calls1, ids1, alone1) = results
    assert ids0 == alone0 and ids1 == alone1
    assert calls0 != calls1  # the ranks' decodes did end apart
