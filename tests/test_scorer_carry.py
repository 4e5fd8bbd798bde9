"""Tier 2: scorer rows carried across steps score what whole sequences score.

With inter-step overlap a step ends when B of its B+D sequences have finished; the others are
deferred and go on in the next step. The frozen scorers (reward, reference) keep a deferred
row's KV cache and take the next step's rows into the same cache (``add``), the critic drops
the row and re-adds it with its partial response as a prefix, and ``state_dict`` /
``load_state_dict`` move rows to another scorer object. Every path must give what
``experience.sequence_scores`` / ``response_logprobs`` / ``response_values`` give on the whole
sequence, and moving rows must not change a single score beyond float noise.

Sequences here are drawn directly (random prompt and response tokens), not sampled by an
actor: the scorers only see tokens, and direct draws fix the lengths each test needs.
"""
from typing import NamedTuple

import pytest
import torch

from _builders import sharpen

from oppo_ds.experience import response_logprobs, response_values, sequence_scores
from oppo_ds.models import build_causal_lm, build_value_model
from oppo_ds.rollout.streaming import StreamingScorer

VOCAB = 40
PAD = 0
ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-gpt2"]
KINDS = ("reward", "reference", "critic")
ATOL_FP32 = 1e-5   # streamed vs whole sequence: other matmul shapes, other summation order
# a row moved (saved and loaded, compacted) vs the same row never moved: the same numbers in
# another batch layout, so only the summation order inside the kernels differs, a few fp32
# ulps (2^-23 ~ 1.2e-7 relative). Measured: values (|v| < 1) 3e-7, log-probs (|lp| up to 8)
# 9.5e-7, i.e. 2 ulps of 4.8e-7: within 1e-6 absolute today, but a log-prob beyond 8 would
# reach 1.9e-6 with the same 2 ulps, so the bound is 1e-6 per unit of magnitude (at least 1)
RTOL_MOVED = 1e-6
TEMPERATURE = 0.7  # the reference's: not 1, so a missing division would show

# conftest's module fixture: one intra-op thread, the old value restored after this module
pytestmark = pytest.mark.usefixtures("torch_one_thread")

_MODELS = {}


def _models(arch):
    """{kind: model}, fp32, weights far from the default init (see ``sharpen``)."""
    if arch not in _MODELS:
        _MODELS[arch] = {
            "reference": sharpen(build_causal_lm(arch, vocab_size=VOCAB, seed=1), seed=21),
            "reward": sharpen(build_value_model(arch, vocab_size=VOCAB, seed=2), seed=22),
            "critic": sharpen(build_value_model(arch, vocab_size=VOCAB, seed=3), seed=23),
        }
    return _MODELS[arch]


def _scorers(arch, kinds=KINDS):
    models = _models(arch)
    return [StreamingScorer(models[k], k, TEMPERATURE if k == "reference" else 1.0)
            for k in kinds]


class Seq(NamedTuple):
    prompt: list
    response: list


def _seqs(prompt_lens, response_lens, seed) -> list:
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    return [Seq(draw(p), draw(r)) for p, r in zip(prompt_lens, response_lens)]


def _left_pad(prompts):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def _right_pad(seqs, width=None):
    width = max(map(len, seqs)) if width is None else width
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return ids, torch.tensor([len(s) for s in seqs], dtype=torch.long)


@torch.no_grad()
def _whole(arch, seqs: dict) -> dict:
    """The sequential step's scoring, one forward over prompt + whole response, as
    {kind: {id: result}}."""
    ids = list(seqs)
    prompt_ids, prompt_mask = _left_pad([seqs[i].prompt for i in ids])
    response_ids, lengths = _right_pad([seqs[i].response for i in ids])
    response_mask = (torch.arange(response_ids.shape[1])[None, :] < lengths[:, None]).float()
    args = (prompt_ids, prompt_mask, response_ids, response_mask)
    m = _models(arch)
    batch = {"reward": sequence_scores(m["reward"], *args),
             "reference": response_logprobs(m["reference"], *args, TEMPERATURE)[0].float(),
             "critic": response_values(m["critic"], *args)}
    out = {"reward": dict(zip(ids, batch["reward"]))}
    for kind in ("reference", "critic"):
        out[kind] = {i: batch[kind][r, :n] for r, (i, n) in enumerate(zip(ids, lengths.tolist()))}
    return out


