"""Prompts ready for decoding: tokenising, a resumable per-rank prompt stream, padding.

Reading the user's files is :mod:`oppo_ds.datafiles` (:func:`~oppo_ds.datafiles.read_prompt_rows`);
from its rows:

1. :func:`encode_prompts` turns rows into token ids (chat template or plain), applying the
   overlong-prompt policy.
2. :class:`PromptStream` hands out prompts to one data-parallel rank in a deterministic,
   resumable order; :func:`left_pad` makes a decoding batch.

The built-in synthetic workload lives in its own module.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import hashlib
import random
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import comm
from .datafiles import DataError, PromptRow, location

__all__ = [
    "DataError",
    "EncodedPrompts",
    "Prompt",
    "PromptRow",
    "PromptStream",
    "StreamMismatch",
    "check_same_on_every_rank",
    "encode_prompts",
    "left_pad",
    "repeat_samples",
]

OVERLONG_POLICIES = ("error", "truncate", "skip")
CHAT_TEMPLATE_MODES = ("auto", "on", "off")


@dataclasses.dataclass
class Prompt:
    """A tokenised prompt, ready for decoding."""

    id: str
    input_ids: list[int]
    source: str
    line: int
    unit: str = "line"
    target_len: Optional[int] = None  # length oracle: the response ends after this many tokens

    @property
    def where(self) -> str:
        return location(self.source, self.line, self.unit)


@dataclasses.dataclass
class EncodedPrompts:
    """The result of :func:`encode_prompts`."""

    prompts: list[Prompt]
    n_truncated: int = 0
    """Prompts cut to their last ``max_prompt_len`` tokens (``overlong="truncate"``)."""
    n_skipped: int = 0
    """Prompts dropped for being too long (``overlong="skip"``)."""
    n_continued: int = 0
    """Chat prompts ending with an assistant message, which their responses continue."""

    def __len__(self) -> int:
        return len(self.prompts)


# --------------------------------------------------------------------------------------------
# Tokenising
# --------------------------------------------------------------------------------------------


def encode_prompts(
    rows: Sequence[PromptRow],
    tokenizer: Any,
    max_prompt_len: int,
    overlong: str = "error",
    chat_template: str = "auto",
    input_template: Optional[str] = None,
) -> EncodedPrompts:
    """Tokenise prompts.

    Args:
        rows: from :func:`read_prompt_rows`.
        tokenizer: a Hugging Face tokenizer.
        max_prompt_len: the most tokens a prompt may have.
        overlong: what to do with a prompt over ``max_prompt_len`` tokens:
            ``"error"`` raises :class:`DataError` naming the row and both lengths;
            ``"truncate"`` keeps the LAST ``max_prompt_len`` tokens, because the end of a
            prompt (the question, and the template's assistant header right where the response
            starts) matters most; this drops the start, BOS token included;
            ``"skip"`` drops the prompt. Truncated and skipped prompts are counted.
        chat_template: ``"auto"`` applies the tokenizer's chat template when it has one
            (``tokenizer.chat_template`` set), ``"on"`` requires one, ``"off"`` never applies
            one. With a template, a string prompt becomes one user message and the ids are
            ``apply_chat_template(messages, add_generation_prompt=True)``; messages ending with
            an assistant message are continued instead, as TRL does
            (``continue_final_message=True``: the response carries on the assistant's given
            start, with no end of turn after it); without a template, the ids are
            ``tokenizer(text, add_special_tokens=True)["input_ids"]``. A prompt given as chat
            messages needs a template.
        input_template: without a chat template in use, a string prompt is put into this
            text at its one ``{}`` before tokenising (OpenRLHF's ``--input_template``, e.g.
            ``"User: {}\nAssistant: "``); None: the prompt as it is.

    Raises:
        ValueError: bad ``overlong``, ``chat_template``, ``max_prompt_len`` or
            ``input_template`` (not one ``{}``, or given while a chat template is in use), or
            ``chat_template="on"`` with a tokenizer that has no template.
        DataError: a row that cannot be encoded, encodes to nothing, or is too long under
            ``overlong="error"``; with a chat template in use, a string prompt rendered by
            one already (it starts with the BOS text, or holds a special token the template
            writes out: the template would go round it a second time).
    """
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong={overlong!r}; allowed values: {', '.join(OVERLONG_POLICIES)}")
    if chat_template not in CHAT_TEMPLATE_MODES:
        raise ValueError(
            f"chat_template={chat_template!r}; allowed values: {', '.join(CHAT_TEMPLATE_MODES)}"
        )
    if type(max_prompt_len) is not int or max_prompt_len < 1:  # bool is an int subclass
        raise ValueError(f"max_prompt_len must be a positive integer, got {max_prompt_len!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "on" and not has_template:
        raise ValueError("chat_template='on' but the tokenizer has no chat template")
    use_template = has_template and chat_template != "off"
    if input_template is not None:
        if input_template.count("{}") != 1:
            raise ValueError(f"input_template must hold {{}} once, where the prompt goes; got "
                             f"{input_template!r}")
        if use_template:
            raise ValueError("input_template is for tokenizers without a chat template, but the "
                             "tokenizer's is in use (chat_template='off' uses the input template)")

    marks = _rendered_marks(tokenizer) if use_template else None
    out = EncodedPrompts(prompts=[])
    for row in rows:
        ids = _encode_row(row, tokenizer, use_template, input_template, marks)
        if len(ids) > max_prompt_len:
            if overlong == "error":
                raise DataError(
                    f"{row.where}: prompt {row.id!r} is {len(ids)} tokens, over "
                    f"generation.max_prompt_len={max_prompt_len} (set data.overlong to "
                    "truncate or skip to allow this)"
                )
            if overlong == "skip":
                out.n_skipped += 1
                continue
            ids = ids[-max_prompt_len:]
            out.n_truncated += 1
        out.n_continued += _continues(row.text_or_messages)  # of the prompts kept
        out.prompts.append(Prompt(row.id, ids, row.source, row.line, row.unit))
    return out


def _continues(prompt: str | list[dict[str, Any]]) -> bool:
    """A chat prompt whose last message is the assistant's: its response continues it."""
    return not isinstance(prompt, str) and prompt[-1]["role"] == "assistant"


