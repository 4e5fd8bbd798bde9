"""Prepare the built-in workload, like DeepSpeed-Chat's steps 1 and 2: supervised tuning of a
tiny actor and training of a tiny reward model on preference pairs from the hidden rule.

Everything is written as ordinary Hugging Face checkpoint directories (config.json +
safetensors + tokenizer), so the trainer loads them through the same code path as a user's
own checkpoints. The result is cached under a key of every setting that shapes it, written to
a temporary directory first and renamed, so an interrupted prepare leaves nothing half-made.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import workload as wl
from .models import ValueHeadModel, build_causal_lm

logger = logging.getLogger(__name__)

PREPARE_VERSION = 1  # bump when the recipe below changes, to invalidate old caches


@dataclass(frozen=True)
class PreparedWorkload:
    root: str

    @property
    def actor(self) -> str:
        return os.path.join(self.root, "actor")

    @property
    def reward(self) -> str:
        return os.path.join(self.root, "reward")

    @property
    def tokenizer(self) -> str:
        return os.path.join(self.root, "actor")

    @property
    def prompts(self) -> str:
        return os.path.join(self.root, "prompts.jsonl")

    def meta(self) -> dict:
        with open(os.path.join(self.root, "meta.json")) as f:
            return json.load(f)


def _key(settings: dict) -> str:
    blob = json.dumps({**settings, "version": PREPARE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def prepare_builtin(cache_dir: str, *, arch: str, seed: int, num_prompts: int, sft_steps: int,
                    reward_steps: int, median_len: int, tail_sigma: float,
                    max_new_tokens: int, build: bool = True) -> PreparedWorkload:
    """Return the cached workload for these settings, building it first when missing.
    ``build=False``: for a rank that reads what rank 0 prepared; ``FileNotFoundError`` (naming the
    folder) when it is missing."""
    settings = dict(arch=arch, seed=seed, num_prompts=num_prompts, sft_steps=sft_steps,
                    reward_steps=reward_steps, median_len=median_len, tail_sigma=tail_sigma,
                    max_new_tokens=max_new_tokens)
    root = os.path.join(cache_dir, f"{arch}-{_key(settings)}")
    if os.path.isfile(os.path.join(root, "meta.json")):
        return PreparedWorkload(root)
    if not build:
        raise FileNotFoundError(os.path.abspath(root))
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".prepare-", dir=cache_dir)
    try:
        meta = _build(tmp, settings)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
        try:
            os.rename(tmp, root)
        except OSError:  # another process finished the same key first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PreparedWorkload(root)


def _build(out: str, s: dict) -> dict:
    t0 = time.time()
    rng = random.Random(s["seed"])
    tok = wl.build_tokenizer()
    max_len = s["max_new_tokens"] - 1  # room for <eos>
    with open(os.path.join(out, "prompts.jsonl"), "w") as f:
        for row in wl.make_prompts(s["num_prompts"], s["seed"] + 1):
            f.write(json.dumps(row) + "\n")

    actor = build_causal_lm(s["arch"], vocab_size=len(wl.VOCAB), seed=s["seed"])
    sft_loss = _train_sft(actor, tok, rng, s["sft_steps"], s["median_len"], s["tail_sigma"], max_len)
    actor.save_pretrained(os.path.join(out, "actor"), safe_serialization=True)
    tok.save_pretrained(os.path.join(out, "actor"))

    # The reward model starts from the tuned actor's body, as DeepSpeed-Chat's step 2 starts
    # from a pretrained LM.
    reward = ValueHeadModel.from_pretrained(os.path.join(out, "actor"))
    rm_acc = _train_reward(reward, tok, rng, s["reward_steps"], s["median_len"], s["tail_sigma"], max_len)
    reward.save_pretrained(os.path.join(out, "reward"))
    tok.save_pretrained(os.path.join(out, "reward"))

    length_rng = random.Random(7)
    lengths = sorted(wl.sample_length(length_rng, s["median_len"], s["tail_sigma"], max_len)
                     for _ in range(4000))
    meta = dict(settings=s, sft_final_loss=sft_loss, reward_heldout_accuracy=rm_acc,
                sft_length_median=lengths[len(lengths) // 2],
                sft_length_p99=lengths[int(len(lengths) * 0.99)], prepare_s=time.time() - t0)
    logger.info("prepared built-in workload in %.1fs: %s", meta["prepare_s"], meta)
    return meta


def _right_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1
    return ids, mask


def _train_sft(model, tok, rng, steps, median_len, tail_sigma, max_len, batch=32, lr=2e-3) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss_value = float("nan")
    for _ in range(steps):
        seqs, starts = [], []
        for _ in range(batch):
            prompt, response = wl.sft_example(rng, median_len, tail_sigma, max_len)
            p = tok(prompt)["input_ids"]
            r = tok(response, add_special_tokens=False)["input_ids"] + [wl.EOS_ID]
            seqs.append(p + r)
            starts.append(len(p))
        ids, mask = _right_pad(seqs, wl.PAD_ID)
        labels = ids.masked_fill(mask == 0, -100)
        for i, start in enumerate(starts):
            labels[i, :start] = -100  # learn the response only
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_value = loss.item()
    model.eval()
    return loss_value


def _pair_batch(tok, rng, n, median_len, tail_sigma, max_len):
    chosen, rejected = [], []
    for _ in range(n):
        prompt, good, bad = wl.preference_pair(rng, median_len, tail_sigma, max_len)
        p = tok(prompt)["input_ids"]
        chosen.append(p + tok(good, add_special_tokens=False)["input_ids"] + [wl.EOS_ID])
        rejected.append(p + tok(bad, add_special_tokens=False)["input_ids"] + [wl.EOS_ID])
    return _right_pad(chosen + rejected, wl.PAD_ID)


def _last_token_scores(model, ids, mask) -> torch.Tensor:
    values = model(input_ids=ids, attention_mask=mask).values
    return values.gather(1, (mask.sum(1) - 1)[:, None]).squeeze(1)


def _train_reward(model, tok, rng, steps, median_len, tail_sigma, max_len, batch=32, lr=1e-3) -> float:
    """Bradley-Terry loss on the score at each sequence's last token; returns held-out accuracy."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        ids, mask = _pair_batch(tok, rng, batch, median_len, tail_sigma, max_len)
        scores = _last_token_scores(model, ids, mask)
        loss = -F.logsigmoid(scores[:batch] - scores[batch:]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    held_out = random.Random(12345)
    with torch.no_grad():
        ids, mask = _pair_batch(tok, held_out, 256, median_len, tail_sigma, max_len)
        scores = _last_token_scores(model, ids, mask)
    return (scores[:256] > scores[256:]).float().mean().item()