def _max_diff(a: dict, b: dict, per_magnitude: bool = False) -> float:
    """Largest |a - b| over every kind and row (``per_magnitude``: over max(1, |b|)); both
    must hold the same rows and shapes."""
    worst = 0.0
    for kind in a:
        assert set(a[kind]) == set(b[kind]), kind
        for row in a[kind]:
            x, y = a[kind][row], b[kind][row]
            assert x.shape == y.shape, (kind, row)
            diff = (x - y).abs() / (y.abs().clamp(min=1) if per_magnitude else 1)
            worst = max(worst, diff.max().item())
    return worst


class Driver:
    """Feeds sequences {id: Seq} to scorers the way a rollout would: ``add`` a step's rows
    (optionally with a prefix of their response), ``step`` one decode chunk to the open rows,
    ``finish`` each row once its whole response has been fed. results[kind][id]."""

    def __init__(self, scorers, seqs: dict):
        self.scorers, self.seqs = scorers, seqs
        self.fed: dict = {}
        self.results = {s.kind: {} for s in scorers}

    def add(self, ids, prefix: dict = None, scorers=None):
        prompt_ids, prompt_mask = _left_pad([self.seqs[i].prompt for i in ids])
        extra = {}
        if prefix is not None:
            parts = [self.seqs[i].response[:prefix.get(i, 0)] for i in ids]
            # one column wider than the longest prefix: padding in every row
            extra = dict(zip(("prefix_ids", "prefix_lengths"),
                             _right_pad(parts, max(map(len, parts)) + 1)))
        for s in scorers or self.scorers:
            s.add(torch.tensor(ids), prompt_ids, prompt_mask, **extra)
        for i in ids:
            self.fed[i] = prefix.get(i, 0) if prefix else 0
        self._finish(ids, scorers)

    def open_rows(self) -> list:
        return [i for i, n in self.fed.items() if n < len(self.seqs[i].response)]

    def step(self, chunk: int, g: torch.Generator = None, rows=None, scorers=None):
        """Up to ``chunk`` tokens for each open row (or ``rows``); with ``g`` a random 1..chunk
        per row, as rows that ended inside a chunk have fewer."""
        rows = self.open_rows() if rows is None else rows
        want = (torch.randint(1, chunk + 1, (len(rows),), generator=g).tolist() if g is not None
                else [chunk] * len(rows))
        parts = []
        for i, w in zip(rows, want):
            n = self.fed[i]
            parts.append(self.seqs[i].response[n:n + w])
            self.fed[i] += len(parts[-1])
        tokens, counts = _right_pad(parts)
        for s in scorers or self.scorers:
            s.consume(torch.tensor(rows), tokens, counts)
        self._finish(rows, scorers)

    def _finish(self, rows, scorers=None):
        done = [i for i in rows if self.fed[i] == len(self.seqs[i].response)]
        for s in scorers or self.scorers:
            self.results[s.kind].update(s.finish(done))


def _every_column_used(scorer) -> bool:
    return bool(scorer.cache_mask.bool().any(0).all())


# ---------------------------------------------------------------- carried rows

