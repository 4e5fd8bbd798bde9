"""Tier 0: the decode at one shape (``generation.static_cache``, ``rollout/static_decode.py``)
samples what the default decode samples: the same tokens, lengths, finish order and tokens
counted, and log-probs within 1e-5 in fp32 (attention over a longer cache whose extra
positions are masked: the same sums in another order). On tiny Llama, Qwen2 and GPT-2, with
left-padded prompts, rows ending at EOS, at the length limit and at a length oracle's target,
in chunks, in blocks (``sync_every``), and continuing deferred prefixes. The CUDA-graph replay
is checked against the same reference where a GPU is present."""

import pytest
import torch

from _builders import (LikeAGpuGenerator, assert_same_decode, left_padded_prompts, random_lm,
                       record_static_buffers)

from oppo_ds.rollout import static_decode
from oppo_ds.rollout.generate import SamplingParams, decode_steps, start_decode
from oppo_ds.rollout.static_decode import StaticDecode
from oppo_ds.rollout.static_length import LENGTH_ROUND, cache_length, run_cache_length

pytestmark = pytest.mark.usefixtures("torch_one_thread")

VOCAB = 64
PAD = 0
ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-gpt2"]
PROMPT_LENS = [3, 7, 5, 6, 2, 4]
EOS = tuple(range(3, VOCAB, 7))  # 9 of 64 tokens: rows end all through the decode
ATOL = 1e-5  # fp32: the same attention sums over a longer, masked cache, in another order
# a decode of one row padded into 16: other matrix kernels than the default decode's one row
# (measured: tiny-llama 1.05e-5, and up to 8.1e-6 for its unpadded decodes here; 5e-6 others)
ATOL_PADDED = 2e-5

_MODELS = {}


def _model(arch, attention="sdpa"):
    if (arch, attention) not in _MODELS:
        model = random_lm(arch, VOCAB, seed=0)
        if attention != "sdpa":
            model.set_attn_implementation(attention)
        _MODELS[arch, attention] = model
    return _MODELS[arch, attention]


def _params(static, **kw):
    base = dict(max_new_tokens=12, eos_token_ids=EOS, pad_token_id=PAD)
    return SamplingParams(**{**base, **kw}, static_cache=static)


def _decode(model, params, seed, lens=PROMPT_LENS, max_steps=None, gpu_like=False, **extra):
    ids, mask = left_padded_prompts(lens, VOCAB, PAD, seed=1)
    state = start_decode(model, ids, mask, params, **extra)
    gen = (LikeAGpuGenerator() if gpu_like else torch.Generator()).manual_seed(seed)
    produced = 0
    while not state.over:
        produced += decode_steps(model, state, params, gen, max_steps=max_steps)
    return state, produced


def _assert_same(out, ref, atol=ATOL):
    assert_same_decode(*out, *ref, atol=atol)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0),
                                      dict(temperature=0.8, top_k=10, top_p=0.9)])
def test_static_cache_samples_what_the_default_decode_samples(arch, sampling):
    model = _model(arch)
    ref = _decode(model, _params(False, **sampling), seed=5)
    out = _decode(model, _params(True, **sampling), seed=5)
    if sampling["temperature"] > 0:
        assert len(set(ref[0].lengths.tolist())) > 2  # rows end at different tokens
    assert (ref[0].lengths == 12).any() or sampling["temperature"] == 0
    _assert_same(out, ref)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sync_every", [1, 5])
