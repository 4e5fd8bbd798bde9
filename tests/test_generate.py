"""Tier 0/2: our KV-cache decode loop against Hugging Face ``generate`` and against a full
forward, top-k/top-p filtering by hand, and chunked (resumed) decoding against one
uninterrupted decode."""

import pytest
import torch

from _builders import LikeAGpuGenerator, assert_same_decode, left_padded_prompts, random_lm

from oppo_ds.rollout.generate import (
    SamplingParams,
    decode_steps,
    filter_logits,
    finish,
    generate,
    inverse_cdf_sample,
    position_ids_from_mask,
    sample_tokens,
    start_decode,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")

VOCAB = 64
PAD = 0
ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-gpt2"]
PROMPT_LENS = [3, 7, 5, 6, 2, 4]


def _prompts(lens=PROMPT_LENS, seed=1):
    return left_padded_prompts(lens, VOCAB, PAD, seed)

_MODELS = {}


def _model(arch):
    """A tiny model whose greedy outputs vary: at the default init scale (std 0.02) a random
    model repeats one token, which would hide where rows end."""
    if arch not in _MODELS:
        model = random_lm(arch, VOCAB, seed=0)
        model.generation_config.eos_token_id = None
        _MODELS[arch] = model
    return _MODELS[arch]


def _full_forward_logprobs(model, gen, temperature):
    """Log-probs of the response tokens from one forward over prompt + response (no cache)."""
    ids = torch.cat([gen.prompt_ids, gen.response_ids], 1)
    mask = torch.cat([gen.prompt_mask, gen.response_mask.long()], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask,
                       position_ids=position_ids_from_mask(mask)).logits.float()
    width = gen.prompt_ids.shape[1]
    logits = logits[:, width - 1:-1]  # the logits that predicted each response token
    if temperature > 0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, gen.response_ids[..., None]).squeeze(-1), logits


def _cache_batch(cache):
    return cache.layers[0].keys.shape[0]


def _pick_eos(tokens):
    """An EOS id that makes several rows of a greedy run end early, at different steps."""
    n = tokens.shape[1]
    best, best_score = None, -1
    for tok in tokens.unique().tolist():
        if tok == PAD:
            continue
        firsts = [int(row.tolist().index(tok)) if tok in row.tolist() else n for row in tokens]
        early = {f for f in firsts if f < n - 1}
        score = len(early) + (n in firsts)  # prefer one row that runs to the limit
        if score > best_score:
            best, best_score = tok, score
    return best


# ---------------------------------------------------------------- against HF generate

@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_generate(arch):
    model = _model(arch)
    ids, mask = _prompts()
    n = 10
    params = SamplingParams(max_new_tokens=n, eos_token_ids=(), pad_token_id=PAD, temperature=0.0)
    ours = generate(model, ids, mask, params)
    hf = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                        pad_token_id=PAD, eos_token_id=None)
    assert torch.equal(ours.response_ids, hf[:, ids.shape[1]:])
    assert ours.lengths.tolist() == [n] * len(PROMPT_LENS)
    assert torch.equal(ours.prompt_ids, ids) and torch.equal(ours.prompt_mask, mask)
    # greedy log-probs are those of the unscaled logits, and the cache path equals a full forward
    full, _ = _full_forward_logprobs(model, ours, temperature=0.0)
    assert torch.allclose(ours.logprobs, full, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_eos_matches_hf_generate(arch):
    model = _model(arch)
    ids, mask = _prompts()
    n, width = 10, ids.shape[1]
    free = generate(model, ids, mask, SamplingParams(max_new_tokens=n, eos_token_ids=(),
                                                     pad_token_id=PAD, temperature=0.0))
    eos = _pick_eos(free.response_ids)

    params = SamplingParams(max_new_tokens=n, eos_token_ids=(eos,), pad_token_id=PAD, temperature=0.0)
    ours = generate(model, ids, mask, params)
    hf = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                        pad_token_id=PAD, eos_token_id=eos)[:, width:]

    expected = []
    for row in free.response_ids.tolist():
        expected.append(row.index(eos) + 1 if eos in row else n)
    assert ours.lengths.tolist() == expected
    assert len({length for length in expected if length < n}) >= 2  # early, at different steps
    assert ours.response_ids.shape[1] == max(expected)  # trimmed to the longest row
    for i, length in enumerate(expected):
        assert ours.response_ids[i, :length].tolist() == free.response_ids[i, :length].tolist()
        assert ours.response_ids[i, :length].tolist() == hf[i, :length].tolist()
        assert (ours.response_ids[i, length:] == PAD).all()
        assert (hf[i, length:] == PAD).all()
        if length < n:
            assert ours.response_ids[i, length - 1] == eos
        assert ours.response_mask[i].sum() == length
        assert (ours.logprobs[i, length:] == 0).all()
        assert torch.allclose(ours.logprobs[i, :length], free.logprobs[i, :length], atol=1e-5)


