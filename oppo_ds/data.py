"""Prompt datasets: reading, tokenising, and a resumable per-rank prompt stream.

Three stages, each usable on its own:

1. :func:`read_prompt_rows` reads prompts from a ``.jsonl``, ``.json`` or ``.parquet`` file, a
   local Hugging Face dataset saved with ``save_to_disk``, or a directory of such files (a hub
   snapshot's split-named shards among them). Every bad row raises :class:`DataError` naming
   the file and the line (or row), so a user can go straight to it.
2. :func:`encode_prompts` turns rows into token ids (chat template or plain), applying the
   overlong-prompt policy.
3. :class:`PromptStream` hands out prompts to one data-parallel rank in a deterministic,
   resumable order; :func:`left_pad` makes a decoding batch.

The built-in synthetic workload lives in its own module.
"""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import hashlib
import json
import logging
import lzma
import os
import random
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "DataError",
    "EncodedPrompts",
    "Prompt",
    "PromptRow",
    "PromptStream",
    "SourceFormat",
    "encode_prompts",
    "left_pad",
    "phase_part",
    "read_prompt_rows",
]

OVERLONG_POLICIES = ("error", "truncate", "skip")
CHAT_TEMPLATE_MODES = ("auto", "on", "off")
# JSON files may come compressed (Anthropic/hh-rlhf ships .jsonl.gz), as `datasets` reads them
_COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet") + tuple(
    f".{kind}{zipped}" for kind in ("jsonl", "json") for zipped in _COMPRESSED)
_DECOMPRESS_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)
# files a downloaded dataset holds beside its data (a hub snapshot's card, licence and the
# metadata older datasets carry)
_DOC_FILES = re.compile(r"(?i)^(readme|license|licence|notice|citation)([-_.].*)?$|.*\.md$"
                        r"|^dataset_infos?\.json$")
# the split a file belongs to by its name or a folder's, as Hugging Face's hub layouts name
# them (``data/train-00000-of-00002.parquet``, ``test.jsonl``, ``validation/0.parquet``)
SPLIT_WORDS = {"train": "train", "training": "train", "validation": "validation",
               "valid": "validation", "val": "validation", "dev": "validation", "test": "test",
               "testing": "test", "eval": "test", "evaluation": "test"}
_SPLIT_NAME = re.compile(r"^([A-Za-z]+)(?:[-_.].*)?$")


class DataError(ValueError):
    """A problem in the user's data.

    The message starts with where the problem is: ``"<file>:<line>: "`` for jsonl (1-based
    lines, as editors show them) and ``"<path>: row <i>: "`` for parquet files and HF datasets
    directories (0-based rows, as ``dataset[i]`` and pandas index them).
    """


@dataclasses.dataclass
class PromptRow:
    """One prompt as read from disk, before tokenisation."""

    text_or_messages: str | list[dict[str, Any]]
    """A plain string, or chat messages ``[{"role": ..., "content": ...}, ...]``."""
    source: str
    """The file (or HF datasets directory) the row came from."""
    line: int
    """1-based line for jsonl; 0-based row index for parquet and HF datasets (see ``unit``)."""
    id: str
    """The row's ``"id"`` field when present, else ``"<basename>:<line>"``; unique per read."""
    unit: str = "line"
    """``"line"`` (jsonl) or ``"row"`` (parquet, HF datasets): how ``line`` is reported."""
    default_id: bool = False
    """The row had no ``"id"``: ``id`` was made from its file's name and its line."""

    @property
    def where(self) -> str:
        """The location prefix used in error messages, without the trailing ``": "``."""
        return _where(self.source, self.line, self.unit)