def test_static_cache_in_chunks_blocks_and_with_a_length_oracle(arch, sync_every):
    """Chunks of 3 (the streaming hand-overs), blocks of ``sync_every`` inside them, per-row
    length targets: the default decode's result (both sampling as on a GPU, which the block
    decode does)."""
    model = _model(arch)
    targets = torch.tensor([4, 1, 9, 20, 7, 13])
    kw = dict(max_new_tokens=16, eos_token_ids=(3,))
    ref = _decode(model, _params(False, **kw), seed=2, gpu_like=True, targets=targets)
    out = _decode(model, _params(True, sync_every=sync_every, **kw), seed=2, max_steps=3,
                  gpu_like=sync_every == 1, targets=targets)
    assert (ref[0].lengths <= targets.clamp(max=16)).all()
    _assert_same(out, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_static_cache_continues_deferred_prefixes(arch):
    """Rows that continue a response begun in an earlier step (the rollout pool's deferred
    rows): prompt and prefix prefilled together, the prefix's log-probs under these weights
    (``actor_logprobs``) from that prefill, the carried behaviour log-probs kept."""
    model = _model(arch)
    prefix_lengths = torch.tensor([2, 0, 5, 1, 3, 4])
    prefix = torch.randint(10, VOCAB, (6, 5), generator=torch.Generator().manual_seed(4))
    prefix = torch.where(torch.arange(5)[None, :] < prefix_lengths[:, None], prefix, PAD)
    prefix[prefix == 3] = 4  # no EOS inside a carried prefix
    carried = -torch.rand(6, 5, generator=torch.Generator().manual_seed(6))
    extra = dict(prefix_ids=prefix, prefix_lengths=prefix_lengths, prefix_logprobs=carried)
    kw = dict(max_new_tokens=14, eos_token_ids=(3,))
    ref = _decode(model, _params(False, **kw), seed=8, **extra)
    out = _decode(model, _params(True, **kw), seed=8, **extra)
    _assert_same(out, ref)
    in_prefix = torch.arange(prefix.shape[1])[None, :] < prefix_lengths[:, None]
    assert torch.equal(out[0].logprobs[:, :prefix.shape[1]][in_prefix], carried[in_prefix])
    assert torch.equal(out[0].tokens[:, :prefix.shape[1]][in_prefix], prefix[in_prefix])


@pytest.mark.parametrize("arch", ARCHS)
def test_one_run_wide_length_serves_new_prompts_and_deferred_prefixes(arch, monkeypatch):
    """The trainer's static length with a CUDA graph (``run_cache_length``: the widest context
    a pool rollout can start from, plus the tokens it decodes): a rollout of new prompts and
    one continuing deferred prefixes take the same buffers (on a GPU, the same graph; checked
    here by keeping the buffers without one) and each decodes what the default decode does.
    Sized by its own context instead, the second rollout needs a longer cache: a new shape,
    on a GPU a capture."""
    monkeypatch.setattr(static_decode, "_KEEP_WITHOUT_GRAPH", True)
    model = _model(arch)
    n = 40
    prefix_lengths = torch.tensor([20, 0, 30, 1, 0, 12])
    prefix = torch.randint(10, VOCAB, (6, 30), generator=torch.Generator().manual_seed(4))
    prefix = torch.where(torch.arange(30)[None, :] < prefix_lengths[:, None], prefix, PAD)
    prefix[prefix == 3] = 4  # no EOS inside a carried prefix
    extra = dict(prefix_ids=prefix, prefix_lengths=prefix_lengths)
    length = run_cache_length(max(PROMPT_LENS), n, 1, carries=True)
    kw = dict(max_new_tokens=n, eos_token_ids=(3,))
    fresh = _decode(model, _params(True, static_length=length, **kw), seed=8)
    _assert_same(fresh, _decode(model, _params(False, **kw), seed=8))
    carried = _decode(model, _params(True, static_length=length, **kw), seed=8, **extra)
    _assert_same(carried, _decode(model, _params(False, **kw), seed=8, **extra))
    assert fresh[0].static.length == length and carried[0].static is fresh[0].static
    own = [_decode(model, _params(True, **kw), seed=8, **e)[0].static.length for e in ({}, extra)]
    assert own[0] < own[1] == length, own


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_log_probs_are_the_training_forwards_within_a_stated_tolerance(arch):
    """In bf16 the static decode does not sample the default decode's stream: its attention
    runs with an explicit mask (another kernel than the default decode's causal fast path),
    which moves logits by a few bf16 ulps (0.06-0.14 on a scale of 7, measured) and flips
    near-tie draws. What PPO needs is log-probs near the training forward's (they stand in
    for the old log-probs when the actor streams): within 0.1 here (measured at most 0.036,
    against up to 0.136 for the default decode, tiny models, 5 decodes of 6 rows each)."""
    from oppo_ds.experience import response_logprobs
    from oppo_ds.rollout.generate import finish

    model = random_lm(arch, VOCAB, seed=0).to(torch.bfloat16)
    params = _params(True, max_new_tokens=16, eos_token_ids=(3,))
    for seed in range(5):
        state, _ = _decode(model, params, seed=seed)
        gen = finish(state)
        with torch.no_grad():
            train = response_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.response_ids,
                                      gen.response_mask, 1.0)[0]
        gap = ((train.float() - gen.logprobs) * gen.response_mask).abs().max()
        assert gap < 0.1, (seed, float(gap))


