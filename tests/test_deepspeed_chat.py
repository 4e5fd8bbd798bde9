"""DeepSpeed-Chat step 3's experience contract, produced by OPPO's rollout.

DeepSpeed-Chat is not installed here: the reference below restates, from reading
``dschat/rlhf/ppo_trainer.py`` and ``dschat/utils/model/reward_model.py`` (DeepSpeedExamples
3d83278), what its ``generate_experience``, ``compute_rewards`` and GAE do with a finished
``seq``; the models are real tiny HF models inside real DeepSpeed engines, the reward and
critic in a module with the same interface as its ``RewardModel``.
"""
import argparse
import os
from types import SimpleNamespace

import deepspeed
import pytest
import torch
import transformers
from torch import nn

from oppo_ds.engines import init_distributed_if_needed
from oppo_ds.integrations.deepspeed_chat import (OppoExperience, add_arguments, enable_oppo,
                                                 gather_log_probs)

KEYS = ("prompts", "logprobs", "ref_logprobs", "value", "rewards", "input_ids", "attention_mask")
_RENDEZVOUS_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


@pytest.fixture(scope="module", autouse=True)
def distributed(torch_one_thread):
    before = {key: os.environ.get(key) for key in _RENDEZVOUS_KEYS}
    init_distributed_if_needed()
    yield
    assert {key: os.environ.get(key) for key in _RENDEZVOUS_KEYS} == before


class RewardModel(nn.Module):
    """DeepSpeed-Chat's reward/critic interface: ``rwtransformer`` (an HF base model),
    ``v_head``, and ``forward_value`` whose end score is the value just before the first pad
    of the answer (the whole sequence when it has none)."""

    def __init__(self, base, pad_id: int):
        super().__init__()
        self.config = base.config
        width = getattr(base.config, "word_embed_proj_dim", base.config.hidden_size)
        self.v_head = nn.Linear(width, 1, bias=False)
        self.rwtransformer = base
        self.PAD_ID = pad_id

    def forward_value(self, input_ids=None, attention_mask=None, past_key_values=None,
                      return_value_only=False, prompt_length=0, use_cache=False):
        hidden = self.rwtransformer(input_ids, attention_mask=attention_mask,
                                    past_key_values=past_key_values, use_cache=use_cache)[0]
        values = self.v_head(hidden).squeeze(-1)
        if return_value_only:
            return values
        ends = []
        for row in input_ids:
            pads = (row[prompt_length:] == self.PAD_ID).nonzero()
            ends.append(int(pads[0]) + prompt_length if len(pads) else input_ids.shape[1])
        scores = torch.stack([values[i, end - 1] for i, end in enumerate(ends)])
        return {"values": values, "chosen_end_scores": scores}


