"""The one batch contract of a PPO step, and the forward passes that fill it."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from .algo import logprobs_from_logits
from .rollout.generate import position_ids_from_mask


@dataclass
class Experience:
    """A step's data, (B, P) for prompts and (B, T) for responses (right-padded)."""
    # identity
    prompt_keys: list[str]            # B dataset ids, for the ledger and logs
    # tokens
    prompt_ids: torch.Tensor          # (B, P) left-padded
    prompt_mask: torch.Tensor         # (B, P)
    response_ids: torch.Tensor        # (B, T) right-padded
    response_mask: torch.Tensor       # (B, T) float, 1 on generated tokens (EOS included)
    # policy
    behaviour_logprobs: torch.Tensor  # (B, T) log-probs of the sampling policy
    old_logprobs: torch.Tensor        # (B, T) current actor, recomputed before the update
    ref_logprobs: torch.Tensor        # (B, T) frozen reference; old_logprobs with the KL off
    # value
    old_values: torch.Tensor          # (B, T) critic before the update
    # reward
    scores: torch.Tensor              # (B,) reward model at the last response token
    gold: Optional[torch.Tensor]      # (B,) hidden rule of the built-in task; None for user data
    rewards: Optional[torch.Tensor] = None     # (B, T) KL-shaped per-token rewards
    advantages: Optional[torch.Tensor] = None  # (B, T)
    returns: Optional[torch.Tensor] = None     # (B, T)
    groups: Optional[torch.Tensor] = None      # (B,) rows with one label answer one prompt

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, idx: torch.Tensor) -> "Experience":
        """Rows ``idx`` (a mini- or micro-batch)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value[idx]
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in idx.tolist()]
            else:
                out[f.name] = value
        return Experience(**out)

    def trimmed(self) -> "Experience":
        """The same rows without the columns that are padding in every one of them: prompt
        columns on the left, response columns on the right. A micro-batch of short responses
        then costs its own length, not the longest of the step's batch; scores and gradients
        are those of the padded batch (masked columns contribute nothing)."""
        prompt_width, response_width = used_widths(self.prompt_mask, self.response_mask)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("prompt_ids", "prompt_mask"):
                value = value[:, self.prompt_ids.shape[1] - prompt_width:]
            elif isinstance(value, torch.Tensor) and value.dim() == 2:
                value = value[:, :response_width]
            out[f.name] = value
        return Experience(**out)


def concat_experiences(parts: list[Experience], pad_id: int) -> Experience:
    """The rows of ``parts`` one after another, as one batch: prompts left-padded and
    responses right-padded to the widest part (ids with ``pad_id``, masks, log-probs and values
    with 0). For batches generated in separate rounds (``ppo.filter_groups``), before the
    advantages: the per-token rewards, advantages, returns and groups must still be unset."""
    if not parts:
        raise ValueError("concat_experiences needs at least one part")
    for f in ("rewards", "advantages", "returns", "groups"):
        if any(getattr(p, f) is not None for p in parts):
            raise ValueError(f"concat_experiences: {f} is set; concatenate before the advantages")
    if len(parts) == 1:
        return parts[0]
    prompt_w = max(p.prompt_ids.shape[1] for p in parts)
    response_w = max(p.response_ids.shape[1] for p in parts)

    def padded(name: str, value: torch.Tensor) -> torch.Tensor:
        fill = pad_id if name in ("prompt_ids", "response_ids") else 0
        if name in ("prompt_ids", "prompt_mask"):
            return torch.nn.functional.pad(value, (prompt_w - value.shape[1], 0), value=fill)
        return torch.nn.functional.pad(value, (0, response_w - value.shape[1]), value=fill)

    out = {}
    for f in fields(Experience):
        values = [getattr(p, f.name) for p in parts]
        if f.name == "prompt_keys":
            out[f.name] = [k for v in values for k in v]
        elif all(v is None for v in values):
            out[f.name] = None
        elif any(v is None for v in values):
            raise ValueError(f"concat_experiences: {f.name} is set in some parts only")
        elif values[0].dim() == 2:
            out[f.name] = torch.cat([padded(f.name, v) for v in values])
        else:
            out[f.name] = torch.cat(values)
    return Experience(**out)


def used_widths(prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[int, int]:
    """(prompt columns, response columns) that hold a real token in some row: the longest
    prompt (left-padded) and the longest response (right-padded), at least 1 each."""
    prompt = int(prompt_mask.sum(1).max()) if prompt_mask.numel() else 0
    response = int(response_mask.sum(1).max()) if response_mask.numel() else 0
    return max(prompt, 1), max(response, 1)


def model_inputs(prompt_ids, prompt_mask, response_ids, response_mask) -> dict:
    """Prompt + response as one left-padded-prompt / right-padded-response sequence."""
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1)
    return dict(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask))


def response_slice(prompt_len: int, response_len: int) -> slice:
    """Positions whose outputs predict (logits) or evaluate the state before (values) each
    response token: the output at position i looks at tokens [0..i]."""
    return slice(prompt_len - 1, prompt_len - 1 + response_len)


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                      temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, logits) of the response tokens under a causal LM: (B, T), (B, T, V)."""
    inputs = model_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    logits = model(**inputs).logits[:, response_slice(prompt_ids.shape[1], response_ids.shape[1])]
    if temperature > 0:
        logits = logits / temperature
    return logprobs_from_logits(logits, response_ids), logits


def response_values(model, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
    """Per-token values (B, T) of a value-head model: V(prompt + response[:t])."""
    inputs = model_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    values = model(**inputs).values
    return values[:, response_slice(prompt_ids.shape[1], response_ids.shape[1])].float()


def sequence_scores(model, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
    """Reward (B,): the value head at each sequence's last response token."""
    inputs = model_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    values = model(**inputs).values.float()
    last = prompt_ids.shape[1] + response_mask.sum(1).long() - 1
    return values.gather(1, last[:, None]).squeeze(1)