def _rendered_marks(tokenizer: Any) -> tuple[Optional[str], list[str]]:
    """What a string prompt already rendered by the tokenizer's chat template holds: (its BOS
    text, at the start; the special tokens the template writes out, ``<|im_start|>``)."""
    template = str(tokenizer.chat_template)
    special = set(getattr(tokenizer, "all_special_tokens", None) or ())
    special.update(t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}
                                       ).values() if getattr(t, "special", False))
    return getattr(tokenizer, "bos_token", None), sorted(t for t in special if t and t in template)


def _refuse_rendered(row: PromptRow, prompt: str, marks: tuple[Optional[str], list[str]]):
    """A DataError for a string prompt that already carries a chat template (its text starts
    with the BOS text, or holds a special token the template writes): the template in use
    would wrap it in a second one, a second BOS in front."""
    bos, tokens = marks
    found = f"starts with the BOS text {bos!r}" if bos and prompt.startswith(bos) else next(
        (f"holds {t!r}, a special token of the chat template" for t in tokens if t in prompt),
        None)
    if found:
        raise DataError(
            f"{row.where}: prompt {row.id!r} {found}: it looks rendered by a chat template "
            "already, and the tokenizer's would wrap it in a second one; set "
            "data.chat_template: off to tokenize such prompts as they are, or give them as "
            "plain text or chat messages")


def _encode_row(row: PromptRow, tokenizer: Any, use_template: bool,
                input_template: Optional[str],
                marks: Optional[tuple[Optional[str], list[str]]]) -> list[int]:
    """``marks``: ``_rendered_marks`` of the tokenizer, made once per encoding where
    ``use_template`` (None otherwise)."""
    prompt = row.text_or_messages
    if use_template:
        if isinstance(prompt, str):
            _refuse_rendered(row, prompt, marks)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        continues = _continues(prompt)
        try:
            # transformers 5 returns a BatchEncoding by default (return_dict=True); ask for ids.
            encoded = tokenizer.apply_chat_template(
                messages, add_generation_prompt=not continues, continue_final_message=continues,
                tokenize=True, return_dict=False
            )
        except Exception as e:  # Jinja templates raise their own errors (e.g. role order)
            raise DataError(f"{row.where}: chat template failed: {type(e).__name__}: {e}") from None
        if isinstance(encoded, Mapping):  # older or custom tokenizers may ignore return_dict
            encoded = encoded["input_ids"]
    elif isinstance(prompt, str):
        if input_template is not None:
            prompt = input_template.replace("{}", prompt, 1)
        # text that already starts with the BOS text (a prompt rendered by a chat template
        # beforehand, an input_template opening with it) gets no second one, as a chat
        # template's tokens get none
        bos = getattr(tokenizer, "bos_token", None)
        encoded = tokenizer(prompt, add_special_tokens=not (bos and prompt.startswith(bos))
                            )["input_ids"]
    else:
        raise DataError(
            f"{row.where}: prompt is a list of chat messages but no chat template is in use "
            "(the tokenizer has none, or chat_template='off')"
        )
    ids = [int(t) for t in encoded]
    if not ids:
        raise DataError(f"{row.where}: prompt {row.id!r} encodes to no tokens")
    return ids


