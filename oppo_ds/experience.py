"""The one batch contract of a PPO step, and the forward passes that fill it."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from .algo import logprobs_from_logits, policy_logits, policy_token_logprobs
from .micro_batches import first_fit_rows
from .rollout.generate import logits_kept, position_ids_from_mask


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


def packed_inputs(prompt_ids, prompt_mask, response_ids,
                  response_mask) -> tuple[dict, torch.Tensor]:
    """The rows' real tokens packed, without padding, into as few rows as hold them, each as
    wide as the longest sequence (``system.packing_samples``): (the model's inputs, (B, P + T)
    where each column of the padded rows is in the packed ones, flattened).

    Each sequence's positions start again at 0 and no attention mask is given, which is how
    transformers' models (and ours under Megatron) tell packed sequences apart: a token
    attends to the earlier tokens of its own sequence only, so each output is the one the
    padded batch gives. Sequences go into rows first-fit, longest first; the rest of a row is
    padding, a sequence of its own whose outputs are not read. No row is wider than the
    padded batch and there are no more rows, so no forward costs more than the padded one,
    masked attention over whole rows included. A padding column maps to a real token of its
    own row."""
    if prompt_ids.shape[0] == 0:
        raise ValueError("packed_inputs: no rows to pack")
    full = model_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    real = full["attention_mask"].bool()
    columns = torch.arange(real.shape[1], device=real.device)
    # the first and last real columns, and how many: one run of real tokens per row
    spans = torch.stack([torch.where(real, columns, real.shape[1]).min(1).values,
                         torch.where(real, columns, -1).max(1).values, real.sum(1)], 1)
    starts, ends, lengths = (list(c) for c in zip(*spans.tolist()))
    if any(e - s + 1 != n for s, e, n in zip(starts, ends, lengths)):
        raise ValueError("packed_inputs: a row's real tokens are not one run (prompts must be "
                         "left-padded and responses right-padded)")
    width = max(lengths)
    bins = first_fit_rows(lengths, width)
    ids, device = full["input_ids"], full["input_ids"].device
    packed_ids = ids.new_zeros(len(bins), width)
    positions = torch.zeros(len(bins), width, dtype=torch.long, device=device)
    index = torch.zeros(real.shape, dtype=torch.long, device=device)
    for b, rows in enumerate(bins):
        at = 0
        for i in rows:
            start, n = starts[i], lengths[i]
            packed_ids[b, at:at + n] = ids[i, start:start + n]
            positions[b, at:at + n] = torch.arange(n, device=device)
            index[i] = b * width + at + (columns - start).clamp(0, n - 1)
            at += n
        positions[b, at:] = torch.arange(width - at, device=device)
    return dict(input_ids=packed_ids, position_ids=positions, use_cache=False), index


PACKING_PROBLEMS = (
    "the tokens of one packed sequence changed the outputs of the next: its attention does not "
    "keep sequences apart by position_ids",
    "a packed sequence's outputs changed with where it sits in the row: the model does not take "
    "its positions from position_ids",
)


def packing_problem(forward, vocab_size: int, device, half: bool) -> Optional[str]:
    """Why a model cannot take packed sequences (``system.packing_samples``), or None: one of
    ``PACKING_PROBLEMS``. ``forward(inputs)``: the model's output (logits or values,
    (R, L, ...)) for ``packed_inputs``-style inputs.

    One forward of three packed rows as ``packed_inputs`` makes them (several rows: under
    flash-attention-2 transformers tells packed sequences apart in a batch of one row only):
    sequences A then B, A' (other tokens) then B, and B then A. B's outputs must be the same
    after A and after A' (attention kept apart), and the same after A as first in its row
    (positions taken from ``position_ids``). The first comparison is of the same shapes and
    should be exact; the second rounds differently. Tolerances: 1e-3 (fp32) or 1e-2 (bf16,
    fp16) of the largest output for the first, 1e-3 or 3e-2 for the second, far below what
    attending to another sequence or a wrong position changes."""
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(vocab_size, (5,), generator=gen)
    other = (first + 1) % max(vocab_size, 2)
    second = torch.randint(vocab_size, (4,), generator=gen)
    rows = [(first, second), (other, second), (second, first)]
    inputs = dict(
        input_ids=torch.stack([torch.cat(r) for r in rows]).to(device), use_cache=False,
        position_ids=torch.stack([torch.cat([torch.arange(len(q)) for q in r])
                                  for r in rows]).to(device))
    after, after_other, alone = forward(inputs).float()
    scale = 1 + float(after.abs().max())
    if float((after[5:] - after_other[5:]).abs().max()) > (1e-2 if half else 1e-3) * scale:
        return PACKING_PROBLEMS[0]
    if float((after[5:] - alone[:4]).abs().max()) > (3e-2 if half else 1e-3) * scale:
        return PACKING_PROBLEMS[1]
    return None


def response_slice(prompt_len: int, response_len: int) -> slice:
    """Positions whose outputs predict (logits) or evaluate the state before (values) each
    response token: the output at position i looks at tokens [0..i]."""
    return slice(prompt_len - 1, prompt_len - 1 + response_len)


def _outputs_at(model, field: str, prompt_ids, prompt_mask, response_ids, response_mask,
                columns, packed: bool) -> torch.Tensor:
    """The model's ``field`` output (``logits`` or ``values``) at ``columns`` of the padded
    rows (a slice, or (B, K) column indices): (B, K, ...) from one forward of the padded batch
    or, ``packed``, of its real tokens packed (``packed_inputs``). Outputs at padding columns are
    those of some real token (finite, to be masked)."""
    if not packed:
        out = getattr(model(**model_inputs(prompt_ids, prompt_mask, response_ids, response_mask)),
                      field)
        if isinstance(columns, slice):
            return out[:, columns]
        return out[torch.arange(out.shape[0], device=out.device)[:, None], columns]
    inputs, index = packed_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    where = index[:, columns] if isinstance(columns, slice) else index.gather(1, columns)
    return getattr(model(**inputs), field).flatten(0, 1)[where]


def _response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask,
                     packed: bool) -> torch.Tensor:
    """The logits predicting each response token, (B, T, V) in the model's dtype. Not packed,
    the forward is asked for the last T + 1 positions' only (``logits_to_keep``, where the
    model takes it), which are positions P - 1 .. P + T - 1: the prompts' logits, (B, P, V)
    at a real vocabulary, are never made."""
    prompt_len, response_len = prompt_ids.shape[1], response_ids.shape[1]
    columns = response_slice(prompt_len, response_len)
    if packed:
        return _outputs_at(model, "logits", prompt_ids, prompt_mask, response_ids,
                           response_mask, columns, True)
    keep = logits_kept(model, response_len + 1)
    logits = model(**model_inputs(prompt_ids, prompt_mask, response_ids, response_mask),
                   **keep).logits
    # a model that passes keywords on without reading this one returns every position's
    return logits[:, :response_len] if logits.shape[1] == response_len + 1 else logits[:, columns]


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                      temperature: float,
                      packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, logits) of the response tokens under a causal LM: (B, T), (B, T, V).
    ``packed``: from one forward of the rows packed (``packed_inputs``)."""
    logits = _response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask,
                              packed)
    logits = policy_logits(logits, temperature)
    return logprobs_from_logits(logits, response_ids), logits