def test_rows_stay_in_the_static_cache_and_the_forward_keeps_its_shapes():
    """Every decode forward has the same input shapes, whatever rows ended; the state's
    per-row views (active rows, their logits and positions) are the default decode's."""
    model = _model("tiny-llama")
    params = _params(True, max_new_tokens=10)
    ids, mask = left_padded_prompts(PROMPT_LENS, VOCAB, PAD, seed=1)
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: shapes.append((tuple(kwargs["input_ids"].shape),
                                               tuple(kwargs["attention_mask"].shape))),
        with_kwargs=True)
    try:
        state = start_decode(model, ids, mask, params)
        gen = torch.Generator().manual_seed(3)
        while not state.over:
            decode_steps(model, state, params, gen, max_steps=1)
            if not state.over:
                a = state.active.numel()
                assert state.next_logits.shape == (a, VOCAB) and state.next_position.shape == (a,)
    finally:
        hook.remove()
    batch, length = len(PROMPT_LENS), cache_length(ids.shape[1], 10, 1)
    assert length % LENGTH_ROUND == 0 and length >= ids.shape[1] + 10
    assert shapes[0] == ((batch, ids.shape[1]), (batch, 1, ids.shape[1], length))  # prefill
    assert set(shapes[1:]) == {((batch, 1), (batch, 1, 1, length))}
    assert len(shapes) - 1 == int(state.lengths.max()) - 1  # one forward a token after the first
    assert len(set(state.lengths.tolist())) > 2  # rows ended one after another meanwhile
    assert state.static.cache.layers[0].keys.shape[0] == batch


def test_without_a_graph_no_buffers_outlive_the_decode():
    model = random_lm("tiny-llama", VOCAB, seed=0)
    state, _ = _decode(model, _params(True), seed=1)
    assert state.static is not None and model not in static_decode._KEPT


