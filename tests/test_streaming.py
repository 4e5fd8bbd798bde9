"""Tier 2: streamed scores equal whole-sequence scores.

The streaming scorers prefill each decode chunk into their own KV caches; their results must
be what ``experience.sequence_scores`` / ``response_logprobs`` / ``response_values`` give on
the finished Generation, for every architecture and chunk size, with rows ending at different
chunks, and when rows are fed on arbitrary schedules. Finished rows must leave the caches.
The ``colocated`` placement (scorers on a thread / side stream, concurrent with decoding) must
give exactly what ``inline`` gives, surface a scorer's error, and never leave its thread behind.
"""

import copy
import json
import threading
import time
import traceback

import pytest
import torch

from _builders import left_padded_prompts, sharpen as _sharpen

from oppo_ds.experience import response_logprobs, response_values, sequence_scores
from oppo_ds.models import build_causal_lm, build_value_model
from oppo_ds.rollout.generate import SamplingParams, generate
from oppo_ds.rollout.streaming import (PLACEMENTS, StreamingScorer, StreamTiming, _chunk_tokens,
                                       chrome_trace, stream_generate)

VOCAB = 40
PAD = 0
ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-gpt2"]
PROMPT_LENS = [3, 7, 5, 6, 2, 4]


def _prompts(lens=PROMPT_LENS, seed=1):
    return left_padded_prompts(lens, VOCAB, PAD, seed)
MAX_NEW = 20
# three EOS ids in a vocabulary of 40: a near-uniform actor ends a row with p ~ 3/40 per token,
# so rows end at different steps and some run to MAX_NEW
PARAMS = SamplingParams(max_new_tokens=MAX_NEW, eos_token_ids=(2, 5, 7), pad_token_id=PAD,
                        temperature=1.0)
SEED = 7
ATOL_FP32 = 1e-5

# conftest's module fixture: one intra-op thread, the old value restored after this module
pytestmark = pytest.mark.usefixtures("torch_one_thread")


_MODELS = {}


def _models(arch, dtype="fp32"):
    """actor (default init: near-uniform sampling, so EOS ends rows at varied steps),
    reference, reward, critic."""
    key = (arch, dtype)
    if key not in _MODELS:
        actor = build_causal_lm(arch, vocab_size=VOCAB, seed=0).eval()
        reference = _sharpen(build_causal_lm(arch, vocab_size=VOCAB, seed=1), seed=11)
        reward = _sharpen(build_value_model(arch, vocab_size=VOCAB, seed=2), seed=12)
        critic = _sharpen(build_value_model(arch, vocab_size=VOCAB, seed=3), seed=13)
        models = (actor, reference, reward, critic)
        if dtype == "bf16":
            models = tuple(m.to(torch.bfloat16) for m in models)
        _MODELS[key] = models
    return _MODELS[key]


def _scorers(reference, reward, critic, temperature=1.0):
    return [RecordingScorer(reward, "reward"),
            RecordingScorer(reference, "reference", temperature),
            RecordingScorer(critic, "critic")]


class RecordingScorer(StreamingScorer):
    """Records the KV cache's batch size around every finish (read from the cache tensors,
    not from our own bookkeeping)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.finishes = []  # (rows finished, cache batch before, cache batch after)

    def cache_batch(self) -> int:
        return 0 if self.cache is None else self.cache.layers[0].keys.shape[0]

    def finish(self, rows):
        before = self.cache_batch()
        out = super().finish(rows)
        self.finishes.append((len(out), before, self.cache_batch()))
        return out


@torch.no_grad()
def _whole(reference, reward, critic, gen, temperature=1.0):
    """The sequential step's scoring: one forward over prompt + whole response."""
    args = (gen.prompt_ids, gen.prompt_mask, gen.response_ids, gen.response_mask)
    return {"reward": sequence_scores(reward, *args),
            "reference": response_logprobs(reference, *args, temperature)[0].float(),
            "critic": response_values(critic, *args)}


def _max_diffs(streamed, whole, gen):
    on = gen.response_mask.bool()
    out = {"reward": (streamed["reward"] - whole["reward"]).abs().max().item()}
    for kind in ("reference", "critic"):
        assert (streamed[kind][~on] == 0).all(), kind  # right-padded with 0
        out[kind] = (streamed[kind][on] - whole[kind][on]).abs().max().item()
    return out