# --------------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------------


class StreamMismatch(ValueError):
    """A saved stream state that this stream cannot continue; ``changed`` maps each setting
    that differs to (saved, now)."""

    def __init__(self, changed: dict[str, tuple[Any, Any]]):
        self.changed = changed
        super().__init__("PromptStream state does not match this stream: " + "; ".join(
            f"{k}: saved {saved!r}, now {now!r}" for k, (saved, now) in changed.items()))


class PromptStream:
    """Deterministic, resumable prompts for one data-parallel rank.

    Epoch ``e`` visits the prompts in a permutation seeded by ``(seed, e)`` only (a private
    ``random.Random``; global RNG state plays no part), or in file order when
    ``shuffle=False``. The epoch's order is cut to a multiple of ``world_size`` (the last
    ``len(prompts) % world_size`` positions are dropped for that epoch, so every rank gets the
    same number, :attr:`prompts_per_epoch`) and dealt round-robin: rank ``r`` takes positions
    ``r, r + world_size, r + 2 * world_size, ...``. Within an epoch, ranks see disjoint prompts.
    With shuffling, the dropped prompts differ from epoch to epoch; without, the same last ones
    are never seen.

    :meth:`take` and :meth:`next_batch` wrap into the next epoch when needed, so one batch may
    hold the end of one epoch and the start of the next. Ranks may take different numbers of
    prompts (each rank tops up its own pool); each rank keeps its own cursor.
    """

    def __init__(
        self,
        prompts: Sequence[Prompt],
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        if len(prompts) < world_size:
            raise ValueError(
                f"{len(prompts)} prompts cannot be shared among world_size={world_size} ranks"
            )
        self.prompts = list(prompts)
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.prompts_per_epoch = len(self.prompts) // world_size
        self._epoch = 0
        self._position = 0  # index into this rank's share of the current epoch
        self._order: list[int] | None = None  # this rank's share of the current epoch

    @functools.cached_property
    def fingerprint(self) -> str:
        """:func:`prompts_fingerprint` of the prompts: a saved state names the prompts it was
        taken from, not only how many there were."""
        return prompts_fingerprint(self.prompts)

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from (0-based)."""
        return self._epoch

    @property
    def prompts_seen(self) -> int:
        """Prompts this rank has taken since the start of training (restored by load_state_dict)."""
        return self._epoch * self.prompts_per_epoch + self._position

    def next_batch(self) -> list[Prompt]:
        """The next ``batch_size`` prompts."""
        return self.take(self.batch_size)

    def take(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts (``n >= 0``)."""
        if n < 0:
            raise ValueError(f"take(n) needs n >= 0, got {n}")
        out: list[Prompt] = []
        while len(out) < n:
            order = self._rank_order()
            stop = min(len(order), self._position + n - len(out))
            out.extend(self.prompts[i] for i in order[self._position : stop])
            self._position = stop
            if self._position == len(order):
                self._epoch += 1
                self._position = 0
                self._order = None
        return out

    def state_dict(self) -> dict[str, int | bool]:
        """The cursor, plus what the order depends on (checked on load). JSON-serialisable."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "world_size": self.world_size,
            "num_prompts": len(self.prompts),
            "shuffle": self.shuffle,
            "prompts": self.fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; the stream then yields exactly what the saved one would.

        Raises ``StreamMismatch`` (a ``ValueError``) if the state was saved with a different
        seed, world size, shuffle setting, number of prompts or prompts (``fingerprint``; when
        those keys are present), since the order, or what it hands out, would differ.
        """
        mine = self.state_dict()
        changed = {k: (state[k], mine[k])
                   for k in ("seed", "world_size", "num_prompts", "shuffle", "prompts")
                   if k in state and state[k] != mine[k]}
        if changed:
            raise StreamMismatch(changed)
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.prompts_per_epoch:
            raise ValueError(
                f"PromptStream state out of range: epoch={epoch}, position={position}, "
                f"prompts_per_epoch={self.prompts_per_epoch}"
            )
        self._epoch, self._position, self._order = epoch, position, None

    def _rank_order(self) -> list[int]:
        if self._order is None:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                random.Random(_epoch_seed(self.seed, self._epoch)).shuffle(order)
            kept = order[: self.prompts_per_epoch * self.world_size]
            self._order = kept[self.rank :: self.world_size]
        return self._order


def prompts_fingerprint(prompts: Sequence[Prompt]) -> str:
    """A hash of the prompts (ids, tokens, length targets) in their given order, 16 hex
    digits."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(f"{p.id}\0{p.target_len}\0".encode())
        digest.update(array.array("q", p.input_ids).tobytes())
    return digest.hexdigest()[:16]


def check_same_on_every_rank(prompts: Sequence[Prompt], label: str, group=None) -> None:
    """A DataError on every rank of ``group`` (default: the world) unless all hold the same
    prompts (:func:`prompts_fingerprint`), naming each rank's count and fingerprint. Every
    rank reads and encodes its prompts itself, and each epoch's order (:class:`PromptStream`)
    deals one list out among them: nodes with different copies of the files would train some
    prompts twice and skip others, silently. One rank: nothing to compare."""
    if not comm.active(group):
        return
    world, me = dist.get_world_size(group), dist.get_rank(group)
    # an all_gather by a sum: each rank fills its own two slots (a 60-bit hash, a count)
    mine = [0] * (2 * world)
    mine[2 * me: 2 * me + 2] = [int(prompts_fingerprint(prompts)[:15], 16), len(prompts)]
    every = comm.all_reduce_ints(mine, group=group)
    held: dict[tuple[int, int], list[int]] = {}
    for rank in range(world):
        held.setdefault((every[2 * rank], every[2 * rank + 1]), []).append(rank)
    if len(held) > 1:
        raise DataError(
            f"{label}: the ranks read different prompts: " + "; ".join(
                f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {count} "
                f"prompts (fingerprint {digest:015x})" for (digest, count), ranks in held.items())
            + ". Every rank reads the files itself and the ranks share out one list each epoch:"
            " with different lists some prompts are trained twice and others never; give "
            "every node the same files (a shared filesystem, or identical copies)")


def repeat_samples(prompts: Sequence[Prompt], n: int) -> list[Prompt]:
    """Each prompt ``n`` times in a row, as rows ``<id>#0`` ... ``<id>#<n-1>`` (the prompts as
    they are for ``n == 1``): the rows of ``data.samples_per_prompt``."""
    if n == 1:
        return list(prompts)
    return [dataclasses.replace(p, id=f"{p.id}#{k}") for p in prompts for k in range(n)]


def _epoch_seed(seed: int, epoch: int) -> int:
    # A hash, not seed * K + epoch: distinct (seed, epoch) pairs never share a permutation by
    # arithmetic accident, and the value is the same on every platform and Python version.
    digest = hashlib.sha256(f"oppo_ds.PromptStream:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------


def left_pad(
    batch_of_id_lists: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists for decoding, so every prompt ends at the last column.

    Returns:
        input_ids: LongTensor (B, L), ``L`` the longest list, padded on the left with ``pad_id``.
        attention_mask: LongTensor (B, L), 1 on tokens, 0 on padding.
    An empty batch gives two (0, 0) tensors.
    """
    batch = len(batch_of_id_lists)
    max_len = max((len(ids) for ids in batch_of_id_lists), default=0)
    input_ids = torch.full((batch, max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, max_len), dtype=torch.long)
    for i, ids in enumerate(batch_of_id_lists):
        if len(ids):
            input_ids[i, max_len - len(ids) :] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[i, max_len - len(ids) :] = 1
    return input_ids, attention_mask
