"""Tier 0: the built-in long-tail workload: gold rule by hand, prompt parsing, tokenizer,
the length distribution's tail, and the supervised / preference data built from them."""

import math
import random
import statistics

import pytest

from oppo_ds import workload as wl
from oppo_ds.workload import Task, gold_score, parse_prompt, sample_length

TASK = Task("warm", ("q", "c"))
VALUE = wl.LETTER_VALUE["warm"]


def test_letter_values_are_a_fixed_table():
    assert set(wl.LETTER_VALUE) == set(wl.MOODS)
    for mood in wl.MOODS:
        assert set(wl.LETTER_VALUE[mood]) == set(wl.LETTERS)
        assert all(-1.0 <= v <= 1.0 for v in wl.LETTER_VALUE[mood].values())
    # moods disagree, so the prompt matters
    assert wl.LETTER_VALUE["warm"] != wl.LETTER_VALUE["cool"]


@pytest.mark.parametrize("response, expected", [
    (["a"], lambda v: v["a"]),
    (["a", "b"], lambda v: (v["a"] + v["b"]) / 2),
    (["a", "a", "x"], lambda v: (2 * v["a"] + v["x"]) / 3),         # a per-token mean
    (["a", "<eos>"], lambda v: v["a"]),                              # EOS is not counted
    (["b", "->", "<pad>", "warm", "<unk>"], lambda v: v["b"]),       # only letters count
    ([], lambda v: -1.0),                                            # no letters: the worst
    (["<eos>"], lambda v: -1.0),
])
def test_gold_score_by_hand(response, expected):
    assert gold_score(TASK, response) == pytest.approx(expected(VALUE))


def test_gold_score_extremes_and_context_ignored():
    best = max(wl.LETTERS, key=VALUE.get)
    worst = min(wl.LETTERS, key=VALUE.get)
    assert gold_score(TASK, [best] * 5) == pytest.approx(VALUE[best])
    assert gold_score(TASK, [worst, best]) == pytest.approx((VALUE[worst] + VALUE[best]) / 2)
    # the context letters vary the prompt only; the mood sets the rule
    assert gold_score(Task("warm", ("a",)), ["b", "c"]) == gold_score(TASK, ["b", "c"])
    assert gold_score(Task("cool", ("q", "c")), ["a"]) == pytest.approx(wl.LETTER_VALUE["cool"]["a"])


def test_gold_score_does_not_pay_for_length():
    assert gold_score(TASK, ["a", "d"]) == pytest.approx(gold_score(TASK, ["a", "d"] * 20))


def test_prompt_text():
    assert TASK.prompt == "warm q c ->"


def test_prompt_round_trip():
    rng = random.Random(0)
    lengths = set()
    for _ in range(300):
        task = wl.sample_task(rng)
        assert task.mood in wl.MOODS and set(task.context) <= set(wl.LETTERS)
        lengths.add(len(task.context))
        assert parse_prompt(task.prompt.split()) == task
        assert parse_prompt(["<bos>", *task.prompt.split()]) == task
        assert parse_prompt(["<pad>", "<pad>", "<bos>", *task.prompt.split()]) == task
    assert lengths == set(range(2, 9))  # prompts of varied length


@pytest.mark.parametrize("tokens", [
    ["hello", "world"],
    ["a", "b", "->"],            # no mood
    ["warm", "a", "b"],          # no arrow
    ["->", "warm", "a"],         # arrow before the mood
    [],
])
def test_parse_prompt_rejects_other_text(tokens):
    assert parse_prompt(tokens) is None


def test_tokenizer_encodes_with_bos_and_decodes_back():
    tok = wl.build_tokenizer()
    assert len(tok) == len(wl.VOCAB)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (wl.PAD_ID, wl.BOS_ID, wl.EOS_ID)
    assert tok.padding_side == "left"
    prompt = wl.make_prompts(1, seed=0)[0]["prompt"]
    ids = tok(prompt)["input_ids"]
    assert ids[0] == wl.BOS_ID and ids.count(wl.BOS_ID) == 1
    assert ids == [wl.BOS_ID] + [wl.VOCAB.index(t) for t in prompt.split()]
    assert tok.decode(ids, skip_special_tokens=True) == prompt
    assert parse_prompt(tok.convert_ids_to_tokens(ids)) == parse_prompt(prompt.split())
    assert tok.convert_ids_to_tokens(tok("zz")["input_ids"]) == ["<bos>", "<unk>"]


def test_tokenizer_pads_on_the_left():
    tok = wl.build_tokenizer()
    batch = tok(["warm a ->", "cool a b c ->"], padding=True)
    assert batch["input_ids"][0][:2] == [wl.PAD_ID, wl.PAD_ID]
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1]
    assert batch["input_ids"][0][-1] == batch["input_ids"][1][-1] == wl.VOCAB.index("->")


def test_sample_length_has_a_long_tail():
    """Default settings: median 8, sigma 0.9, capped at 95 tokens; p99 / median ~ 8 (>= 5)."""
    rng = random.Random(0)
    lengths = sorted(sample_length(rng, 8, 0.9, 95) for _ in range(20000))
    median = statistics.median(lengths)
    p99 = lengths[int(0.99 * len(lengths))]
    assert 7 <= median <= 9
    assert p99 >= 5 * median
    assert p99 == pytest.approx(8 * math.exp(2.33 * 0.9), rel=0.15)
    assert lengths[0] >= 1 and lengths[-1] <= 95


def test_sample_length_bounds():
    rng = random.Random(1)
    assert all(sample_length(rng, 8, 3.0, 20) <= 20 for _ in range(2000))
    assert all(sample_length(rng, 1, 3.0, 20) >= 1 for _ in range(2000))
    assert sample_length(rng, 8, 0.0, 95) == 8


def test_sft_examples_follow_the_workload():
    rng = random.Random(2)
    for _ in range(100):
        prompt, response = wl.sft_example(rng, 8, 0.9, 95)
        assert parse_prompt(prompt.split()) is not None
        letters = response.split()
        assert 1 <= len(letters) <= 95 and set(letters) <= set(wl.LETTERS)


def test_preference_pairs_ordered_by_gold():
    rng = random.Random(3)
    for _ in range(100):
        prompt, chosen, rejected = wl.preference_pair(rng, 8, 0.9, 95)
        task = parse_prompt(prompt.split())
        assert task is not None
        assert gold_score(task, chosen.split()) > gold_score(task, rejected.split())


def test_make_prompts_deterministic():
    a, b = wl.make_prompts(50, seed=4), wl.make_prompts(50, seed=4)
    assert a == b and a != wl.make_prompts(50, seed=5)
    assert len({p["id"] for p in a}) == 50
    assert all(parse_prompt(p["prompt"].split()) is not None for p in a)