@pytest.mark.parametrize("arch", ARCHS)
def test_carried_rows_merge_with_new_rows(arch):
    """Three steps of one carrying scorer per kind: step 1's unfinished rows stay cached while
    step 2 adds rows with NARROWER prompts than the held cache (the new rows are left-padded)
    and step 3 one row with a WIDER prompt (the held rows are); chunk sizes vary per row and
    per round. Row ids are arbitrary, not 0..B-1."""
    seqs = dict(zip([100, 3, 57, 8, 21, 42], _seqs([3, 7, 5, 6, 2, 4], [9, 4, 13, 7, 3, 11], 1)))
    seqs.update(zip([5, 77, 13], _seqs([4, 2, 6], [6, 10, 2], 2)))
    seqs[64] = _seqs([19], [5], 3)[0]
    scorers = _scorers(arch)
    d = Driver(scorers, seqs)
    g = torch.Generator().manual_seed(0)

    d.add([100, 3, 57, 8, 21, 42])
    d.step(3)
    d.step(3)
    carried = d.open_rows()
    assert carried and len(carried) < 6  # some finished in step 1, some go on

    widths = {s.cache_width for s in scorers}
    assert len(widths) == 1 and 6 < min(widths)  # wider than any of step 2's prompts
    d.add([5, 77, 13])
    assert all(s.num_rows == len(d.open_rows()) for s in scorers)
    assert all(_every_column_used(s) for s in scorers)  # compacted before merging
    d.step(4, g)
    d.step(2, g)

    assert all(s.cache_width < 19 for s in scorers)  # step 3's prompt is the wider
    d.add([64])
    assert all(s.cache_width == 19 for s in scorers)  # its width: the held rows were padded
    while d.open_rows():
        d.step(5, g)

    assert all(s.num_rows == 0 and s.cache is None for s in scorers)
    diff = _max_diff(d.results, _whole(arch, seqs))
    assert diff < ATOL_FP32, diff


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_add_and_critic_rebuild(arch):
    """``add`` with prefixes of different lengths (0 for some rows, the whole response for
    one, which then finishes at once) into a scorer already holding rows; and the critic's
    deferred-row path: ``drop`` a row mid-response and re-add it with what it has so far."""
    seqs = dict(zip([0, 1], _seqs([5, 3], [8, 6], 4)))
    seqs.update(zip([10, 11, 12, 13, 14], _seqs([4, 6, 2, 5, 3], [7, 9, 3, 5, 6], 5)))
    scorers = _scorers(arch)
    d = Driver(scorers, seqs)
    d.add([0, 1])
    d.step(3)

    prefix = {10: 0, 11: 4, 12: 3, 13: 0, 14: 2}  # 12: its whole response
    d.add([10, 11, 12, 13, 14], prefix=prefix)
    assert all(12 in s_results for s_results in d.results.values())  # finished at once
    assert d.results["reference"][12].shape == (3,)
    d.step(2)

    # row 11 is deferred: drop it and rebuild from prompt + the 6 tokens it has by now
    assert d.fed[11] == 6
    for s in scorers:
        held = s.num_rows
        s.drop([11])
        assert s.num_rows == held - 1
        with pytest.raises(KeyError, match="row 11"):
            s.consume(torch.tensor([11]), torch.tensor([[5]]), torch.tensor([1]))
    d.add([11], prefix={11: 6})
    while d.open_rows():
        d.step(3)

    assert all(s.num_rows == 0 for s in scorers)
    whole = _whole(arch, seqs)
    diff = _max_diff(d.results, whole)
    assert diff < ATOL_FP32, diff


# ---------------------------------------------------------------- state_dict

def _assert_plain(value):
    """Only CPU tensors and python scalars / strings / lists / dicts / None."""
    if isinstance(value, torch.Tensor):
        assert value.device.type == "cpu"
    elif isinstance(value, dict):
        for v in value.values():
            _assert_plain(v)
    elif isinstance(value, list):
        for v in value:
            _assert_plain(v)
    else:
        assert value is None or isinstance(value, (int, float, str)), type(value)


@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_round_trip(arch, tmp_path):
    """Rows moved mid-response through torch.save / torch.load into NEW scorer objects that
    already hold other rows go on to the same scores as on a scorer that never let them go.

    ``kept`` never moves; ``moving`` feeds the same tokens, saves some rows, drops them, and a
    fresh scorer loads them next to a new row of its own."""
    seqs = dict(zip([7, 2, 30, 4, 15], _seqs([3, 6, 5, 2, 4], [10, 3, 8, 9, 7], 6)))
    seqs[99] = _seqs([8], [6], 7)[0]
    kept, moving = _scorers(arch), _scorers(arch)
    d_kept, d_src = Driver(kept, seqs), Driver(moving, seqs)
    for d in (d_kept, d_src):
        d.add([7, 2, 30, 4, 15])
        d.step(2)
        d.step(2)
    moved = [30, 7, 4]
    assert set(moved) <= set(d_src.open_rows())

    fresh = _scorers(arch)
    for src, dst in zip(moving, fresh):
        state = src.state_dict(moved)
        src.drop(moved)
        _assert_plain(state)
        assert state["kind"] == src.kind and state["rows"] == moved
        # only real positions are saved: each row's prompt and the 4 response tokens fed
        lengths = [len(seqs[i].prompt) + 4 for i in moved]
        assert state["lengths"] == lengths
        assert all(k.shape[0] == sum(lengths) for k in state["keys"] + state["values"])
        assert state["next_position"].tolist() == lengths
        if src.kind != "reward":
            assert [t.shape for t in state["scored"]] == [(4,)] * len(moved)
        path = tmp_path / f"{src.kind}.pt"
        torch.save(state, path)
        loaded = torch.load(path, weights_only=True)
        # an empty scorer adopts the loaded rows as its whole state: going on there must not
        # write into the loaded tensors, which dst loads next
        snapshot = {k: loaded[k].clone() for k in ("next_position", "pending")}
        twin = StreamingScorer(src.model, src.kind, src.temperature)
        twin.load_state_dict(loaded)
        twin.consume(torch.tensor(moved), torch.full((len(moved), 1), 9),
                      torch.ones(len(moved), dtype=torch.long))
        assert all(torch.equal(loaded[k], v) for k, v in snapshot.items())
        dst.add(torch.tensor([99]), *_left_pad([seqs[99].prompt]))
        dst.load_state_dict(loaded)
        assert dst.num_rows == 1 + len(moved)
    d_dst = Driver(fresh, seqs)
    d_dst.fed = {i: d_src.fed.pop(i) for i in moved} | {99: 0}
    d_kept.add([99])

    g = torch.Generator().manual_seed(1)
    while d_kept.open_rows():
        # the same chunk for every row on both sides: the open rows of src and dst together
        # are those of kept
        assert sorted(d_src.open_rows() + d_dst.open_rows()) == sorted(d_kept.open_rows())
        want = int(torch.randint(1, 4, (1,), generator=g))
        for d in (d_kept, d_src, d_dst):
            if d.open_rows():
                d.step(want)
    assert all(s.num_rows == 0 for s in kept + moving + fresh)

    merged = {k: d_src.results[k] | d_dst.results[k] for k in KINDS}
    assert set(d_dst.results["reward"]) == set(moved) | {99}
    moved_diff = _max_diff(merged, d_kept.results, per_magnitude=True)
    assert moved_diff < RTOL_MOVED, moved_diff
    diff = _max_diff(merged, _whole(arch, seqs))
    assert diff < ATOL_FP32, diff