def _config(arch: str, vocab: int):
    if arch == "opt":  # DeepSpeed-Chat's OPT: pad = eos = bos (its tokenizer pads with EOS)
        return transformers.OPTConfig(vocab_size=vocab, hidden_size=32, word_embed_proj_dim=32,
                                      ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                      max_position_embeddings=128, dropout=0.0,
                                      attention_dropout=0.0, activation_dropout=0.0,
                                      pad_token_id=2, bos_token_id=2, eos_token_id=2)
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=128,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _sharpen(model, seed: int, scale: float = 0.4):
    """Weights far from the init scale, so that outputs depend on the context (a wrong mask
    or position then shows as ~0.1, not ~1e-7)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


_BUILT: list = []  # the engines a test's _engine calls started, destroyed after it


@pytest.fixture(autouse=True)
def destroy_built_engines():
    """DeepSpeed keeps an engine after the last reference to it (a ZeRO-3 one: 1.9 GB of
    private memory): these tests start theirs as DeepSpeed-Chat does, past oppo_ds's record of
    open engines (tests/conftest.py), so they are destroyed here."""
    yield
    while _BUILT:
        _BUILT.pop().destroy()


def _engine(model, train: bool, stage: int = 0):
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if train else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    _BUILT.append(engine)
    return engine


def build_engines(arch: str, vocab: int = 24, stage: int = 0):
    """Actor, reference (same weights), critic and reward (same weights, as DeepSpeed-Chat
    initialises both from the step-2 checkpoint) in DeepSpeed engines, and a tokenizer."""
    config = _config(arch, vocab)
    torch.manual_seed(0)
    actor = _sharpen(transformers.AutoModelForCausalLM.from_config(config), seed=1)
    if config.pad_token_id != config.eos_token_id:
        with torch.no_grad():  # like a trained model, never emit the pad DeepSpeed-Chat adds
            actor.get_output_embeddings().weight[config.pad_token_id] = 0.0
    ref = transformers.AutoModelForCausalLM.from_config(config)
    ref.load_state_dict(actor.state_dict())
    critic = RewardModel(transformers.AutoModel.from_config(config), config.pad_token_id)
    critic = _sharpen(critic, seed=2)
    reward = RewardModel(transformers.AutoModel.from_config(config), config.pad_token_id)
    reward.load_state_dict(critic.state_dict())
    tokenizer = SimpleNamespace(pad_token_id=config.pad_token_id, eos_token_id=config.eos_token_id)
    return (_engine(actor, True, stage), _engine(ref, False, stage),
            _engine(critic, True, stage), _engine(reward, False, stage), tokenizer)


def collated_prompts(lengths, vocab: int, pad: int, width: int, bos=None, seed: int = 0):
    """What DeepSpeed-Chat's DataCollatorRLHF yields: prompts left-padded to ``width`` with
    the pad id, mask 1 on every tokenizer token (BOS included)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        row = torch.randint(3, vocab, (n,), generator=g)
        if bos is not None:
            row[0] = bos
        ids[i, width - n:], mask[i, width - n:] = row, 1
    return ids, mask


@torch.no_grad()
def reference_experience(actor, ref, critic, reward, prompts, seq, pad, fp32_loss=False):
    """DeepSpeed-Chat's generate_experience after generation, on the same ``seq``."""
    attention_mask = seq.ne(pad).long()
    logits = actor(seq, attention_mask=attention_mask).logits
    logits_ref = ref(seq, attention_mask=attention_mask).logits
    if fp32_loss:
        logits, logits_ref = logits.float(), logits_ref.float()
    rewards = reward.forward_value(seq, attention_mask,
                                   prompt_length=prompts.shape[1])["chosen_end_scores"]
    values = critic.forward_value(seq, attention_mask, return_value_only=True)[:, :-1]
    return {"prompts": prompts, "logprobs": gather_log_probs(logits[:, :-1], seq[:, 1:]),
            "ref_logprobs": gather_log_probs(logits_ref[:, :-1], seq[:, 1:]),
            "value": values, "rewards": rewards, "input_ids": seq,
            "attention_mask": attention_mask}


def dschat_advantages(exp, kl_ctl=0.1, clip=5.0, gamma=1.0, lam=0.95):
    """compute_rewards + the zeroing after ``ends`` + GAE of train_rlhf: what the trainer
    makes of an experience (a loop, as DeepSpeed-Chat writes it)."""
    prompts, lp, ref_lp = exp["prompts"], exp["logprobs"].float(), exp["ref_logprobs"].float()
    values = exp["value"].float().clone()
    start = prompts.shape[1] - 1
    action_mask = exp["attention_mask"][:, 1:]
    ends = start + action_mask[:, start:].sum(1) + 1
    rewards = -kl_ctl * (lp - ref_lp)
    for j in range(len(rewards)):
        rewards[j, start:ends[j]][-1] += exp["rewards"][j].float().clamp(-clip, clip)
        rewards[j, ends[j]:] = 0
        values[j, ends[j]:] = 0
    last, out = 0.0, []
    length = rewards.shape[1]
    for t in reversed(range(start, length)):
        nxt = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * nxt - values[:, t]
        last = delta + gamma * lam * last
        out.append(last)
    advantages = torch.stack(out[::-1], dim=1)
    return advantages, advantages + values[:, start:], ends