@torch.no_grad()
def response_token_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                            temperature: float, packed: bool = False) -> torch.Tensor:
    """``response_logprobs``' log-probs alone, without a graph (the scoring forwards): the
    fp32 copies a vocabulary needs are made a block of rows at a time
    (``policy_token_logprobs``), not for the whole micro-batch at once."""
    logits = _response_logits(model, prompt_ids, prompt_mask, response_ids, response_mask,
                              packed)
    return policy_token_logprobs(logits, response_ids, temperature)


def response_values(model, prompt_ids, prompt_mask, response_ids, response_mask,
                    packed: bool = False) -> torch.Tensor:
    """Per-token values (B, T) of a value-head model: V(prompt + response[:t])."""
    values = _outputs_at(model, "values", prompt_ids, prompt_mask, response_ids, response_mask,
                         response_slice(prompt_ids.shape[1], response_ids.shape[1]), packed)
    return values.float()


def sequence_scores(model, prompt_ids, prompt_mask, response_ids, response_mask,
                    packed: bool = False) -> torch.Tensor:
    """Reward (B,): the value head at each sequence's last response token."""
    last = prompt_ids.shape[1] + response_mask.sum(1).long() - 1
    values = _outputs_at(model, "values", prompt_ids, prompt_mask, response_ids, response_mask,
                         last[:, None], packed)
    return values.float().squeeze(1)