# ---------------------------------------------------------------- compaction

@pytest.mark.parametrize("arch", ARCHS)
def test_compact_drops_dead_columns_exactly(arch):
    """Columns only finished rows were real in (the longest prompt's head, a chunk only one
    row filled) are masked in every row left; compact drops exactly those, from the K/V
    tensors too, and no score changes."""
    seqs = dict(zip(range(4), _seqs([9, 3, 4, 2], [3, 8, 6, 7], 8)))
    compacted, plain = _scorers(arch), _scorers(arch)
    d_c, d_p = Driver(compacted, seqs), Driver(plain, seqs)
    for d in (d_c, d_p):
        d.add([0, 1, 2, 3])
        d.step(1)
        d.step(2, rows=[0])  # row 0 ends here, in 2 columns no other row is real in
        d.step(1, rows=[2, 3])
    assert 0 in d_c.results["reward"] and 0 not in d_c.open_rows()

    for s in compacted:
        dead = int((~s.cache_mask.bool().any(0)).sum())
        width = s.cache_width
        assert dead == 5 + 2  # the 9-token prompt's first 9 - 4, and row 0's last chunk
        assert s.compact() == dead
        assert s.cache_width == width - dead and _every_column_used(s)
        assert all(layer.keys.shape[2] == layer.values.shape[2] == s.cache_width
                   for layer in s.cache.layers)
        assert s.compact() == 0
    while d_p.open_rows():
        for d in (d_c, d_p):
            d.step(2)

    diff = _max_diff(d_c.results, d_p.results, per_magnitude=True)
    assert diff < RTOL_MOVED, diff
    diff = _max_diff(d_c.results, _whole(arch, seqs))
    assert diff < ATOL_FP32, diff


# ---------------------------------------------------------------- errors

def test_errors():
    seqs = dict(zip([7, 8], _seqs([3, 4], [4, 4], 9)))
    critic, reference = _scorers("tiny-llama", ("critic", "reference"))
    d = Driver([critic, reference], seqs)
    d.add([7, 8])
    prompt = _left_pad([seqs[7].prompt])
    with pytest.raises(ValueError, match="row 7 is already in the critic scorer"):
        critic.add([7], *prompt)
    with pytest.raises(ValueError, match="row 5 appears twice"):
        critic.add([5, 5], *_left_pad([seqs[7].prompt] * 2))
    with pytest.raises(ValueError, match="left-padded"):
        critic.add([5], torch.tensor([[4, 0]]), torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="prefix_lengths"):
        critic.add([5], *prompt, prefix_ids=torch.tensor([[4]]), prefix_lengths=torch.tensor([2]))
    assert critic.num_rows == 2  # nothing half-added

    state = reference.state_dict([7])
    with pytest.raises(ValueError, match="'reference'.*'critic'"):
        StreamingScorer(_models("tiny-llama")["critic"], "critic").load_state_dict(state)
    with pytest.raises(ValueError, match="temperature"):
        StreamingScorer(_models("tiny-llama")["reference"], "reference").load_state_dict(state)
    with pytest.raises(ValueError, match="row 7 is already"):
        reference.load_state_dict(state)
    with pytest.raises(KeyError, match="row 9"):
        critic.drop([9])
    # begin is for an empty scorer only, as before
    with pytest.raises(ValueError, match="still holds"):
        critic.begin(*prompt)