@dataclasses.dataclass(frozen=True)
class SourceFormat:
    """How to read a source whose prompts are built from its rows' fields rather than held in
    one (DeepSpeed-Chat's data sets: ``oppo_ds.integrations.dschat_data``)."""

    name: str
    """Named in messages (the data set)."""
    prompt: Callable[[Mapping[str, Any]], Optional[str]]
    """A row's prompt text; None where the row has none (dropped after the cuts, counted).
    A missing field raises ``KeyError`` (or ``IndexError``, ``TypeError``): a ``DataError``
    naming the row."""
    split: str = "train"
    """The split read."""
    pre_cut: Optional[tuple[tuple[float, ...], int]] = None
    """(weights, part): only that part of a seeded cut (``phase_part``, seeded as
    ``phase_split``) is read, before ``phase_split`` cuts it again."""


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
        return _where(self.source, self.line, self.unit)


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


def _where(source: str, line: int, unit: str) -> str:
    return f"{source}:{line}" if unit == "line" else f"{source}: row {line}"


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def read_prompt_rows(
    path: str | os.PathLike | Sequence[str | os.PathLike], prompt_key: str = "prompt",
    split: str = "train", phase_split: Optional[Sequence[float]] = None, phase_seed: int = 0,
    source_format: Optional[Callable[[str], Optional[SourceFormat]]] = None,
) -> list[PromptRow]:
    """Read prompts from ``path``, or from several paths one after another (their rows
    concatenated in the order given).

    Each path may be:

    - a ``.jsonl`` file: one JSON object per line. Blank lines at the end are ignored; a blank
      line before the last record is an error (it usually means a broken export).
    - a ``.json`` file: a JSON array of objects (rows counted from 0), or JSON lines.
    - either of them compressed: ``.jsonl.gz``, ``.json.gz``, ``.bz2``, ``.xz`` (lines are
      counted in the decompressed text).
    - a ``.parquet`` file.
    - a directory written by ``datasets.Dataset.save_to_disk`` or
      ``datasets.DatasetDict.save_to_disk`` (then ``split`` picks the split).
    - a directory of such files, in folders or not, e.g. a Hugging Face hub snapshot
      (``README.md``, ``data/train-00000-of-00001.parquet``, ``data/test-...``). Where files
      or folders are named by split (``train``, ``validation``/``valid``/``val``/``dev``,
      ``test``/``eval`` at the start of the name), ``split`` picks them and the others are
      named in a log line; otherwise every file is read. Files are read in sorted order;
      hidden files and names starting with ``_`` (``_SUCCESS``) are skipped, and so are a
      card, a licence and metadata (``README*``, ``LICENSE*``, ``*.md``,
      ``dataset_infos.json``); any other file is an error.

    Each row's ``prompt_key`` field must be a non-blank string or a non-empty list of chat
    messages, each a mapping with string ``role`` and ``content``. Message keys whose value is
    null are dropped, because Arrow fills fields absent from a message with nulls and chat
    templates would see them as set.

    The row id is the row's ``"id"`` field (a string or an integer) when present and not null,
    else ``"<basename>:<line>"``; where two files read share a basename
    (``en/train.jsonl``, ``de/train.jsonl``), their rows' ids name the path from the folder
    the two have in common instead (``en/train.jsonl:3``). Ids must be unique across
    everything read.

    ``phase_split`` (three weights, as DeepSpeed-Chat's ``--data_split``): of each path's rows,
    only the PPO part (:func:`phase_part`, seeded by ``phase_seed``) is returned, in file
    order. Every row is checked all the same.

    ``source_format(path)``: a :class:`SourceFormat` for a path whose prompts are built from
    other fields (its split read instead of ``split``, its cut before ``phase_split``, rows
    without a prompt dropped after the cuts), or None to read it as above.

    Raises:
        DataError: naming the file and line (or row) of the first bad row, or the missing path.
    """
    paths = [os.fspath(path)] if isinstance(path, (str, os.PathLike)) else [os.fspath(p) for p in path]
    if not paths:
        raise DataError("no prompt source given")
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise DataError(f"{twice[0]}: named twice among the prompt sources {paths}")
    rows = []
    for source in paths:
        fmt = source_format(source) if source_format is not None else None
        read = _read_source(source, fmt or prompt_key, fmt.split if fmt else split)
        # the cuts pick positions in what the cut before kept, in its (permuted) order, as
        # DeepSpeed-Chat's Subset of a Subset does
        kept = list(range(len(read)))
        if fmt is not None and fmt.pre_cut is not None:
            weights, part = fmt.pre_cut
            kept = [kept[i] for i in phase_part(len(kept), weights, phase_seed, part)]
        if phase_split is not None:
            n = len(kept)
            kept = [kept[i] for i in phase_part(n, phase_split, phase_seed)]
            logger.info("%s: %d of %d prompts, the PPO part of data.phase_split %s (seed %d)",
                        source, len(kept), n, list(phase_split), phase_seed)
        read = [read[i] for i in sorted(kept)]
        if fmt is not None:
            with_prompt = [r for r in read if r.text_or_messages is not None]
            logger.info("%s: read as DeepSpeed-Chat reads %s: %d prompts%s", source, fmt.name,
                        len(with_prompt), f" ({len(read) - len(with_prompt)} rows without one "
                        "dropped)" if len(with_prompt) < len(read) else "")
            read = with_prompt
        rows.extend(read)
    _name_default_ids(rows)
    _check_unique_ids(rows)
    return rows


