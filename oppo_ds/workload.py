"""The built-in long-tail workload: a procedurally generated task that needs no download.

A prompt names a *mood* and a few context letters:

    <bos> warm q c k ->

and a response is a run of letters ended by <eos>. The hidden rule, the **gold score**, gives
every letter a value in [-1, 1] that depends on the mood (a fixed table drawn from a seeded
RNG) and scores a response by the mean value of its letters: a per-token mean, so it does not
pay for length. Length comes from the supervised data: lengths are log-normal (median
``median_len``, spread ``tail_sigma``), which gives the long tail of real RLHF responses
(p99 = median * exp(2.33 sigma), 8x the median at sigma 0.9).

The learned reward model only sees preference pairs labelled by the gold rule, so where the
policy finds what the reward model over-rates, reward rises and gold does not: both are logged.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

LETTERS = tuple("abcdefghijklmnopqrstuvwx")
MOODS = ("calm", "bold", "warm", "cool")
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
VOCAB = SPECIALS + ("->",) + MOODS + LETTERS
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_ID = {tok: i for i, tok in enumerate(VOCAB)}
_table_rng = random.Random(2026)  # the hidden rule is a constant of the workload
LETTER_VALUE = {mood: {letter: _table_rng.uniform(-1.0, 1.0) for letter in LETTERS} for mood in MOODS}


def build_tokenizer():
    """A Hugging Face fast tokenizer over VOCAB, built here (nothing downloaded); it adds
    <bos> in front of every text, like the tokenizers of Llama-family models."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=dict(_ID), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS_ID)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                  pad_token="<pad>", unk_token="<unk>", padding_side="left")
    return tok


@dataclass(frozen=True)
class Task:
    mood: str
    context: tuple[str, ...]

    @property
    def prompt(self) -> str:
        return " ".join((self.mood,) + self.context + ("->",))


def sample_task(rng: random.Random) -> Task:
    """A mood and 2-8 context letters (they vary the prompt length; the rule ignores them)."""
    return Task(rng.choice(MOODS), tuple(rng.sample(LETTERS, rng.randint(2, 8))))


def parse_prompt(tokens: list[str]) -> Task | None:
    """The task a (decoded, whitespace-split) prompt names, or None when it is not one of ours."""
    moods = [i for i, t in enumerate(tokens) if t in MOODS]
    if not moods or "->" not in tokens[moods[0]:]:
        return None
    start, end = moods[0], tokens.index("->", moods[0])
    return Task(tokens[start], tuple(tokens[start + 1:end]))


def gold_score(task: Task, response: list[str]) -> float:
    """The hidden rule: mean mood-dependent value of the response's letters (EOS not
    counted); -1 (the worst) for a response without letters."""
    values = [LETTER_VALUE[task.mood][t] for t in response if t in LETTER_VALUE[task.mood]]
    return sum(values) / len(values) if values else -1.0


def gold_reward(prompts: list[str], completions: list[str], **fields) -> list[float]:
    """The hidden rule as a reward function (``model.reward_function:
    oppo_ds.workload:gold_reward``): each completion's gold score for its prompt; a prompt
    that names no task scores -1. What a verifiable reward is to a real task: the policy then
    trains on the rule itself, not on a reward model's picture of it."""
    out = []
    for prompt, completion in zip(prompts, completions):
        task = parse_prompt(prompt.split()) if isinstance(prompt, str) else None
        out.append(gold_score(task, completion.split()) if task else -1.0)
    return out


def sample_length(rng: random.Random, median_len: int, tail_sigma: float, max_len: int) -> int:
    """A response length from the long-tailed (log-normal) distribution, in [1, max_len]."""
    return max(1, min(max_len, round(math.exp(rng.gauss(math.log(median_len), tail_sigma)))))