def assert_contract(exp, ref, pad):
    """Same keys, shapes and dtypes; equal where DeepSpeed-Chat's trainer reads."""
    assert tuple(exp) == KEYS
    for key in KEYS:
        assert exp[key].shape == ref[key].shape, key
        assert exp[key].dtype == ref[key].dtype, key
    for key in ("prompts", "input_ids", "attention_mask"):
        assert torch.equal(exp[key], ref[key]), key
    torch.testing.assert_close(exp["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)
    torch.testing.assert_close(exp["rewards"], ref["rewards"], atol=1e-5, rtol=0)
    start = exp["prompts"].shape[1] - 1
    ends = start + exp["attention_mask"][:, 1:][:, start:].sum(1) + 1
    for i, end in enumerate(ends.tolist()):
        for key in ("ref_logprobs", "value"):
            torch.testing.assert_close(exp[key][i, start:end], ref[key][i, start:end],
                                       atol=1e-5, rtol=0, msg=f"{key} row {i}")
            assert not exp[key][i, :start].any() and not exp[key][i, end:].any(), key
    adv, ret, _ = dschat_advantages(exp)
    adv_ref, ret_ref, _ = dschat_advantages(ref)
    torch.testing.assert_close(adv, adv_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, ret_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_size, sync_every, static", [(1, 1, False), (3, 1, False),
                                                              (3, 2, False), (3, 1, True)])
def test_opt_streamed_experience_equals_dschat_generate_experience(chunk_size, sync_every, static,
                                                                   monkeypatch):
    """OPT (pad = eos = bos, DeepSpeed-Chat's main family), greedy as its generation config
    says, no overcommitment: the same sequences HF generate makes, and every field as
    DeepSpeed-Chat computes it whole-sequence; also decoding in blocks of 2
    (--oppo_sync_every) and at one shape (--oppo_static_cache)."""
    vocab, width, answer = 24, 8, 10
    actor, ref, critic, reward, tok = build_engines("opt", vocab)
    prompts, mask = collated_prompts([3, 8, 5, 6], vocab, tok.pad_token_id, width, bos=2)
    from oppo_ds.rollout import static_decode

    monkeypatch.setattr(static_decode, "_KEEP_WITHOUT_GRAPH", True)  # to see them used below
    oppo = OppoExperience(actor, ref, critic, reward, tok, max_answer_seq_len=answer,
                          chunk_size=chunk_size, overcommit=0, sync_every=sync_every,
                          static_cache=static)
    exp = oppo.generate_experience(prompts, mask, step=0)
    with torch.no_grad():
        hf = actor.module.generate(prompts, attention_mask=mask, max_length=width + answer,
                                   pad_token_id=tok.pad_token_id)
    keep = (hf[:, width:] != tok.pad_token_id).sum(1) > 1  # DeepSpeed-Chat drops the others
    assert int(keep.sum()) >= 2, "the test needs rows with real answers"
    assert torch.equal(exp["input_ids"], hf[keep])
    ref_exp = reference_experience(actor, ref, critic, reward, prompts[keep], hf[keep],
                                   tok.pad_token_id)
    assert_contract(exp, ref_exp, tok.pad_token_id)
    assert actor.module.training and critic.module.training  # as DeepSpeed-Chat leaves them
    assert not ref.module.training and not reward.module.training
    assert oppo.stats["scoring_hidden_frac"] > 0  # scoring happened between decode chunks
    if static:  # the actor decoded in the static buffers
        assert static_decode._KEPT[actor.module].batch == len(prompts)
    else:
        assert actor.module not in static_decode._KEPT


def test_the_rollout_runs_the_models_own_forward_not_the_hybrid_engines_eval(monkeypatch):
    """Stands in for a GPU-only path: under --enable_hybrid_engine, DeepSpeedHybridEngine.eval()
    (with kernel containers: a GPU and an architecture DeepSpeed injects) replaces each decoder
    layer's forward by DeepSpeed's inference layer, with a KV cache of its own that the chunked
    decoder's and the scorers' caches never reach; its train() swaps back and converts weights.
    generate_experience called engine.eval() on all four engines. Here each engine's eval and
    train are replaced by that swap's stand-in (every decoder layer then raises): the experience
    must come from the models' own forwards, with the modes DeepSpeed-Chat leaves."""
    vocab, width, answer = 24, 8, 6
    actor, ref, critic, reward, tok = build_engines("opt", vocab)
    swapped = []

    def injected(*_, **__):
        raise AssertionError("a decoder layer ran DeepSpeed's injected forward")

    def hybrid_eval(engine):
        swapped.append(engine)
        for layer in engine.module.modules():
            if type(layer).__name__.endswith("DecoderLayer"):
                layer.forward = injected

    for engine in (actor, ref, critic, reward):
        monkeypatch.setattr(engine, "eval", lambda engine=engine: hybrid_eval(engine))
        monkeypatch.setattr(engine, "train",
                            lambda mode=True, engine=engine: hybrid_eval(engine) if not mode
                            else swapped.append(("train", engine)))
    prompts, mask = collated_prompts([3, 8, 5, 6], vocab, tok.pad_token_id, width, bos=2)
    oppo = OppoExperience(actor, ref, critic, reward, tok, max_answer_seq_len=answer,
                          chunk_size=2, overcommit=0)
    exp = oppo.generate_experience(prompts, mask, step=0)
    assert swapped == []
    assert actor.module.training and critic.module.training  # as DeepSpeed-Chat leaves them
    assert not ref.module.training and not reward.module.training
    ref_exp = reference_experience(actor, ref, critic, reward, exp["prompts"], exp["input_ids"],
                                   tok.pad_token_id)
    assert_contract(exp, ref_exp, tok.pad_token_id)


@pytest.mark.parametrize("sync_every,static", [(1, False), (3, False), (1, True)])
def test_llama_overcommit_carries_sequences_and_keeps_the_contract(sync_every, static):
    """Llama (its own pad token, EOS kept in the mask), Delta = 2 over three calls of four
    prompts: the first call returns 2, the others 4, two sequences are always carried,
    no prompt is returned twice, and every experience equals DeepSpeed-Chat's scoring of
    the same sequences (streamed reward / reference / critic across the deferral, and
    whole-sequence scoring for rows whose streamed critic values went stale). Decoding in
    blocks of 3 (over chunks of 2) stops where the per-token loop stops; at one shape
    (--oppo_static_cache) every call's static cache has the one length that holds a deferred
    answer packed after its prompt."""
    from oppo_ds.rollout.static_length import run_cache_length

    vocab, width, answer = 16, 6, 10
    actor, ref, critic, reward, tok = build_engines("llama", vocab)
    oppo = OppoExperience(actor, ref, critic, reward, tok, max_answer_seq_len=answer,
                          chunk_size=2, overcommit=2, seed=3, sync_every=sync_every,
                          static_cache=static)
    given, returned = set(), []
    for step in range(3):
        prompts, mask = collated_prompts([2, 6, 4, 5], vocab, tok.pad_token_id, width, bos=1,
                                         seed=step)
        given |= {tuple(r[m.bool()].tolist()) for r, m in zip(prompts, mask)}
        exp = oppo.generate_experience(prompts, mask, step)
        assert oppo.stats["returned"] == (2 if step == 0 else 4)
        assert oppo.stats["deferred"] == 2
        reference = reference_experience(actor, ref, critic, reward, exp["prompts"],
                                         exp["input_ids"], tok.pad_token_id)
        assert_contract(exp, reference, tok.pad_token_id)
        rows = exp["prompts"]
        returned += [tuple(r[r != tok.pad_token_id].tolist()) for r in rows]
    assert len(returned) == len(set(returned)) and set(returned) <= given
    assert oppo.pool.ledger.trained and len(oppo.pool) == 2
    assert oppo.sampling.static_length == (
        run_cache_length(width, answer, sync_every, carries=True) if static else 0)


def test_more_overcommit_than_a_calls_prompts_is_refused():
    """Delta above the prompts of a call: more carried answers than a call returns could be
    due at once (max_defer_steps could not hold): the first call says so, naming the flag."""
    vocab, width = 16, 6
    actor, ref, critic, reward, tok = build_engines("llama", vocab)
    oppo = OppoExperience(actor, ref, critic, reward, tok, max_answer_seq_len=6, chunk_size=2,
                          overcommit=5)
    prompts, mask = collated_prompts([2, 6, 4, 5], vocab, tok.pad_token_id, width, bos=1)
    with pytest.raises(ValueError, match=r"--oppo_overcommit 5 is more than the 4 prompts .*"
                                         r"max_defer_steps \(2\).*use at most 4"):
        oppo.generate_experience(prompts, mask, 0)


def test_zero3_engines_on_one_rank():
    """DeepSpeed-Chat's large-model setting, ZeRO-3 (partitioned weights gathered layer by
    layer in every forward, the streamed chunks' included), on one rank: the same contract
    over two calls with Delta = 1."""
    vocab, width = 24, 8
    actor, ref, critic, reward, tok = build_engines("opt", vocab, stage=3)
    assert actor.zero_optimization_stage() == 3
    prompts, mask = collated_prompts([3, 8, 5, 6], vocab, tok.pad_token_id, width, bos=2)
    oppo = OppoExperience(actor, ref, critic, reward, tok, max_answer_seq_len=10, chunk_size=3,
                          overcommit=1)
    for step in range(2):
        exp = oppo.generate_experience(prompts, mask, step)
        assert_contract(exp, reference_experience(actor, ref, critic, reward, exp["prompts"],
                                                  exp["input_ids"], tok.pad_token_id),
                        tok.pad_token_id)
    assert oppo.stats["returned"] == 4 and oppo.stats["deferred"] == 1


def _zero3_rank(rank, world, out):
    """One rank of ``test_zero3_engines_on_two_ranks``: its own prompts, three calls."""
    vocab, width = 16, 6
    actor, ref, critic, reward, tok = build_engines("llama", vocab, stage=3)
    # a reference that streams only on rank 1 would leave rank 0 alone in ZeRO-3's gathers of
    # the reference's whole-sequence forward, were the decision not taken over both ranks
    oppo = OppoExperience(actor, ref, critic, reward, tok, max_answer_seq_len=10, chunk_size=2,
                          overcommit=1, stream_to=("critic",), seed=3)
    decoded = []
    for step in range(3):
        prompts, mask = collated_prompts([2, 6, 4, 5], vocab, tok.pad_token_id, width, bos=1,
                                         seed=10 * rank + step)
        exp = oppo.generate_experience(prompts, mask, step)
        assert_contract(exp, reference_experience(actor, ref, critic, reward, exp["prompts"],
                                                  exp["input_ids"], tok.pad_token_id),
                        tok.pad_token_id)
        decoded.append(oppo.stats["decoded_tokens"])
        # a training step of the actor and the critic between calls, as train_rlhf makes:
        # ZeRO-3's hooks, taken off for the rollout, must be back for forward and backward
        seq, attention_mask = exp["input_ids"], exp["attention_mask"]
        actor.backward(actor(seq, attention_mask=attention_mask).logits.float().square().mean())
        actor.step()
        critic.backward(critic.forward_value(seq, attention_mask,
                                             return_value_only=True).float().square().mean())
        critic.step()
    out.put(("decoded", rank, decoded))


def test_zero3_engines_on_two_ranks():
    """ZeRO-3 over 2 gloo ranks with different prompts: each rank's pool stops decoding at its
    own token and streams its own rows, so per-forward ZeRO-3 gathers would not pair up (a
    hang, or gloo's "collective mismatch"); the rollout gathers each model once for the call
    and runs it without ZeRO-3's hooks, and the experience still equals DeepSpeed-Chat's
    scoring of the same sequences (1e-5) on both ranks, with training steps between calls."""
    from _builders import spawn_gloo

    messages = spawn_gloo(_zero3_rank, 2, join_s=300)
    decoded = {m[1]: m[2] for m in messages if m[0] == "decoded"}
    assert sorted(decoded) == [0, 1]
    # the case that needs it: the ranks decoded different numbers of tokens in some call
    assert decoded[0] != decoded[1], decoded


def test_fp32_loss_and_whole_sequence_fallback_keep_dtypes():
    """bf16 models: DeepSpeed-Chat's dtypes (bf16 values and rewards, fp32 log-probs with
    compute_fp32_loss); reference and critic not streamed score whole sequences."""
    vocab, width, answer = 24, 6, 6
    actor, ref, critic, reward, tok = build_engines("opt", vocab)
    for engine in (actor, ref, critic, reward):
        engine.module.to(torch.bfloat16)
    prompts, mask = collated_prompts([3, 6, 5, 4], vocab, tok.pad_token_id, width, bos=2)
    oppo = OppoExperience(actor, ref, critic, reward, tok, max_answer_seq_len=answer,
                          chunk_size=2, stream_to=(), compute_fp32_loss=True)
    exp = oppo.generate_experience(prompts, mask, step=0)
    assert exp["logprobs"].dtype == exp["ref_logprobs"].dtype == torch.float32
    assert exp["value"].dtype == exp["rewards"].dtype == torch.bfloat16
    reference = reference_experience(actor, ref, critic, reward, exp["prompts"],
                                     exp["input_ids"], tok.pad_token_id, fp32_loss=True)
    start = width - 1
    ends = start + exp["attention_mask"][:, width:].sum(1) + 1
    for i, end in enumerate(ends.tolist()):
        torch.testing.assert_close(exp["value"][i, start:end], reference["value"][i, start:end])
        torch.testing.assert_close(exp["ref_logprobs"][i, start:end],
                                   reference["ref_logprobs"][i, start:end])
    torch.testing.assert_close(exp["rewards"], reference["rewards"])


def test_too_short_answers_reuse_the_last_experience():
    """DeepSpeed-Chat's rule: a call whose answers are all <= 1 token reuses the previous
    call's prompts and sequences (rescored); with none before, it is an error."""
    vocab, width = 24, 6
    actor, ref, critic, reward, tok = build_engines("opt", vocab)
    prompts, mask = collated_prompts([3, 6], vocab, tok.pad_token_id, width, bos=2)
    one = OppoExperience(actor, ref, critic, reward, tok, max_answer_seq_len=1, chunk_size=1)
    with pytest.raises(RuntimeError, match="too short"):
        one.generate_experience(prompts, mask, step=0)
    oppo = OppoExperience(actor, ref, critic, reward, tok, max_answer_seq_len=5, chunk_size=2)
    first = oppo.generate_experience(prompts, mask, step=0)
    oppo.sampling = one.sampling  # answers of one token from now on
    again = oppo.generate_experience(prompts, mask, step=1)
    assert torch.equal(again["input_ids"], first["input_ids"])
    torch.testing.assert_close(again["rewards"], first["rewards"], atol=1e-5, rtol=0)


def test_patch_entry_points_parse_and_replace_generate_experience():
    """The two calls the patch adds to step 3's main.py."""
    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--enable_oppo", "--oppo_chunk_size", "8",
                              "--oppo_overcommit", "auto", "--oppo_sync_every", "4"])
    assert (args.enable_oppo, args.oppo_chunk_size, args.oppo_overcommit,
            args.oppo_sync_every) == (True, 8, "auto", 4)
    assert parser.parse_args([]).oppo_chunk_size == "auto"
    assert parser.parse_args([]).oppo_sync_every == 1
    assert not parser.parse_args([]).oppo_static_cache and not parser.parse_args([]).oppo_cuda_graph
    assert not parser.parse_args([]).oppo_cudnn_attention
    assert parser.parse_args(["--oppo_cudnn_attention"]).oppo_cudnn_attention
    assert parser.parse_args(["--oppo_static_cache"]).oppo_static_cache
    for bad in (["--oppo_overcommit", "-1"], ["--oppo_sync_every", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    actor, ref, critic, reward, tok = build_engines("opt")
    trainer = SimpleNamespace(actor_model=actor, ref_model=ref, critic_model=critic,
                              reward_model=reward, tokenizer=tok, generate_time=0.0)
    args.max_answer_seq_len, args.seed = 4, 1
    assert enable_oppo(trainer, parser.parse_args([])) is None
    oppo = enable_oppo(trainer, args)
    assert trainer.generate_experience == oppo.generate_experience and trainer.oppo is oppo
    assert oppo.sampling.sync_every == 4 and not oppo.sampling.static_cache
    graph = parser.parse_args(["--enable_oppo", "--oppo_static_cache", "--oppo_cuda_graph"])
    graph.max_answer_seq_len, graph.seed = 4, 1
    with pytest.raises(ValueError, match="needs the actor on a CUDA device; it is on cpu"):
        enable_oppo(trainer, graph)
    prompts, mask = collated_prompts([3, 5, 4, 6], 24, tok.pad_token_id, 6, bos=2)
    for step in range(3):
        exp = trainer.generate_experience(prompts, mask, step)
        assert tuple(exp) == KEYS and trainer.generate_time > 0
    assert oppo.delta_ctl is not None and len(oppo.delta_ctl.rewards) == 3  # auto: observed
    assert oppo.stats["delta"] == oppo.delta_ctl.delta == 1  # B // 4, the start (delta_max)


def test_the_engines_throughput_timers_stop_synchronizing_the_device(monkeypatch):
    """DeepSpeed-Chat's engines keep DeepSpeed's default throughput timer, which synchronizes
    the device before every forward from the third optimizer step on (once a decode token).
    OPPO leaves the timer on, timed on the host: after three real training steps of the actor
    a forward synchronized once before ``enable_oppo`` and not at all after it (the calls are
    counted on the real accelerator; a no-op on a CPU, but called)."""
    from deepspeed.accelerator import get_accelerator

    actor, ref, critic, reward, tok = build_engines("llama")
    ids, _ = collated_prompts([5, 6, 4, 6], 24, tok.pad_token_id, 6)
    for _ in range(3):
        actor.backward(actor(input_ids=ids, labels=ids).loss)
        actor.step()
    accelerator = get_accelerator()
    calls = []
    synchronize = accelerator.synchronize
    monkeypatch.setattr(accelerator, "synchronize",
                        lambda *a, **k: (calls.append(1), synchronize(*a, **k))[1])

    def forward_syncs():
        calls.clear()
        with torch.no_grad():
            actor(input_ids=ids)
        return len(calls)

    assert forward_syncs() == 1
    args = add_arguments(argparse.ArgumentParser()).parse_args(["--enable_oppo"])
    args.max_answer_seq_len, args.seed = 4, 1
    trainer = SimpleNamespace(actor_model=actor, ref_model=ref, critic_model=critic,
                              reward_model=reward, tokenizer=tok, generate_time=0.0)
    oppo = enable_oppo(trainer, args)
    assert oppo.host_timed == ["actor", "ref", "critic", "reward"]
    assert forward_syncs() == 0
    assert actor.tput_timer.config.enabled  # still timing, on the host


@pytest.mark.parametrize("allowed", [False, True])
def test_the_experience_runs_off_cudnn_attention_unless_allowed(allowed):
    """--oppo_cudnn_attention off (the default): every forward of the actor, critic,
    reference and reward inside generate_experience (the rollout and the experience) runs
    with torch's cuDNN attention switched off (it plans every new shape); the switch is back
    after the call. Seen from forward hooks on the four models (on a CPU the switch, not a
    kernel). The critic's and reward's bodies (``rwtransformer``) are what OPPO runs."""
    actor, ref, critic, reward, tok = build_engines("llama")
    args = add_arguments(argparse.ArgumentParser()).parse_args(
        ["--enable_oppo"] + (["--oppo_cudnn_attention"] if allowed else []))
    args.max_answer_seq_len, args.seed = 4, 1
    trainer = SimpleNamespace(actor_model=actor, ref_model=ref, critic_model=critic,
                              reward_model=reward, tokenizer=tok, generate_time=0.0)
    enable_oppo(trainer, args)
    seen = {}
    for name, engine in (("actor", actor), ("ref", ref), ("critic", critic), ("reward", reward)):
        body = getattr(engine.module, "rwtransformer", engine.module)  # what OPPO calls
        body.register_forward_pre_hook(
            lambda *_, name=name: seen.setdefault(name, set()).add(
                torch.backends.cuda.cudnn_sdp_enabled()))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    prompts, mask = collated_prompts([3, 5, 4, 6], 24, tok.pad_token_id, 6)
    trainer.generate_experience(prompts, mask, 0)
    assert seen == {name: {allowed} for name in ("actor", "ref", "critic", "reward")}
    assert torch.backends.cuda.cudnn_sdp_enabled()


PATCH = os.path.join(os.path.dirname(__file__), os.pardir, "patches", "deepspeed-chat",
                     "step3-oppo.patch")
MAIN_PY = "applications/DeepSpeed-Chat/training/step3_rlhf_finetuning/main.py"
PINNED_BLOB = "1378dc4e6506b8d46a5645542795ee519e79eac2"  # main.py at DeepSpeedExamples 3d83278


def test_patch_is_three_added_lines_calling_this_module():
    """Without the checkout: the patch touches only step 3's main.py, removes nothing, and
    calls only what this module offers, against the pinned blob."""
    text = open(PATCH).read()
    assert text.count("diff --git") == 1 and f"a/{MAIN_PY} b/{MAIN_PY}" in text
    assert f"index {PINNED_BLOB[:7]}.." in text
    body = [line for line in text.splitlines() if not line.startswith(("---", "+++"))]
    added = [line[1:].strip() for line in body if line.startswith("+")]
    assert not [line for line in body if line.startswith("-")]
    assert added == ["from oppo_ds.integrations import deepspeed_chat as oppo",
                     "parser = oppo.add_arguments(parser)", "oppo.enable_oppo(trainer, args)"]


def test_patch_applies_to_the_pinned_main_py():
    """``git apply --check`` against a DeepSpeedExamples tree at 3d83278 (a git checkout or
    an extracted archive) named by OPPO_DSCHAT_ROOT; the file must be the pinned blob."""
    import shutil
    import subprocess

    root = os.environ.get("OPPO_DSCHAT_ROOT")
    if not root or not os.path.isfile(os.path.join(root, MAIN_PY)):
        pytest.skip("OPPO_DSCHAT_ROOT does not point at a DeepSpeedExamples tree (CI has no "
                    "network to fetch one; the local check is recorded in docs/deepspeed-chat.md)")
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    blob = subprocess.run(["git", "hash-object", os.path.join(root, MAIN_PY)], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert blob == PINNED_BLOB, f"{MAIN_PY} is not the file of commit 3d83278"
    proc = subprocess.run(["git", "apply", "--check", os.path.abspath(PATCH)], cwd=root,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_decoding_takes_the_actor_s_generation_config_as_hf_generate_does(caplog):
    """DeepSpeed-Chat's actor.module.generate(...) samples with the actor's generation config
    and transformers' defaults for what it leaves unset: a config of do_sample, temperature
    0.6 and top_p 0.95 samples from the top 50 (we took an unset top_k for off). Logits
    processors the chunked decode does not apply (Qwen2.5-Instruct's repetition_penalty
    1.05) are named in one warning; Llama is greedy (DeepSpeed-Chat forces it)."""
    from oppo_ds.integrations.deepspeed_chat import sampling_from_actor

    def actor(model_type, **settings):
        config = SimpleNamespace(model_type=model_type, eos_token_id=2)
        return SimpleNamespace(generation_config=transformers.GenerationConfig(**settings),
                               config=config)

    tokenizer = SimpleNamespace(pad_token_id=0)
    sampled = sampling_from_actor(actor("opt", do_sample=True, temperature=0.6, top_p=0.95),
                                  tokenizer, 32)
    assert (sampled.temperature, sampled.top_k, sampled.top_p) == (0.6, 50, 0.95)
    assert sampled.eos_token_ids == (2, 0) and sampled.max_new_tokens == 32
    own = sampling_from_actor(actor("qwen2", do_sample=True, top_k=20, top_p=0.8,
                                    temperature=0.7), tokenizer, 32)
    assert (own.temperature, own.top_k, own.top_p) == (0.7, 20, 0.8)
    assert not [r for r in caplog.records if "generation config sets" in r.getMessage()]
    with caplog.at_level("WARNING", logger="oppo_ds.integrations.deepspeed_chat"):
        greedy = sampling_from_actor(actor("llama", do_sample=True, repetition_penalty=1.05),
                                     tokenizer, 32)
    assert greedy.temperature == 0.0
    assert [r.getMessage() for r in caplog.records
            if "generation config sets" in r.getMessage()] == [
        "the actor's generation config sets repetition_penalty=1.05, which HF generate applies "
        "and the chunked decode does not: it samples from the policy itself, whose log-probs "
        "PPO trains on (temperature, top-k and top-p apply)"]