def phase_part(n: int, weights: Sequence[float], seed: int, part: int = 2) -> list[int]:
    """Indices of ``part`` (0: SFT, 1: reward model, 2: PPO) of ``n`` rows cut as
    DeepSpeed-Chat cuts a data set by ``--data_split`` (``dschat/utils/data/data_utils.py``,
    ``get_raw_dataset_split_index``), so that its step 3 and oppo-ds read the same prompts:

    - part ``i`` ends at ``sum_{j <= i} round(n * w_j / sum(w))`` (Python's round), and
      whatever that overshoots ``n`` by is taken off every end, so the first part absorbs the
      rounding (``n=5``, weights 1,1,1: sizes 1, 2, 2);
    - the rows are permuted by numpy's ``RandomState(seed).shuffle`` of ``arange(n)``
      (``uint32``) and part ``i`` is that permutation's slice between its bounds.

    The indices come in the permutation's order.
    """
    import numpy as np  # deferred: only the split needs it

    total = float(sum(weights))
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * float(n))))
    excess = bounds[-1] - n
    bounds = [0] + [b - excess for b in bounds[1:]]
    order = np.arange(n, dtype=np.uint32 if n < np.iinfo(np.uint32).max - 1 else np.int64)
    np.random.RandomState(seed=seed).shuffle(order)
    return [int(i) for i in order[bounds[part]:bounds[part + 1]]]


def _read_source(path: str, prompt_key: "str | SourceFormat", split: str) -> list[PromptRow]:
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        if _is_hf_datasets_dir(path):
            rows = _read_hf_dir(path, prompt_key, split)
        else:
            rows = []
            for file in _list_data_files(path, split):
                rows.extend(_read_file(file, prompt_key))
    else:
        rows = _read_file(path, prompt_key)
    return rows


def _name_default_ids(rows: list[PromptRow]) -> None:
    """Rows of files sharing a basename take ids naming the path below the files' common
    folder (``"<basename>:<line>"`` would give two rows one id)."""
    by_name: dict[str, set[str]] = {}
    for row in rows:
        if row.default_id:
            by_name.setdefault(_label(row.source), set()).add(os.path.normpath(row.source))
    rename = {}
    for sources in by_name.values():
        if len(sources) > 1:
            common = os.path.commonpath([os.path.abspath(s) for s in sources])
            rename.update({s: os.path.relpath(os.path.abspath(s), common) for s in sources})
    for row in rows:
        source = os.path.normpath(row.source)
        if row.default_id and source in rename:
            row.id = f"{rename[source]}:{row.line}"