# ---------------------------------------------------------------- sampling

@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_seeded_and_logprobs_match_full_forward(arch):
    model = _model(arch)
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=12, eos_token_ids=(2,), pad_token_id=PAD, temperature=0.7)
    a = generate(model, ids, mask, params, torch.Generator().manual_seed(123))
    b = generate(model, ids, mask, params, torch.Generator().manual_seed(123))
    c = generate(model, ids, mask, params, torch.Generator().manual_seed(124))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)
    assert a.response_ids.shape != c.response_ids.shape or not torch.equal(a.response_ids, c.response_ids)

    full, _ = _full_forward_logprobs(model, a, temperature=0.7)
    on = a.response_mask.bool()
    assert torch.allclose(a.logprobs[on], full[on], atol=1e-5)
    assert (a.logprobs[on] < 0).all() and (a.logprobs[~on] == 0).all()


def test_truncated_sampling_logprobs_are_of_untruncated_distribution():
    """With top-k / top-p the tokens come from the truncated distribution but the log-probs
    are those of logits / temperature, the distribution PPO optimises."""
    model = _model("tiny-llama")
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=12, eos_token_ids=(), pad_token_id=PAD,
                            temperature=1.3, top_k=5, top_p=0.9)
    gen = generate(model, ids, mask, params, torch.Generator().manual_seed(0))
    full, scaled = _full_forward_logprobs(model, gen, temperature=1.3)
    assert torch.allclose(gen.logprobs, full, atol=1e-5)
    # every sampled token lies inside the filtered support
    kept = torch.isfinite(filter_logits(scaled.reshape(-1, VOCAB), 5, 0.9)).reshape(scaled.shape)
    assert kept.gather(-1, gen.response_ids[..., None]).all()
    assert (kept.sum(-1) <= 5).all()


def test_sample_tokens_greedy_ignores_generator():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    params = SamplingParams(max_new_tokens=1, eos_token_ids=(), pad_token_id=0, temperature=0.0)
    tokens, logprobs = sample_tokens(logits, params, None)
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(logprobs, logits.log_softmax(-1)[[0, 1], [1, 0]])


def test_sample_tokens_frequencies():
    """Sampled frequencies follow softmax(logits / T) (T = 2 flattens [log 4, log 1])."""
    logits = torch.log(torch.tensor([[4.0, 1.0]])).repeat(20000, 1)
    params = SamplingParams(max_new_tokens=1, eos_token_ids=(), pad_token_id=0, temperature=2.0)
    tokens, logprobs = sample_tokens(logits, params, torch.Generator().manual_seed(0))
    share = (tokens == 0).float().mean().item()
    assert abs(share - 2 / 3) < 0.015  # softmax([log 2, 0]) = [2/3, 1/3]
    assert torch.allclose(logprobs[tokens == 0], torch.tensor(2 / 3).log())