def test_buffers_are_kept_for_the_next_rollout_and_not_shared_by_two_live_decodes(monkeypatch):
    """What a CUDA graph relies on, checked on a CPU by keeping the buffers without one: a
    second rollout of the same batch and rounded length reuses them (prompts of another
    width); a decode that has not ended keeps its own: a second one started beside it gets
    new buffers, and both decode what they decode alone."""
    monkeypatch.setattr(static_decode, "_KEEP_WITHOUT_GRAPH", True)
    model = _model("tiny-qwen2")
    params = _params(True)
    first = _decode(model, params, seed=1)
    second = _decode(model, params, seed=2, lens=[1, 2, 3, 4, 5, 2])  # another prompt width
    assert second[0].static is first[0].static
    _assert_same(second, _decode(model, _params(False), seed=2, lens=[1, 2, 3, 4, 5, 2]))

    ids, mask = left_padded_prompts(PROMPT_LENS, VOCAB, PAD, seed=1)
    gens = [torch.Generator().manual_seed(s) for s in (11, 12)]
    a = start_decode(model, ids, mask, params)
    decode_steps(model, a, params, gens[0], max_steps=2)
    b = start_decode(model, ids, mask, params)
    assert b.static is not a.static and not a.over
    while not (a.over and b.over):  # interleaved, token by token
        for state, gen in ((a, gens[0]), (b, gens[1])):
            decode_steps(model, state, params, gen, max_steps=1)
    for state, seed in ((a, 11), (b, 12)):
        _assert_same((state, int(state.lengths.sum())), _decode(model, _params(False), seed=seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_smaller_rollout_pads_into_the_kept_buffers(arch, monkeypatch):
    """Kept buffers of up to twice a rollout's rows serve it, the rows past its own padding
    (on a GPU: the same graph, no capture for a pool rollout that left out rows finished
    ahead): each rollout decodes what the default decode does, prompts and deferred prefixes
    alike. Fewer than half the rows take buffers of their own."""
    monkeypatch.setattr(static_decode, "_KEEP_WITHOUT_GRAPH", True)
    model = random_lm(arch, VOCAB, seed=0)  # kept buffers are per model: this test's own
    kw = dict(max_new_tokens=12, eos_token_ids=(3,))
    first = _decode(model, _params(True, **kw), seed=5)
    assert first[0].static.batch == len(PROMPT_LENS)
    prefix_lengths = torch.tensor([2, 0, 5, 1])
    prefix = torch.randint(10, VOCAB, (4, 5), generator=torch.Generator().manual_seed(4))
    prefix = torch.where(torch.arange(5)[None, :] < prefix_lengths[:, None], prefix, PAD)
    prefix[prefix == 3] = 4
    for lens, extra in (([4, 7, 2, 5], {}), ([3, 6, 2, 5], dict(prefix_ids=prefix,
                                                                 prefix_lengths=prefix_lengths))):
        out = _decode(model, _params(True, **kw), seed=6, lens=lens, **extra)
        assert out[0].static is first[0].static and out[0].static.live == 4
        assert out[0].tokens.shape[0] == 4
        _assert_same(out, _decode(model, _params(False, **kw), seed=6, lens=lens, **extra))
    small = _decode(model, _params(True, **kw), seed=7, lens=[4, 6])
    assert small[0].static is not first[0].static and small[0].static.batch == 2
    _assert_same(small, _decode(model, _params(False, **kw), seed=7, lens=[4, 6]))
    # the small decode's buffers went with it: the wider set stays kept for the next rollout
    again = _decode(model, _params(True, **kw), seed=8)
    assert again[0].static is first[0].static and again[0].static.live == len(PROMPT_LENS)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_runs_widest_rollout_sizes_the_buffers_and_every_smaller_one_pads(arch, monkeypatch):
    """``static_rows`` (the trainer's ``Config.widest_rollout``) sizes the first set of buffers,
    however few rows the first decode has, and that set serves every decode of the run down to
    one row (an evaluation's last, short batch; a pool rollout under ``overcommit: auto`` after
    Delta shrank): on a GPU one capture for the run. A decode wider than that takes a set of
    its own width, kept from then on in the narrower one's place. Each decodes what the
    default decode does (log-probs within ``ATOL_PADDED``)."""
    monkeypatch.setattr(static_decode, "_KEEP_WITHOUT_GRAPH", True)
    model = random_lm(arch, VOCAB, seed=0)
    kw = dict(max_new_tokens=12, eos_token_ids=(3,), static_rows=16)
    seen = []
    for seed, lens in ((5, [4, 7, 2, 5]), (6, PROMPT_LENS), (7, [6]), (8, [3, 5, 2])):
        out = _decode(model, _params(True, **kw), seed=seed, lens=lens)
        assert out[0].static.batch == 16 and out[0].static.live == len(lens)
        _assert_same(out, _decode(model, _params(False, **kw), seed=seed, lens=lens),
                     atol=ATOL_PADDED)
        seen.append(out[0].static)
    assert all(static is seen[0] for static in seen)
    # a decode wider than expected (a later round of filter_groups with oversampling) takes a
    # set of its own width, kept in place of the narrower one; it then serves every decode
    wide = _decode(model, _params(True, **kw), seed=9, lens=PROMPT_LENS * 3)[0].static
    assert wide is not seen[0] and wide.batch == 18
    for seed, lens in ((10, [6]), (11, PROMPT_LENS * 2)):
        out = _decode(model, _params(True, **kw), seed=seed, lens=lens)
        assert out[0].static is wide and out[0].static.live == len(lens)
        _assert_same(out, _decode(model, _params(False, **kw), seed=seed, lens=lens),
                     atol=ATOL_PADDED)


def test_eager_attention_takes_an_additive_mask_and_other_attention_is_refused():
    model = _model("tiny-llama", attention="eager")
    out = _decode(model, _params(True), seed=4)
    _assert_same(out, _decode(model, _params(False), seed=4))
    assert out[0].static.additive and out[0].static.mask.is_floating_point()
    other = random_lm("tiny-llama", VOCAB, seed=0)
    other.config._attn_implementation = "flex_attention"
    ids, mask = left_padded_prompts(PROMPT_LENS, VOCAB, PAD, seed=1)
    with pytest.raises(ValueError, match=r"attention is one of sdpa, eager.*'flex_attention'"
                                         r".*generation.static_cache: false"):
        start_decode(other, ids, mask, _params(True))
    # a model with no config has no attention to name
    with pytest.raises(ValueError, match=r"a Linear without one: set generation.static_cache"):
        static_decode._attention(torch.nn.Linear(2, 2))


def test_sliding_window_attention_is_refused():
    """Sliding-window layers keep a static cache of their window only: the mask built here
    (over the whole length) would not fit it."""
    from transformers import AutoModelForCausalLM

    from oppo_ds.models import tiny_config

    config = tiny_config("tiny-qwen2", VOCAB)
    config.use_sliding_window, config.sliding_window = True, 4
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    model = AutoModelForCausalLM.from_config(config).eval()
    ids, mask = left_padded_prompts(PROMPT_LENS, VOCAB, PAD, seed=1)
    with pytest.raises(ValueError, match="sliding-window attention layers"):
        start_decode(model, ids, mask, _params(True))


def test_cuda_graph_needs_the_static_cache_and_a_gpu():
    with pytest.raises(ValueError, match="cuda_graph needs static_cache"):
        SamplingParams(max_new_tokens=4, eos_token_ids=(), pad_token_id=PAD, cuda_graph=True)
    ids, mask = left_padded_prompts(PROMPT_LENS, VOCAB, PAD, seed=1)
    params = SamplingParams(max_new_tokens=4, eos_token_ids=(), pad_token_id=PAD,
                            static_cache=True, cuda_graph=True)
    with pytest.raises(ValueError, match="needs the actor on a CUDA device; it is on cpu"):
        start_decode(_model("tiny-llama"), ids, mask, params)


def test_a_full_cache_is_an_error_not_a_silent_overwrite():
    model = _model("tiny-gpt2")
    ids, mask = left_padded_prompts(PROMPT_LENS, VOCAB, PAD, seed=1)
    state = start_decode(model, ids, mask, _params(True, max_new_tokens=4))
    state.static.column = state.static.length
    with pytest.raises(RuntimeError, match="cache of .* positions is full"):
        decode_steps(model, state, _params(True, max_new_tokens=4), None, max_steps=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_one_token_forward_has_no_host_side_step(arch):
    """What a CUDA-graph capture needs, checked where no GPU is: the static decode's
    one-token forward (its own buffers: tokens, 4D mask, positions, the static cache) traces
    with torch's dynamo as one graph with no break, so nothing in it reads a device value on
    the host (an ``.item()``, a branch on a tensor, a ``.tolist()`` would each break it)."""
    from oppo_ds.kv_cache import cache_kwargs

    model = _model(arch)
    params = _params(True, max_new_tokens=8, eos_token_ids=())
    ids, mask = left_padded_prompts(PROMPT_LENS, VOCAB, PAD, seed=1)
    state = start_decode(model, ids, mask, params)
    decode_steps(model, state, params, torch.Generator().manual_seed(0), max_steps=2)
    static = state.static

    def one_token(tokens, attention, positions):
        return model(input_ids=tokens, attention_mask=attention, position_ids=positions,
                     use_cache=True, **cache_kwargs(model, static.cache)).logits

    try:
        with torch.no_grad():
            explained = torch._dynamo.explain(one_token)(static.tokens, static.mask,
                                                         static.positions)
    finally:
        torch._dynamo.reset()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        [b.reason for b in explained.break_reasons]


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the graph is captured and replayed on one")
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_graph_replay_samples_what_the_default_decode_samples_on_a_gpu(arch):
    """On a GPU: the captured forward replayed token after token, over two rollouts (the
    second replays the first's graph), decodes what the default decode does; after the
    weights move (a copy of the model elsewhere in memory) the graph is captured again."""
    model = random_lm(arch, VOCAB, seed=0).cuda()
    graph = SamplingParams(max_new_tokens=12, eos_token_ids=EOS, pad_token_id=PAD,
                           static_cache=True, cuda_graph=True)
    ids, mask = (t.cuda() for t in left_padded_prompts(PROMPT_LENS, VOCAB, PAD, seed=1))

    def run(params, seed):
        state = start_decode(model, ids, mask, params)
        gen = torch.Generator().manual_seed(seed)
        produced = decode_steps(model, state, params, gen)
        return state, produced

    graphs = []
    before = static_decode.captures()
    for seed in (1, 2):
        out = run(graph, seed)
        _assert_same(out, run(_params(False), seed))
        graphs.append(out[0].static.graph)
    captured = graphs[0]
    assert captured is not None and graphs[1] is captured  # replayed, not captured again
    assert static_decode.captures() == before + 1
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()  # the same values, elsewhere
    out = run(graph, 3)
    assert out[0].static.graph is not captured and static_decode.captures() == before + 2
    _assert_same(out, run(_params(False), 3))
    assert isinstance(out[0].static, StaticDecode)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the graph is captured and replayed on one")
def test_cuda_graph_captures_under_a_deepspeed_engine_that_synchronizes_on_a_gpu():
    """A DeepSpeed engine with DeepSpeed's default throughput timer (DeepSpeed-Chat's are so)
    synchronizes the device in a hook on its module before every forward from the third
    optimizer step on, which a capture may not do. The capture calls the module past its own
    hooks, so after three training steps the graph is captured and decodes what the default
    decode does through the same engine."""
    from oppo_ds.engines import DeepSpeedTrainEngine

    engine = DeepSpeedTrainEngine(
        random_lm("tiny-llama", VOCAB, seed=0), lr=1e-3, total_steps=10,
        micro_batch_size=len(PROMPT_LENS), gradient_accumulation_steps=1, zero_stage=0,
        offload=False, dtype="fp32", grad_clip=1.0, seed=0,
        ds_config_overrides={"timers": {"throughput": {"enabled": True, "synchronized": True}}})
    ids, mask = (t.to(engine.device) for t in left_padded_prompts(PROMPT_LENS, VOCAB, PAD,
                                                                   seed=1))

    def lm_loss(model, batch):
        loss = model(input_ids=batch, attention_mask=mask, labels=batch).loss
        return loss, {}

    for _ in range(3):
        engine.train_step([ids], lm_loss)
    timer = engine.ds_engine.tput_timer
    assert timer.config.synchronized and timer.global_step_count >= timer.start_step
    graph = SamplingParams(max_new_tokens=12, eos_token_ids=EOS, pad_token_id=PAD,
                           static_cache=True, cuda_graph=True)
    with engine.generation_context() as model:
        def run(params):
            state = start_decode(model, ids, mask, params)
            return state, decode_steps(model, state, params, torch.Generator().manual_seed(4))

        out = run(graph)
        assert out[0].static.graph is not None
        _assert_same(out, run(_params(False)))


# ------------------------------------------------------------------ in the trainer

# overcommit: auto in whole prompts of 4 rows, B 8: Delta 8 shrinks to 0 as the reward of
# random models does not rise, rollouts from 16 rows to 8 and fewer (rows finished ahead)
AUTO_DELTA = ("oppo.overcommit=auto", "oppo.delta_min=0", "oppo.delta_max=8",
              "oppo.delta_window=2", "ppo.batch_size=8", "data.samples_per_prompt=4",
              "ppo.advantage_estimator=rloo")


def _pool_run(tmp_path, *extra):
    """A pool run (fixed Delta 4, so the batch keeps its size) of tiny random models whose
    responses end at long-tailed target lengths: deferred rows are continued every step."""
    from oppo_ds.config import load_config
    from oppo_ds.telemetry import read_history
    from oppo_ds.trainer import PPOTrainer

    cfg = load_config(None, [
        "workload.kind=length_oracle", "model.builtin_arch=tiny-llama", "workload.num_prompts=64",
        "workload.median_len=8", "generation.max_new_tokens=24", "ppo.batch_size=8",
        "ppo.mini_batch_size=4", "ppo.micro_batch_size=4", "oppo.overcommit=4", "steps=5",
        "generation.static_cache=true", f"logging.output_dir={tmp_path}/run",
        f"workload.cache_dir={tmp_path}/cache", "logging.progress=false", "eval.prompts=null",
        "checkpoint.final=false", "checkpoint.export_hf=false", *extra])
    trainer = PPOTrainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return cfg, read_history(str(tmp_path / "run" / "metrics.jsonl"))


def test_a_pool_run_decodes_every_rollout_in_one_set_of_static_buffers(tmp_path, monkeypatch):
    """The trainer sizes the static cache once for the run (``run_cache_length``): rollouts of
    new prompts and rollouts that continue deferred responses take the same length (sized by
    each rollout's own context, this run's moved between 64 and 128 positions as the deferred
    rows grew), and a rollout that left out rows finished ahead pads into the same rows. With
    a CUDA graph the buffers are kept between rollouts, so one capture serves the run."""
    used = record_static_buffers(monkeypatch)
    cfg, rows = _pool_run(tmp_path)
    g = cfg.generation
    want = run_cache_length(g.max_prompt_len, g.max_new_tokens, g.sync_every, carries=True)
    assert sum(r["pool/carried"] for r in rows) > 0  # deferred responses were continued
    assert len(used) == cfg.steps and {buffers.length for _, buffers in used} == {want}
    # some rollouts left out rows that finished ahead; they padded into the same buffers
    assert len({batch for batch, _ in used}) > 1, used
    assert len({id(buffers) for _, buffers in used}) == 1


def test_overcommit_auto_decodes_in_the_runs_one_set_of_buffers(tmp_path, monkeypatch):
    """Under ``overcommit: auto`` B + Delta moves: it starts at ``delta_max`` and here shrinks
    to 0 (one prompt of 4 rows a step) while the reward does not rise, so rollouts fall to
    half the first one's rows and below (rows that finished ahead are not decoded). The
    trainer sizes the buffers for its widest rollout (``SamplingParams.static_rows``: B +
    ``delta_max``) and every rollout pads into that one set. Before, a rollout of fewer than
    half its rows took (and kept) a set of its own, and the next wider one another: on a GPU
    a capture each. (Evaluations: ``test_eval.py``.)"""
    used = record_static_buffers(monkeypatch)
    cfg, rows = _pool_run(tmp_path, *AUTO_DELTA, "steps=7")
    deltas = [r["pool/delta"] for r in rows]
    assert max(deltas) == 8 and min(deltas) < 8, deltas  # Delta moved
    widest = cfg.ppo.batch_size + 8
    batches = [batch for batch, _ in used]
    assert 2 * min(batches) <= widest, batches  # some rollout had half the rows or fewer
    assert {buffers.batch for _, buffers in used} == {widest}
    assert len({id(buffers) for _, buffers in used}) == 1


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the graph is captured and replayed on one")
@pytest.mark.parametrize("extra", [(), AUTO_DELTA], ids=["fixed-delta", "auto-delta"])
def test_cuda_graph_pool_run_captures_once_on_a_gpu(tmp_path, extra):
    """On a GPU: the whole pool run, deferred responses continued every step, replays the
    graph its first rollout captured; under ``overcommit: auto`` too, its rollouts shrinking
    to half the first one's rows."""
    _, rows = _pool_run(tmp_path, "generation.cuda_graph=true", *extra)
    assert sum(r["pool/carried"] for r in rows) > 0
    assert [r["rollout/graph_captures"] for r in rows] == [1] + [0] * (len(rows) - 1)