def _is_hf_datasets_dir(path: str) -> bool:
    names = set(os.listdir(path))
    return "dataset_dict.json" in names or {"state.json", "dataset_info.json"} <= names


def _list_data_files(path: str, split: str) -> list[str]:
    files, unexpected = [], []
    for folder, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        for name in sorted(names):
            full = os.path.join(folder, name)
            if name.startswith((".", "_")) or _DOC_FILES.match(name):
                continue
            (files if name.endswith(_FILE_SUFFIXES) else unexpected).append(full)
    if unexpected:
        raise DataError(
            f"{path}: a prompt directory must hold only .jsonl, .json (either may be "
            f"compressed: .gz, .bz2, .xz) and .parquet files (or be a datasets save_to_disk "
            f"directory); found "
            f"{[os.path.relpath(f, path) for f in unexpected]}"
        )
    if not files:
        raise DataError(f"{path}: no .jsonl, .json or .parquet files in this directory")
    plain = set(files)
    twice = [f for f in files if f != _uncompressed_name(f) and _uncompressed_name(f) in plain]
    if twice:
        raise DataError(f"{path}: holds {os.path.relpath(_uncompressed_name(twice[0]), path)} "
                        f"and its compressed copy {os.path.relpath(twice[0], path)}; both would "
                        f"be read, every prompt twice: keep one")
    splits = {f: _split_of(os.path.relpath(f, path)) for f in files}
    if not any(splits.values()):
        return sorted(files)
    want = SPLIT_WORDS.get(split.lower(), split.lower())
    chosen = [f for f in files if splits[f] == want]
    if not chosen:
        found = sorted({s for s in splits.values() if s})
        raise DataError(f"{path}: no files of split {split!r} (data.split); its files are named "
                        f"for the splits {found}")
    skipped = [os.path.relpath(f, path) for f in files if f not in chosen]
    logger.info("%s: split %r: %s; not read: %s", path, split,
                ", ".join(os.path.relpath(f, path) for f in sorted(chosen)), ", ".join(skipped) or "none")
    return sorted(chosen)


def _split_of(relative: str) -> Optional[str]:
    """The split a data file belongs to by its folders' or its own name, else None."""
    for part in relative.split(os.sep):
        match = _SPLIT_NAME.match(part)
        if match and match.group(1).lower() in SPLIT_WORDS:
            return SPLIT_WORDS[match.group(1).lower()]
    return None


def _read_file(path: str, prompt_key: "str | SourceFormat") -> list[PromptRow]:
    kind = _uncompressed_name(path)
    if kind.endswith(".jsonl"):
        return _read_jsonl(path, prompt_key)
    if kind.endswith(".json"):
        return _read_json(path, prompt_key)
    if path.endswith(".parquet"):
        return _read_parquet(path, prompt_key)
    raise DataError(
        f"{path}: unsupported file type; expected .jsonl, .json (either may be compressed: "
        ".gz, .bz2, .xz), .parquet, or a datasets save_to_disk directory"
    )


def _uncompressed_name(path: str) -> str:
    """``path`` without a compression suffix (``a.jsonl.gz`` -> ``a.jsonl``)."""
    stem, suffix = os.path.splitext(path)
    return stem if suffix in _COMPRESSED else path


def _open_bytes(path: str):
    """``path`` opened for reading bytes, decompressed on the fly where its name says so."""
    opener = _COMPRESSED.get(os.path.splitext(path)[1], open)
    return opener(path, "rb")


def _lines(path: str):
    """``(line_no, bytes)`` of ``path``'s (decompressed) lines, from 1; a file that does not
    decompress is a DataError naming the last line read."""
    line_no = 0
    with _open_bytes(path) as f:
        try:
            for line_no, raw in enumerate(f, start=1):
                yield line_no, raw
        except _DECOMPRESS_ERRORS as e:
            raise DataError(f"{path}: cannot decompress after line {line_no}: "
                            f"{type(e).__name__}: {e}") from None