def test_inverse_cdf_sample_by_hand_and_never_a_zero_probability_token():
    """The sampler used when the generator is on the CPU and the logits on a GPU (no GPU
    here: the function is called directly). probs [0, .25, 0, .75]: CDF 0, .25, .25, 1."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]]).repeat(6, 1)
    u = torch.tensor([0.0, 0.1, 0.2499, 0.25, 0.9, 1.0 - 2 ** -40], dtype=torch.float64)
    assert inverse_cdf_sample(probs, u).tolist() == [1, 1, 1, 3, 3, 3]
    # rows that do not sum to 1 (float32 softmax over a large vocabulary) scale u to their mass
    # (mass 0.8: u 0.2 -> 0.16 falls in token 1's 0.2, u 0.3 -> 0.24 past it)
    short = torch.tensor([[0.0, 0.2, 0.0, 0.6]]).repeat(2, 1)
    assert inverse_cdf_sample(short, torch.tensor([0.2, 0.3])).tolist() == [1, 3]
    # frequencies follow the probabilities; zero-probability tokens (top-k / top-p) never come
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.0, 0.2]]).repeat(40000, 1)
    u = torch.rand(40000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(inverse_cdf_sample(probs, u), minlength=5) / 40000
    assert counts[1] == counts[3] == 0
    assert torch.allclose(counts, probs[0], atol=0.01)


# ---------------------------------------------------------------- filtering

def test_top_k_keeps_exactly_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, 5.0, -2.0],
                           [0.5, -1.0, 4.0, 4.5, 0.0, 1.0]])
    out = filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(out).tolist() == [[False, True, False, False, True, False],
                                            [False, False, True, True, False, False]]
    kept = torch.isfinite(out)
    assert torch.equal(out[kept], logits[kept])  # kept logits unchanged
    assert torch.equal(filter_logits(logits, top_k=0, top_p=1.0), logits)  # 0 = off
    assert torch.equal(filter_logits(logits, top_k=6, top_p=1.0), logits)  # k >= V = off


@pytest.mark.parametrize("top_p, kept", [
    (0.1, [0]),           # below the top token's own mass: the top token still stays
    (0.4, [0]),
    (0.75, [0, 1]),       # 0.5 + 0.3 reaches 0.75
    (0.85, [0, 1, 2]),    # 0.5 + 0.3 + 0.15 reaches 0.85
    (0.99, [0, 1, 2, 3]),
])
def test_top_p_smallest_prefix_reaching_p(top_p, kept):
    # probabilities 0.5, 0.3, 0.15, 0.05, stored out of order to exercise the scatter back
    probs = torch.tensor([0.05, 0.3, 0.5, 0.15])
    rank_to_index = [2, 1, 3, 0]
    out = filter_logits(probs.log()[None], top_k=0, top_p=top_p)
    expected = torch.zeros(4, dtype=torch.bool)
    expected[[rank_to_index[r] for r in kept]] = True
    assert torch.equal(torch.isfinite(out[0]), expected)


def _top_p_reference(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """Loop reference: walk tokens by descending probability until the mass reaches top_p."""
    probs = row.softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, mass = torch.zeros(len(probs), dtype=torch.bool), 0.0
    for i in order:
        keep[i] = True
        mass += probs[i]
        if mass >= top_p:
            break
    return keep


def test_top_p_matches_loop_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 50, generator=g, dtype=torch.float64) * 2
    for top_p in (0.3, 0.6, 0.9):
        out = filter_logits(logits, top_k=0, top_p=top_p)
        for row, filtered in zip(logits, out):
            assert torch.equal(torch.isfinite(filtered), _top_p_reference(row, top_p))


def test_top_token_always_survives():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 30, generator=g)
    out = filter_logits(logits, top_k=1, top_p=1e-6)
    best = logits.argmax(-1)
    assert torch.isfinite(out).sum(-1).tolist() == [1] * 64
    assert torch.isfinite(out[torch.arange(64), best]).all()


def test_top_k_then_top_p_renormalises_over_top_k():
    # top-2 keeps 0.4 and 0.3, renormalised to 4/7 and 3/7; 4/7 alone reaches 0.55 (over the
    # whole row 0.4 would not)
    probs = torch.tensor([0.4, 0.1, 0.3, 0.2])
    out = filter_logits(probs.log()[None], top_k=2, top_p=0.55)
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]
    out = filter_logits(probs.log()[None], top_k=2, top_p=0.6)
    assert torch.isfinite(out[0]).tolist() == [True, False, True, False]


# ---------------------------------------------------------------- resumable decoding

def _decode_in_chunks(model, ids, mask, params, seed, chunk):
    state = start_decode(model, ids, mask, params)
    generator = torch.Generator().manual_seed(seed)
    produced, calls = 0, 0
    while not state.done:
        produced += decode_steps(model, state, params, generator, max_steps=chunk)
        calls += 1
    assert produced == int(state.lengths.sum())
    return state, calls


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_decode_equals_uninterrupted(arch):
    model = _model(arch)
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=16, eos_token_ids=(2, 5, 7, 11), pad_token_id=PAD,
                            temperature=1.0)
    whole, calls = _decode_in_chunks(model, ids, mask, params, seed=7, chunk=None)
    assert calls == 1
    assert len(set(whole.lengths.tolist())) >= 2  # rows end at different steps, mid-chunk
    for chunk in (1, 3, 5):
        state, calls = _decode_in_chunks(model, ids, mask, params, seed=7, chunk=chunk)
        assert calls == -(-int(whole.lengths.max()) // chunk)
        assert torch.equal(state.tokens, whole.tokens), chunk
        assert torch.equal(state.logprobs, whole.logprobs), chunk
        assert torch.equal(state.lengths, whole.lengths), chunk
        assert state.finished.all()


def test_max_new_tokens_and_finished_rows_leave_the_cache():
    model = _model("tiny-llama")
    ids, mask = _prompts()
    n = 12
    params = SamplingParams(max_new_tokens=n, eos_token_ids=(2, 5, 7, 11), pad_token_id=PAD,
                            temperature=1.0)
    state = start_decode(model, ids, mask, params)
    generator = torch.Generator().manual_seed(3)
    batch = len(PROMPT_LENS)
    assert state.active.tolist() == list(range(batch)) and _cache_batch(state.past_key_values) == batch
    active_sizes = [batch]
    for step in range(1, n + 1):
        appended = decode_steps(model, state, params, generator, max_steps=1)
        assert appended == active_sizes[-1]  # one token per row that was running
        running = (~state.finished).nonzero().squeeze(-1)
        assert sorted(state.active.tolist()) == running.tolist()
        assert (state.lengths[running] == step).all()
        if not state.done:
            a = state.active.numel()
            assert _cache_batch(state.past_key_values) == a  # finished rows left the KV cache
            assert state.cache_mask.shape == (a, ids.shape[1] + step)
            assert state.next_logits.shape == (a, VOCAB) and state.next_position.shape == (a,)
        active_sizes.append(state.active.numel())
    assert state.done and state.next_logits is None
    assert active_sizes == sorted(active_sizes, reverse=True) and active_sizes[-1] == 0
    assert len(set(active_sizes)) > 2  # it shrank more than once before the limit
    assert decode_steps(model, state, params, generator) == 0  # nothing left to do

    assert (state.lengths <= n).all()
    eos = torch.tensor(params.eos_token_ids)
    for row in range(batch):
        length = int(state.lengths[row])
        toks = state.tokens[row]
        if length < n:  # ended early: by an EOS, and only at its first EOS
            assert toks[length - 1] in eos
        assert not torch.isin(toks[:length - 1], eos).any()
        assert (toks[length:] == PAD).all()

    gen = finish(state, rows=[1, 3])
    assert gen.lengths.tolist() == state.lengths[[1, 3]].tolist()
    assert gen.response_ids.shape == (2, int(state.lengths[[1, 3]].max()))
    assert torch.equal(gen.prompt_ids, ids[[1, 3]])


def test_positions_count_real_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


# ---- decoding in blocks (generation.sync_every > 1) ----------------------------------


def _decode_all(model, params, generator, max_steps=None, targets=None, lens=PROMPT_LENS):
    ids, mask = _prompts(lens)
    state = start_decode(model, ids, mask, params, targets=targets)
    produced = 0
    while not state.over:
        produced += decode_steps(model, state, params, generator, max_steps=max_steps)
    return state, produced


def _assert_same_decode(block, ref, atol=1e-5):
    (state, produced, gen), (ref_state, ref_produced, ref_gen) = block, ref
    # rows that ended ride along in the block's forwards: other batch shapes, so the same
    # log-probs up to float rounding, not bit for bit
    assert_same_decode(state, produced, ref_state, ref_produced, atol)
    if gen is not None:  # the generator left where the per-token loop leaves it
        assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=ref_gen))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0),
                                      dict(temperature=0.8, top_k=10, top_p=0.9)])
@pytest.mark.parametrize("sync_every", [2, 5, 64])
def test_decoding_in_blocks_samples_what_the_per_token_loop_samples(arch, sampling, sync_every):
    """One host check every ``sync_every`` tokens changes nothing that is sampled: tokens,
    lengths, finish order, tokens counted and the generator's state equal the per-token
    loop's (as it samples on a GPU), with responses ending at EOS at different tokens and at
    the length limit. Log-probs within 1e-5 (the same forwards over other batch shapes)."""
    model = _model(arch)
    eos = tuple(range(3, VOCAB, 7))  # 9 of 64 tokens: rows end all through the decode
    params = SamplingParams(max_new_tokens=12, eos_token_ids=eos, pad_token_id=PAD, **sampling)
    blocks = SamplingParams(max_new_tokens=12, eos_token_ids=eos, pad_token_id=PAD,
                            sync_every=sync_every, **sampling)
    ref_gen, gen = LikeAGpuGenerator().manual_seed(5), torch.Generator().manual_seed(5)
    ref = _decode_all(model, params, ref_gen)
    out = _decode_all(model, blocks, gen)
    ends = ref[0].lengths.tolist()
    if sampling["temperature"] > 0:
        assert len(set(ends)) > 2, ends
    _assert_same_decode((*out, gen), (*ref, ref_gen))


@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_in_blocks_within_chunks_and_with_a_length_oracle(arch):
    """Chunks of 3 tokens (the streaming hand-overs) over blocks of 2 (a block of 2, then
    one of 1, per chunk), and per-row length targets: the per-token loop's decode."""
    model = _model(arch)
    targets = torch.tensor([4, 1, 9, 20, 7, 13])
    params = SamplingParams(max_new_tokens=16, eos_token_ids=(3,), pad_token_id=PAD)
    blocks = SamplingParams(max_new_tokens=16, eos_token_ids=(3,), pad_token_id=PAD,
                            sync_every=2)
    ref_gen, gen = LikeAGpuGenerator().manual_seed(2), torch.Generator().manual_seed(2)
    ref = _decode_all(model, params, ref_gen, targets=targets)
    out = _decode_all(model, blocks, gen, max_steps=3, targets=targets)
    assert (ref[0].lengths <= targets.clamp(max=16)).all()
    _assert_same_decode((*out, gen), (*ref, ref_gen))


