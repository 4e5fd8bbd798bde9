"""PPO-ptx (InstructGPT): a language-modelling loss on pretraining text, added to the actor's
PPO loss with weight ``ppo.ptx_coef``, so that RLHF does not wear away what the model knew
(DeepSpeed-Chat's --unsupervised_dataset_name / --unsup_coef, OpenRLHF's --pretrain_data /
--ptx_coef).

The text (``data.ptx``, the ``data.ptx_key`` field of each row) is tokenized, concatenated and
cut into blocks of ``data.ptx_block_len`` tokens, the remainder dropped, as DeepSpeed-Chat
groups its unsupervised data; every block is full, so a batch needs no padding and every rank's
micro-batch holds the same number of predicted tokens. Each actor micro-batch of experience is
paired with a micro-batch of as many blocks, drawn from a seeded, per-rank shard that is resumed
from checkpoints like the prompts; its loss joins the same optimizer update (OpenRLHF's way;
DeepSpeed-Chat takes a separate optimizer step on it), on either engine.
"""
from __future__ import annotations

import torch

from .algo import logprobs_from_logits
from .data import Prompt
from .datafiles import DataError, PromptRow
from .rollout.generate import position_ids_from_mask


def ptx_blocks(rows: list[PromptRow], tokenizer, block_len: int, label: str) -> list[Prompt]:
    """The texts of ``rows`` tokenized (with the tokenizer's special tokens, as
    ``tokenizer(text)`` adds them), concatenated and cut into blocks of ``block_len`` ids."""
    ids: list[int] = []
    for row in rows:
        if not isinstance(row.text_or_messages, str):
            raise DataError(f"{row.where}: pretraining text must be a string, got chat messages")
        ids.extend(tokenizer(row.text_or_messages)["input_ids"])
    n = len(ids) // block_len
    if n == 0:
        raise DataError(f"{label}: {len(ids)} tokens of pretraining text, fewer than one block of "
                        f"data.ptx_block_len = {block_len}")
    return [Prompt(id=f"ptx-{i}", input_ids=ids[i * block_len:(i + 1) * block_len], source=label,
                   line=i, unit="block") for i in range(n)]


def lm_loss(model, ids: torch.Tensor, normalizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed negative log-likelihood of ``ids[:, 1:]`` / ``normalizer``, its per-token mean,
    detached): full blocks, so every position after the first is predicted."""
    mask = torch.ones_like(ids)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    nll = -logprobs_from_logits(logits[:, :-1].float(), ids[:, 1:])
    return nll.sum() / normalizer, nll.mean().detach()