def _read_jsonl(path: str, prompt_key: "str | SourceFormat") -> list[PromptRow]:
    rows: list[PromptRow] = []
    blank_line = None  # first blank line not yet followed by a record
    for line_no, raw in _lines(path):
        where = f"{path}:{line_no}"
        try:
            text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError as e:
            reason = f"{e.reason} at byte {e.start}"
            raise DataError(f"{where}: not valid UTF-8 ({reason})") from None
        if not text.strip():
            blank_line = blank_line or line_no
            continue
        if blank_line is not None:
            raise DataError(
                f"{path}:{blank_line}: blank line before the end of the file "
                f"(next record at line {line_no})"
            )
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {_type_name(record)}")
        rows.append(_make_row(record, prompt_key, path, line_no, "line"))
    return rows


def _read_json(path: str, prompt_key: "str | SourceFormat") -> list[PromptRow]:
    """A JSON array of objects (rows from 0), or JSON lines under a .json name."""
    try:
        with _open_bytes(path) as f:
            data = f.read(4096)
            if not data.decode("utf-8-sig", errors="replace").lstrip().startswith("["):
                return _read_jsonl(path, prompt_key)
            data += f.read()
    except _DECOMPRESS_ERRORS as e:
        raise DataError(f"{path}: cannot decompress: {type(e).__name__}: {e}") from None
    try:
        records = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    rows = []
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{path}: row {i}: expected a JSON object, got {_type_name(record)}")
        rows.append(_make_row(record, prompt_key, path, i, "row"))
    return rows


def _read_parquet(path: str, prompt_key: "str | SourceFormat") -> list[PromptRow]:
    import pyarrow.parquet as pq  # deferred: only parquet users pay for the import

    try:
        records = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several unrelated types for unreadable files
        raise DataError(f"{path}: cannot read parquet file: {e}") from None
    return [_make_row(r, prompt_key, path, i, "row") for i, r in enumerate(records)]


def _read_hf_dir(path: str, prompt_key: "str | SourceFormat", split: str) -> list[PromptRow]:
    import datasets  # deferred: slow import, and only needed for this format

    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path}: no split {split!r}; the dataset has {sorted(loaded)}")
        loaded = loaded[split]
    return [_make_row(r, prompt_key, path, i, "row") for i, r in enumerate(loaded.to_list())]


def _make_row(
    record: Mapping[str, Any], prompt_key: "str | SourceFormat", source: str, line: int, unit: str
) -> PromptRow:
    where = _where(source, line, unit)
    if isinstance(prompt_key, SourceFormat):
        return _built_row(record, prompt_key, source, line, unit)
    if prompt_key not in record:
        raise DataError(f"{where}: no {prompt_key!r} field; the row has keys {sorted(record)}")
    value = record[prompt_key]
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: {prompt_key!r} is empty or whitespace only")
    elif isinstance(value, list):
        value = _check_messages(value, where, prompt_key)
    else:
        raise DataError(
            f"{where}: {prompt_key!r} must be a string or a list of chat messages, "
            f"got {_type_name(value)}"
        )
    row_id = record.get("id")
    if row_id is None:
        return PromptRow(value, source, line, f"{_label(source)}:{line}", unit, default_id=True)
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise DataError(f"{where}: 'id' must be a string or an integer, got {_type_name(row_id)}")
    if isinstance(row_id, str) and not row_id.strip():
        raise DataError(f"{where}: 'id' is empty")
    return PromptRow(value, source, line, str(row_id), unit)