def sample_response(rng: random.Random, task: Task, length: int, tilt: float) -> list[str]:
    """``length`` letters drawn with probability proportional to exp(tilt * value): tilt 0 is
    uniform, positive tilts write better responses, negative ones worse."""
    weights = [math.exp(tilt * LETTER_VALUE[task.mood][letter]) for letter in LETTERS]
    return rng.choices(LETTERS, weights=weights, k=length)


def sft_example(rng: random.Random, median_len: int, tail_sigma: float, max_len: int):
    """(prompt text, response text) for supervised tuning: a writer slightly better than
    chance (tilt 0.5), so PPO has room to improve."""
    task = sample_task(rng)
    n = sample_length(rng, median_len, tail_sigma, max_len)
    return task.prompt, " ".join(sample_response(rng, task, n, 0.5))


def preference_pair(rng: random.Random, median_len: int, tail_sigma: float, max_len: int):
    """(prompt, chosen, rejected) labelled by the gold rule. The two responses get independent
    lengths and tilts, so the reward model learns letter values, not length."""
    task = sample_task(rng)
    while True:
        a, b = (sample_response(rng, task, sample_length(rng, median_len, tail_sigma, max_len),
                                rng.uniform(-3.0, 3.0)) for _ in range(2))
        ga, gb = gold_score(task, a), gold_score(task, b)
        if ga != gb:
            break
    chosen, rejected = (a, b) if ga > gb else (b, a)
    return task.prompt, " ".join(chosen), " ".join(rejected)


def make_prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"builtin-{i}", "prompt": sample_task(rng).prompt} for i in range(n)]


def held_out_prompts(n: int, seed: int, exclude: set[str]) -> list[dict]:
    """``n`` distinct prompts of the task, none of them in ``exclude`` (the training prompts'
    texts), drawn with their own seed: the built-in evaluation set."""
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < n:
        text = sample_task(rng).prompt
        if text not in seen:
            seen.add(text)
            out.append({"id": f"builtin-eval-{len(out)}", "prompt": text})
    return out


# ---- the length-oracle workload (speed benchmarks of models with random weights) -------

ORACLE_TINY_VOCAB = 4096  # vocabulary of a tiny architecture under the oracle


def build_oracle_tokenizer(vocab_size: int):
    """A tokenizer of ``vocab_size`` ids for models built from config: the four specials, then
    placeholder tokens ``<tN>``. The oracle's prompts are token ids and its responses are never
    read as text; the tokenizer is there for the pad / eos ids and for exports."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIALS):
        raise ValueError(f"vocab_size must exceed {len(SPECIALS)}, got {vocab_size}")
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"<t{i}>": i for i in range(len(SPECIALS), vocab_size)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


def run_oracle_prompts(cfg, vocab_size: int):
    """The length oracle's prompts of a run with config ``cfg`` (its ``workload``, seed and
    ``generation.max_new_tokens``): the same for our trainer and the TRL peer."""
    w = cfg.workload
    return oracle_prompts(w.num_prompts, vocab_size, cfg.seed, w.median_len, w.tail_sigma,
                          cfg.generation.max_new_tokens)


def oracle_prompts(num: int, vocab_size: int, seed: int, median_len: int, tail_sigma: float,
                   max_new_tokens: int, prompt_len: tuple[int, int] = (8, 32)):
    """``num`` prompts of random token ids with a target response length each, drawn from the
    same log-normal as the task's supervised data (median ``median_len``, spread
    ``tail_sigma``), clipped to [1, max_new_tokens]: the decode loop ends a row there
    (``start_decode(targets=...)``), so a model with random weights has the long tail of a
    trained one."""
    from .data import Prompt

    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        n = rng.randint(*prompt_len)
        ids = [BOS_ID] + [rng.randrange(len(SPECIALS), vocab_size) for _ in range(n - 1)]
        target = int(round(math.exp(math.log(median_len) + tail_sigma * rng.gauss(0.0, 1.0))))
        prompts.append(Prompt(id=f"oracle-{i}", input_ids=ids, source="length-oracle", line=i + 1,
                              unit="prompt", target_len=min(max(target, 1), max_new_tokens)))
    return prompts