def test_decoding_in_blocks_refuses_a_stop_rule_asked_every_token():
    model = _model("tiny-llama")
    ids, mask = _prompts()
    params = SamplingParams(max_new_tokens=8, eos_token_ids=(), pad_token_id=PAD, sync_every=4)
    state = start_decode(model, ids, mask, params)
    with pytest.raises(ValueError, match="BatchStop made with blocks=True"):
        decode_steps(model, state, params, None, stop=lambda s: False)
    with pytest.raises(ValueError, match="sync_every must be >= 1"):
        SamplingParams(max_new_tokens=8, eos_token_ids=(), pad_token_id=PAD, sync_every=0)


class _AllLogits(torch.nn.Module):
    """The model without ``logits_to_keep`` in its forward: it returns every position's."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, past_key_values=past_key_values,
                          use_cache=use_cache)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_the_prefill_keeps_only_the_logits_the_decode_reads(arch, static):
    """The actor's prefill asks for the last position's logits (and a carried prefix's
    predictions: its width + 1 positions), not every prompt position's: at a real vocabulary
    those were gigabytes held until the first token. The decode and the prefix's log-probs
    are those of a model that returns every position's logits, to the bit."""
    model = _model(arch)
    ids, mask = _prompts()
    prefix = torch.tensor([[7, 8, 9], [10, 0, 0], [0, 0, 0], [11, 12, 0], [13, 14, 15], [16, 0, 0]])
    lengths = torch.tensor([3, 1, 0, 2, 3, 1])
    widths = []
    hook = model.register_forward_hook(lambda m, a, out: widths.append(out.logits.shape[1]))
    try:
        for extra in ({}, {"prefix_ids": prefix, "prefix_lengths": lengths}):
            params = SamplingParams(max_new_tokens=8, eos_token_ids=(), pad_token_id=PAD,
                                    static_cache=static)
            states = []
            for m in (model, _AllLogits(model)):
                widths.clear()
                with torch.no_grad():
                    state = start_decode(m, ids, mask, params, **extra)
                    decode_steps(m, state, params, torch.Generator().manual_seed(3))
                states.append((state, widths[0]))
            (kept, kept_width), (every, every_width) = states
            assert kept_width == (4 if extra else 1)
            # every position of the prompts (+ prefixes) packed to their longest
            assert every_width == int((mask.sum(1) + (lengths if extra else 0)).max())
            assert torch.equal(kept.tokens, every.tokens)
            assert torch.equal(kept.actor_logprobs, every.actor_logprobs)
            assert torch.equal(kept.logprobs, every.logprobs)
    finally:
        hook.remove()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prefix_s_logprobs_in_blocks_of_rows_are_the_whole_call_s(arch, monkeypatch):
    """A carried prefix's log-probs are taken a block of rows at a time (gathered, upcast and
    normalised per block: all at once, in fp32, 12 bytes for each of rows x prefix x vocab).
    Where the prefill's prefix logits would pass a block (here: a block of one logit), the
    prefill keeps only the last position's and the rows with a prefix run again apart, one
    at a time here, without a cache: the same figures (within 1e-6 in fp32: forwards of
    other batch shapes may round differently). The decode's next logits are a copy, not a
    view that would keep the prefix's logits alive until the first token."""
    model = _model(arch)
    ids, mask = _prompts()
    prefix = torch.tensor([[7, 8, 9], [10, 0, 0], [0, 0, 0], [11, 12, 0], [13, 14, 15], [16, 0, 0]])
    lengths = torch.tensor([3, 1, 0, 2, 3, 1])
    params = SamplingParams(max_new_tokens=8, eos_token_ids=(), pad_token_id=PAD,
                            temperature=0.7)
    states, widths = [], []
    hook = model.register_forward_hook(lambda m, a, out: widths.append(out.logits.shape[1]))
    try:
        for block in (None, 1):
            if block is not None:
                monkeypatch.setattr("oppo_ds.algo.logprobs.BLOCK_ELEMENTS", block)
            widths.clear()
            with torch.no_grad():
                states.append(start_decode(model, ids, mask, params, prefix_ids=prefix,
                                           prefix_lengths=lengths))
    finally:
        hook.remove()
    # each of the five rows with a prefix, then the prefill: the last forward before the
    # decode's first token (the hybrid engine's kernels hold their cache in their layers)
    assert widths == [4] * 5 + [1]
    whole, apart = states
    torch.testing.assert_close(apart.actor_logprobs, whole.actor_logprobs, atol=1e-6, rtol=0)
    assert (whole.actor_logprobs[lengths > 0, 0] != 0).all()
    assert (apart.actor_logprobs[lengths == 0] == 0).all()
    torch.testing.assert_close(apart.next_logits, whole.next_logits, atol=1e-6, rtol=0)
    vocab = whole.next_logits.shape[-1]
    assert whole.next_logits.untyped_storage().nbytes() == \
        len(lengths) * vocab * whole.next_logits.element_size()