def _built_row(record: Mapping[str, Any], fmt: SourceFormat, source: str, line: int,
               unit: str) -> PromptRow:
    """A row whose prompt ``fmt`` builds from its fields (None: the row has none)."""
    where = _where(source, line, unit)
    try:
        value = fmt.prompt(record)
    except (KeyError, IndexError, TypeError) as err:
        raise DataError(f"{where}: not a row of {fmt.name} as DeepSpeed-Chat reads it ({type(err).__name__}: "
                        f"{err}); the row has keys {sorted(record)} (data.deepspeed_chat_formats="
                        f"false reads the source by data.prompt_key instead)") from None
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: {fmt.name}'s prompt is not text: {_type_name(value)}")
    return PromptRow(value, source, line, f"{_label(source)}:{line}", unit, default_id=True)


def _label(source: str) -> str:
    return os.path.basename(os.path.normpath(source))


def _check_messages(messages: list[Any], where: str, prompt_key: str) -> list[dict[str, Any]]:
    if not messages:
        raise DataError(f"{where}: {prompt_key!r} is an empty list of messages")
    cleaned = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise DataError(
                f"{where}: {prompt_key!r} message {i} must be an object with 'role' and "
                f"'content', got {_type_name(message)}"
            )
        message = {k: v for k, v in message.items() if v is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = "missing" if key not in message else _type_name(message[key])
                raise DataError(
                    f"{where}: {prompt_key!r} message {i}: {key!r} must be a string ({got})"
                )
        if not message["role"].strip():
            raise DataError(f"{where}: {prompt_key!r} message {i}: 'role' is empty")
        cleaned.append(message)
    if not any(m["content"].strip() for m in cleaned):
        raise DataError(f"{where}: {prompt_key!r} messages are all empty or whitespace only")
    return cleaned


def _check_unique_ids(rows: list[PromptRow]) -> None:
    first_seen: dict[str, PromptRow] = {}
    for row in rows:
        other = first_seen.setdefault(row.id, row)
        if other is not row:
            raise DataError(f"{row.where}: duplicate id {row.id!r} (first at {other.where})")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


# --------------------------------------------------------------------------------------------
# Tokenising
# --------------------------------------------------------------------------------------------


def encode_prompts(
    rows: Sequence[PromptRow],
    tokenizer: Any,
    max_prompt_len: int,
    overlong: str = "error",
    chat_template: str = "auto",
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

    Raises:
        ValueError: bad ``overlong``, ``chat_template`` or ``max_prompt_len``, or
            ``chat_template="on"`` with a tokenizer that has no template.
        DataError: a row that cannot be encoded, encodes to nothing, or is too long under
            ``overlong="error"``.
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

    out = EncodedPrompts(prompts=[])
    for row in rows:
        ids = _encode_row(row, tokenizer, use_template)
        out.n_continued += _continues(row.text_or_messages)
        if len(ids) > max_prompt_len:
            if overlong == "error":
                raise DataError(
                    f"{row.where}: prompt {row.id!r} is {len(ids)} tokens, over "
                    f"max_prompt_len={max_prompt_len} (set overlong to 'truncate' or 'skip' "
                    "to allow this)"
                )
            if overlong == "skip":
                out.n_skipped += 1
                continue
            ids = ids[-max_prompt_len:]
            out.n_truncated += 1
        out.prompts.append(Prompt(row.id, ids, row.source, row.line, row.unit))
    return out


def _continues(prompt: str | list[dict[str, Any]]) -> bool:
    """A chat prompt whose last message is the assistant's: its response continues it."""
    return not isinstance(prompt, str) and prompt[-1]["role"] == "assistant"


def _encode_row(row: PromptRow, tokenizer: Any, use_template: bool) -> list[int]:
    prompt = row.text_or_messages
    if use_template:
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
        encoded = tokenizer(prompt, add_special_tokens=True)["input_ids"]
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
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; the stream then yields exactly what the saved one would.

        Raises ``StreamMismatch`` (a ``ValueError``) if the state was saved with a different
        seed, world size, shuffle setting or number of prompts (when those keys are present),
        since the order would differ.
        """
        mine = self.state_dict()
        changed = {k: (state[k], mine[k]) for k in ("seed", "world_size", "num_prompts", "shuffle")
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