# ---------------------------------------------------------------- exactness, fp32

@pytest.mark.parametrize("chunk_size", [1, 3, 16, MAX_NEW + 5])
@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_scores_equal_whole_sequence(arch, chunk_size):
    actor, reference, reward, critic = _models(arch)
    ids, mask = _prompts()
    baseline = generate(actor, ids, mask, PARAMS, torch.Generator().manual_seed(SEED))
    lengths = baseline.lengths.tolist()
    assert len(set(lengths)) >= 3 and min(lengths) < MAX_NEW  # rows end at different steps

    scorers = _scorers(reference, reward, critic)
    gen, streamed, _ = stream_generate(actor, scorers, ids, mask, PARAMS,
                                       torch.Generator().manual_seed(SEED), chunk_size)
    # chunking decides only when the scorers see tokens, never what is sampled
    assert torch.equal(gen.response_ids, baseline.response_ids)
    assert torch.equal(gen.lengths, baseline.lengths)
    assert torch.equal(gen.logprobs, baseline.logprobs)
    assert streamed["reward"].shape == (len(PROMPT_LENS),)
    assert streamed["reference"].shape == streamed["critic"].shape == gen.response_ids.shape

    diffs = _max_diffs(streamed, _whole(reference, reward, critic, gen), gen)
    assert max(diffs.values()) < ATOL_FP32, diffs

    # every row finished in the chunk holding its last token, and left the cache then
    chunks_ended = sorted({-(-n // chunk_size) for n in lengths})
    for scorer in scorers:
        per_chunk = [rows for rows, _, _ in scorer.finishes]
        assert sum(per_chunk) == len(PROMPT_LENS)
        assert [i + 1 for i, k in enumerate(per_chunk) if k] == chunks_ended
        for rows, before, after in scorer.finishes:
            assert before - after == rows
        assert scorer.finishes[-1][2] == 0 and scorer.num_rows == 0 and scorer.cache is None


def _random_schedule(scorers, gen, chunk_size, seed):
    """Feed the rows of a finished Generation on an irregular schedule: each round a random
    subset of the unfinished rows, each with 1..chunk_size tokens, rows finishing out of order.
    Returns {kind: {row: result}}."""
    g = torch.Generator().manual_seed(seed)
    batch = gen.response_ids.shape[0]
    fed = torch.zeros(batch, dtype=torch.long)
    results = {s.kind: {} for s in scorers}
    while (fed < gen.lengths).any():
        open_rows = (fed < gen.lengths).nonzero().squeeze(-1)
        pick = open_rows[torch.rand(open_rows.numel(), generator=g) < 0.6]
        if pick.numel() == 0:
            continue
        pick = pick[torch.randperm(pick.numel(), generator=g)]  # any order of rows
        want = torch.randint(1, chunk_size + 1, (pick.numel(),), generator=g)
        counts = torch.minimum(want, gen.lengths[pick] - fed[pick])
        cols = fed[pick][:, None] + torch.arange(chunk_size)[None, :]
        cols = cols.clamp(max=gen.response_ids.shape[1] - 1)
        tokens = gen.response_ids[pick[:, None], cols]
        fed[pick] += counts
        ended = pick[fed[pick] == gen.lengths[pick]]
        for scorer in scorers:
            scorer.consume(pick, tokens, counts)
            results[scorer.kind].update(scorer.finish(ended))
    return results


@pytest.mark.parametrize("row_blocks", [False, True], ids=["whole", "row-blocks"])
@pytest.mark.parametrize("arch", ARCHS)
def test_subsets_and_irregular_chunks(arch, row_blocks, monkeypatch):
    """consume for a subset of the cached rows (the others take a masked all-padding chunk),
    rows with fewer tokens than the chunk without finishing, finishing in any order; with a
    reference temperature other than 1. ``row-blocks``: the reference's log-probs taken one
    row at a time (as a real vocabulary's are, in blocks of rows), the same figures."""
    if row_blocks:
        monkeypatch.setattr("oppo_ds.algo.logprobs.BLOCK_ELEMENTS", 1)
    actor, reference, reward, critic = _models(arch)
    ids, mask = _prompts()
    gen = generate(actor, ids, mask, PARAMS, torch.Generator().manual_seed(SEED))
    temperature = 0.7
    scorers = _scorers(reference, reward, critic, temperature)
    for scorer in scorers:
        scorer.begin(ids, mask)
    per_row = _random_schedule(scorers, gen, chunk_size=4, seed=3)
    whole = _whole(reference, reward, critic, gen, temperature)
    for i, n in enumerate(gen.lengths.tolist()):
        assert abs(per_row["reward"][i] - whole["reward"][i]) < ATOL_FP32
        for kind in ("reference", "critic"):
            assert per_row[kind][i].shape == (n,)
            assert (per_row[kind][i] - whole[kind][i, :n]).abs().max() < ATOL_FP32, (kind, i)
    assert all(s.num_rows == 0 and s.cache is None for s in scorers)


# ---------------------------------------------------------------- bf16

def test_streamed_scores_bf16():
    """bf16 keeps 8 significant bits: each rounding is off by up to 2^-9 ~ 2e-3 relative, and
    streaming changes the matmul shapes (a chunk vs the whole sequence), hence the order in
    which products are summed and where results are rounded to bf16; so streamed and whole
    scores, both in bf16, agree only to a few bf16 ulps of what is rounded last.
    Measured (3 archs, chunk sizes 1/3/16/25): values (reward, critic; of order 0.5, ulp
    2^-9 ~ 2e-3) differ by at most 5e-3, log-probs by at most 1.7e-2 (computed in fp32, but
    from bf16 logits of magnitude 4-8, whose ulp is 2^-6..2^-5 ~ 1.6e-2..3e-2).
    Tolerances: 2e-2 for values, 5e-2 for log-probs, 3-4x the measured maxima, and still well
    below the spread of the scores (std 0.2-0.6), so a wrong position or mask would fail."""
    actor, reference, reward, critic = _models("tiny-llama", "bf16")
    ids, mask = _prompts()
    baseline = generate(actor, ids, mask, PARAMS, torch.Generator().manual_seed(SEED))
    scorers = _scorers(reference, reward, critic)
    gen, streamed, _ = stream_generate(actor, scorers, ids, mask, PARAMS,
                                       torch.Generator().manual_seed(SEED), chunk_size=3)
    assert torch.equal(gen.response_ids, baseline.response_ids)
    whole = _whole(reference, reward, critic, gen)  # also in bf16: same weights, same dtype
    diffs = _max_diffs(streamed, whole, gen)
    tolerance = {"reward": 2e-2, "critic": 2e-2, "reference": 5e-2}
    assert all(diffs[k] < tolerance[k] for k in diffs), diffs
    on = gen.response_mask.bool()
    assert whole["critic"][on].std() > 5 * tolerance["critic"]
    assert whole["reference"][on].std() > 5 * tolerance["reference"]


# ---------------------------------------------------------------- timing, helpers, errors

def test_timing_fields():
    actor, reference, reward, critic = _models("tiny-gpt2")
    ids, mask = _prompts()
    scorers = _scorers(reference, reward, critic)
    gen, _, timing = stream_generate(actor, scorers, ids, mask, PARAMS,
                                     torch.Generator().manual_seed(SEED), chunk_size=4)
    assert isinstance(timing, StreamTiming)
    assert timing.chunks == -(-int(gen.lengths.max()) // 4)
    assert timing.decode_s > 0 and timing.wall_s >= timing.decode_s
    assert set(timing.scorers) == {"reward", "reference", "critic"}
    for t in timing.scorers.values():
        assert t.busy_s > 0 and 0 <= t.tail_s <= t.busy_s
    busy = sum(t.busy_s for t in timing.scorers.values())
    assert timing.decode_s + busy <= timing.wall_s + 1e-6  # inline: nothing runs concurrently


def test_chunk_tokens_reads_the_new_tokens():
    actor = _models("tiny-llama")[0]
    ids, mask = _prompts()
    from oppo_ds.rollout.generate import decode_steps, start_decode

    state = start_decode(actor, ids, mask, PARAMS)
    g = torch.Generator().manual_seed(SEED)
    decode_steps(actor, state, PARAMS, g, max_steps=2)
    rows, before = state.active.clone(), state.lengths[state.active].clone()
    decode_steps(actor, state, PARAMS, g, max_steps=5)
    tokens, counts = _chunk_tokens(state, rows, before)
    assert tokens.shape == (rows.numel(), int(counts.max()))
    for r, row in enumerate(rows.tolist()):
        n = int(counts[r])
        assert 1 <= n <= 5
        assert tokens[r, :n].tolist() == state.tokens[row, 2:2 + n].tolist()


@pytest.mark.parametrize("kind", ["reward", "reference", "critic"])
def test_sliding_window_scorers_are_refused(kind):
    """A streamed row's cache may hold masked columns between its tokens (a deferred row's
    partial response, padded to the longest, then its next chunks after the padding); a
    sliding window counts columns, so the scores differed from the whole sequence's (0.15 to
    1.4 on tiny Qwen2, window 4). Refused, naming what to change; full attention streams."""
    from transformers import AutoModelForCausalLM

    from oppo_ds.models import ValueHeadModel, tiny_config

    def build(config):
        return (AutoModelForCausalLM if kind == "reference" else ValueHeadModel).from_config(config)

    config = tiny_config("tiny-qwen2", VOCAB)
    StreamingScorer(build(config), kind)  # full attention: no complaint
    config.use_sliding_window, config.sliding_window = True, 4
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    model = build(config)
    with pytest.raises(ValueError, match=rf"^oppo.streaming: the {kind} model .* sliding-window "
                                         r"attention layers.*oppo.stream_to"):
        StreamingScorer(model, kind)


def test_errors():
    _, reference, reward, critic = _models("tiny-llama")
    with pytest.raises(ValueError, match="kind"):
        StreamingScorer(reward, "value")
    ids, mask = _prompts()
    scorer = StreamingScorer(critic, "critic")
    scorer.begin(ids, mask)
    with pytest.raises(ValueError, match="still holds"):
        scorer.begin(ids, mask)
    one = torch.tensor([1])
    scorer.consume(one, torch.tensor([[5, 6]]), torch.tensor([2]))
    assert scorer.finish(one)[1].shape == (2,)
    with pytest.raises(KeyError, match="row 1"):
        scorer.consume(one, torch.tensor([[5]]), torch.tensor([1]))
    scorer.reset()
    assert scorer.num_rows == 0
    with pytest.raises(ValueError, match="one scorer per kind"):
        stream_generate(_models("tiny-llama")[0], [StreamingScorer(reward, "reward")] * 2,
                        ids, mask, PARAMS, None, 4)


# ---------------------------------------------------------------- colocated placement

SCORER_THREAD = "oppo-colocated-scorers"


def _scorer_threads():
    return [t for t in threading.enumerate() if t.name == SCORER_THREAD]


def _run(placement, arch, chunk_size, device="cpu"):
    actor, reference, reward, critic = _models(arch)
    if device != "cpu":
        actor, reference, reward, critic = (copy.deepcopy(m).to(device)
                                            for m in (actor, reference, reward, critic))
    ids, mask = (t.to(device) for t in _prompts())
    scorers = _scorers(reference, reward, critic)
    gen, results, timing = stream_generate(
        actor, scorers, ids, mask, PARAMS, torch.Generator(device).manual_seed(SEED), chunk_size,
        placement=placement)
    return gen, results, timing, scorers


@pytest.mark.parametrize("arch,chunk_size", [(a, 3) for a in ARCHS] + [("tiny-llama", 1)])
def test_colocated_equals_inline(arch, chunk_size):
    """Same calls in the same order, only on another thread: bit-identical results."""
    gen_i, inline, timing_i, scorers_i = _run("inline", arch, chunk_size)
    gen_c, colocated, timing_c, scorers_c = _run("colocated", arch, chunk_size)
    for name in ("response_ids", "response_mask", "logprobs", "lengths"):
        assert torch.equal(getattr(gen_c, name), getattr(gen_i, name)), name
    assert set(colocated) == set(inline) == {"reward", "reference", "critic"}
    for kind in inline:
        assert torch.equal(colocated[kind], inline[kind]), kind
    # the same rows finished at the same chunks, and left the caches
    assert [s.finishes for s in scorers_c] == [s.finishes for s in scorers_i]
    assert all(s.num_rows == 0 and s.cache is None for s in scorers_c)
    assert timing_c.chunks == timing_i.chunks
    assert not _scorer_threads()


class FailingScorer(RecordingScorer):
    """Raises in its consume of the given chunk (0-based)."""

    def __init__(self, *args, fail_at, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_at, self.calls = fail_at, 0

    def consume(self, rows, tokens, lengths):
        self.calls += 1
        if self.calls > self.fail_at:
            raise RuntimeError("scorer exploded")
        return super().consume(rows, tokens, lengths)


class FailingActor(torch.nn.Module):
    """The actor's forward raises after ``calls`` forwards."""

    def __init__(self, model, calls):
        super().__init__()
        self.model, self.left = model, calls

    def forward(self, **kwargs):
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("actor exploded")
        return self.model(**kwargs)


@pytest.mark.parametrize("fail_at", [0, 2, 10_000])
def test_colocated_scorer_error_propagates(fail_at):
    """A scorer raising in the scorer thread (at the first chunk, mid-rollout, or never: then
    the actor fails instead) surfaces in the caller with the thread's frames in its traceback,
    and the thread is joined."""
    actor, reference, reward, critic = _models("tiny-llama")
    ids, mask = _prompts()
    threads_before = set(threading.enumerate())
    failing = FailingScorer(critic, "critic", fail_at=fail_at)
    scorers = [RecordingScorer(reward, "reward"), failing]
    if fail_at == 10_000:
        actor, message = FailingActor(actor, calls=5), "actor exploded"
    else:
        message = "scorer exploded"
    with pytest.raises(RuntimeError, match=message) as info:
        stream_generate(actor, scorers, ids, mask, PARAMS, torch.Generator().manual_seed(SEED),
                        chunk_size=2, placement="colocated")
    assert set(threading.enumerate()) == threads_before
    assert not _scorer_threads()
    if fail_at != 10_000:
        frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
        assert "consume" in frames and "_work" in frames  # the scorer thread's own frames
        assert failing.calls == fail_at + 1  # nothing queued after the failure ran


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_timing_invariants_and_chrome_trace(placement, tmp_path):
    gen, _, timing, _ = _run(placement, "tiny-qwen2", chunk_size=2)
    kinds = {"reward", "reference", "critic"}
    assert 0.0 <= timing.scoring_hidden_frac <= 1.0
    assert timing.scoring_tail_s >= 0.0
    assert timing.decode_end_s <= timing.scoring_end_s <= timing.wall_s
    assert timing.scoring_tail_s == pytest.approx(timing.scoring_end_s - timing.decode_end_s)
    busy = sum(t.busy_s for t in timing.scorers.values())
    assert timing.scoring_busy_s == pytest.approx(busy) and busy > 0
    tail = sum(t.tail_s for t in timing.scorers.values())
    assert timing.scoring_hidden_frac == pytest.approx((busy - tail) / busy)
    # rows end at different chunks, so some scoring lies before the last token in any placement
    assert timing.chunks > 1 and timing.scoring_hidden_frac > 0
    # concurrent with the actor's events: by hand from the intervals; none inline, where the
    # actor waits for every scorer call, however much of it lies before the last token
    actor_events = [e for e in timing.events if e.lane == "actor"]
    inside = sum(max(0.0, min(s.end_s, a.end_s) - max(s.start_s, a.start_s))
                 for s in timing.events if s.lane != "actor" for a in actor_events)
    assert timing.scoring_overlap_frac == pytest.approx(min(1.0, inside / busy))
    if placement == "inline":
        assert timing.scoring_overlap_frac == 0.0
    assert 0 < timing.start <= time.perf_counter() - timing.wall_s

    lanes = {}
    for e in timing.events:
        assert 0.0 <= e.start_s <= e.end_s <= timing.wall_s
        lanes.setdefault(e.lane, []).append(e)
    assert set(lanes) == {"actor"} | kinds
    actor = lanes["actor"]
    assert [e.name for e in actor] == ["prefill"] + [f"chunk {i}" for i in range(timing.chunks)]
    assert actor[-1].end_s == timing.decode_end_s
    assert timing.decode_s == pytest.approx(sum(e.end_s - e.start_s for e in actor))
    for kind in kinds:
        assert len(lanes[kind]) == 1 + 2 * timing.chunks  # begin, then consume + finish per chunk
        assert max(e.end_s for e in lanes[kind]) <= timing.scoring_end_s
    # one thread per lane in colocated: each lane's events follow one another; inline: every
    # event of every lane does
    groups = [timing.events] if placement == "inline" else list(lanes.values())
    for events in groups:
        for a, b in zip(events, events[1:]):
            assert a.end_s <= b.start_s, (a, b)

    path = chrome_trace(timing.events, tmp_path / "trace" / "rollout.json", step=3)
    trace = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in trace if e["ph"] == "X"]
    assert len(complete) == len(timing.events)
    names = {e["tid"]: e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert sorted(names.values()) == sorted({"actor"} | kinds)
    for e, event in zip(complete, timing.events):
        assert names[e["tid"]] == event.lane and e["name"] == event.name
        assert e["ts"] == pytest.approx(event.start_s * 1e6) and e["dur"] >= 0
        assert e["args"]["step"] == 3


def test_placement_errors():
    actor, _, reward, _ = _models("tiny-llama")
    ids, mask = _prompts()
    for placement in ("stage", "side"):
        with pytest.raises(ValueError, match="inline, colocated.*stage"):
            stream_generate(actor, [StreamingScorer(reward, "reward")], ids, mask, PARAMS, None,
                            4, placement=placement)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the colocated side stream")
@pytest.mark.parametrize("chunk_size", [1, 4])
def test_colocated_on_cuda_equals_inline(chunk_size):
    """On CUDA the scorer thread issues its kernels on a side stream that waits for the
    actor's stream: a scorer reading a chunk before the actor wrote it would score padding."""
    gen_i, inline, _, _ = _run("inline", "tiny-llama", chunk_size, device="cuda")
    gen_c, colocated, timing, scorers = _run("colocated", "tiny-llama", chunk_size, device="cuda")
    assert torch.equal(gen_c.response_ids, gen_i.response_ids)
    assert torch.equal(gen_c.lengths, gen_i.lengths)
    for kind in inline:
        assert colocated[kind].device.type == "cuda"
        assert (colocated[kind] - inline[kind]).abs().max().item() < ATOL_FP32, kind
    whole = _whole(*_models("tiny-llama")[1:], _to_cpu(gen_c))
    diffs = _max_diffs({k: v.cpu() for k, v in colocated.items()}, whole, _to_cpu(gen_c))
    assert max(diffs.values()) < 1e-4, diffs  # GPU vs CPU kernels: a looser bound
    assert 0.0 <= timing.scoring_hidden_frac <= 1.0 and timing.scoring_tail_s >= 0.0
    assert all(s.num_rows == 0 for s in scorers) and not _scorer_threads()


def _to_cpu(gen):
    return type(gen)(**{k: v.cpu() for k, v in vars(gen).items()})


def test_switch_interval_is_set_for_the_context_and_restored():
    """``system.switch_interval_ms``: Python's thread switch interval while a step runs, Python's
    own again after it, an exception too; 0 leaves it alone; a negative value names the key."""
    import sys

    from oppo_ds.config import ConfigError, load_config
    from oppo_ds.rollout.generate import switch_interval

    before = sys.getswitchinterval()
    with switch_interval(0.25):
        assert sys.getswitchinterval() == pytest.approx(0.25e-3)
    assert sys.getswitchinterval() == before
    with pytest.raises(RuntimeError, match="inside"):
        with switch_interval(1.0):
            raise RuntimeError("inside")
    assert sys.getswitchinterval() == before
    with switch_interval(0):
        assert sys.getswitchinterval() == before
    with pytest.raises(ConfigError, match="switch_interval_ms"):
        load_config(None, ["system.switch_interval_ms=-1"])
