"""Reading prompt files: every format a user's prompts come in, with errors that name the row.

:func:`read_prompt_rows` reads prompts from a ``.jsonl``, ``.json``, ``.csv``, ``.tsv`` or
``.parquet`` file (the text ones also compressed), a local Hugging Face dataset saved with
``save_to_disk``, or a directory of such files (a hub snapshot's split-named shards among
them), a list of such sources, and cuts them as DeepSpeed-Chat's ``--data_split`` does
(:func:`phase_part`). Every bad row raises
:class:`DataError` naming the file and the line (or row), so a user can go straight to it.

Tokenising the rows and handing them out per rank is :mod:`oppo_ds.data`'s part.
"""

from __future__ import annotations

import bz2
import csv
import dataclasses
import gzip
import json
import logging
import lzma
import os
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

logger = logging.getLogger(__name__)

__all__ = [
    "DataError",
    "PromptRow",
    "SourceFormat",
    "location",
    "phase_part",
    "read_prompt_rows",
]

# JSON files may come compressed (Anthropic/hh-rlhf ships .jsonl.gz), as `datasets` reads them
_COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_TEXT_KINDS = ("jsonl", "json", "csv", "tsv")
_FILE_SUFFIXES = (".parquet",) + tuple(
    f".{kind}{zipped}" for kind in _TEXT_KINDS for zipped in ("", *_COMPRESSED))
# what every "unsupported file" message lists
_KINDS_TEXT = ".jsonl, .json, .csv, .tsv (any of them may be compressed: .gz, .bz2, .xz), .parquet"
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
# a split word anywhere in a file's or folder's name, as a word of its own (digits and any
# other non-letter delimit it: ``gsm8k_train.jsonl``, ``train-00000-of-00001.parquet``), with
# the qualifiers a hub data set puts after it (``train_sft``, ``test_prefs``): the split's name
_SPLIT_IN_NAME = re.compile(
    r"(?<![A-Za-z])(?:" + "|".join(sorted(SPLIT_WORDS, key=len, reverse=True)) + r")"
    r"(?:_[A-Za-z]+)*(?![A-Za-z0-9])", re.IGNORECASE)


class DataError(ValueError):
    """A problem in the user's data.

    The message starts with where the problem is: ``"<file>:<line>: "`` for jsonl and csv
    (1-based lines, as editors show them) and ``"<path>: row <i>: "`` for parquet files and
    HF datasets directories (0-based rows, as ``dataset[i]`` and pandas index them).
    """


@dataclasses.dataclass
class PromptRow:
    """One prompt as read from disk, before tokenisation."""

    text_or_messages: str | list[dict[str, Any]]
    """A plain string, or chat messages ``[{"role": ..., "content": ...}, ...]``."""
    source: str
    """The file (or HF datasets directory) the row came from."""
    line: int
    """1-based line for jsonl and csv (where the record starts); 0-based row index for parquet,
    a JSON array and HF datasets (see ``unit``)."""
    id: str
    """The row's ``"id"`` field when present (under its source's name, ``a.jsonl/0``, where
    several sources are read), else ``"<basename>:<line>"``; unique per read."""
    unit: str = "line"
    """``"line"`` (jsonl, csv) or ``"row"`` (parquet, HF datasets): how ``line`` is reported."""
    default_id: bool = False
    """The row had no ``"id"``: ``id`` was made from its file's name and its line."""
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The row's other fields (not the prompt's, not ``"id"``), for a reward function
    (``model.reward_function``): e.g. the reference answer a verifiable reward checks."""

    @property
    def where(self) -> str:
        """The location prefix used in error messages, without the trailing ``": "``."""
        return location(self.source, self.line, self.unit)


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



def location(source: str, line: int, unit: str) -> str:
    """``"<file>:<line>"`` for a jsonl or csv line, ``"<path>: row <i>"`` for a parquet or
    dataset row."""
    return f"{source}:{line}" if unit == "line" else f"{source}: row {line}"



def read_prompt_rows(
    path: str | os.PathLike | Sequence[str | os.PathLike], prompt_key: str = "prompt",
    split: str = "train", phase_split: Optional[Sequence[float]] = None, phase_seed: int = 0,
    source_format: Optional[Callable[[str], Optional[SourceFormat]]] = None,
    key_name: str = "data.prompt_key", skip_blank: bool = False,
) -> list[PromptRow]:
    """Read prompts from ``path``, or from several paths one after another (their rows
    concatenated in the order given).

    Each path may be:

    - a ``.jsonl`` file: one JSON object per line. Blank lines at the end are ignored; a blank
      line before the last record is an error (it usually means a broken export).
    - a ``.json`` file: a JSON array of objects (rows counted from 0), or JSON lines.
    - a ``.csv`` or ``.tsv`` file under a header row naming its columns; every cell is text,
      an empty one (but the prompt's) null; quoted cells may span lines; blank lines skipped.
    - any of them compressed: ``.jsonl.gz``, ``.json.gz``, ``.csv.gz``, ``.bz2``, ``.xz``
      (lines are counted in the decompressed text).
    - a ``.parquet`` file.
    - a directory written by ``datasets.Dataset.save_to_disk`` or
      ``datasets.DatasetDict.save_to_disk`` (then ``split`` picks the split).
    - a directory of such files, in folders or not, e.g. a Hugging Face hub snapshot
      (``README.md``, ``data/train-00000-of-00001.parquet``, ``data/test-...``). Where files
      or folders are named by split (``train``, ``validation``/``valid``/``val``/``dev``,
      ``test``/``eval``, as a word anywhere in the name: ``gsm8k_train.jsonl``,
      ``data/train/0.parquet``, with qualifiers: ``train_sft``), ``split`` picks them: those
      named for it exactly, else for its kind (``eval`` reads ``test``); the others are named
      in a log line. Several split names of the kind (``train_sft``, ``train_gen``), or the
      split in several folders, each a configuration (gsm8k's ``main/``, ``socratic/``), are
      an error saying how to pick one. Where no name holds a split every file is read, said
      in a log line. Files are read in sorted order;
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
    the two have in common instead (``en/train.jsonl:3``). Of several sources, the ids
    written in the rows are put under their source's name, its basename (or its path below
    the common folder, as above): ``a.jsonl/0``, so that sources numbering their rows alike
    can be read together; one source's stay as written. Ids must be unique across
    everything read: a written id twice in one source is an error naming both rows.

    ``phase_split`` (three weights, as DeepSpeed-Chat's ``--data_split``): of each path's rows,
    only the PPO part (:func:`phase_part`, seeded by ``phase_seed``) is returned, in file
    order. Every row is checked all the same.

    ``source_format(path)``: a :class:`SourceFormat` for a path whose prompts are built from
    other fields (its split read instead of ``split``, its cut before ``phase_split``, rows
    without a prompt dropped after the cuts), or None to read it as above.

    ``key_name``: the config key that set ``prompt_key``, named where a file lacks the field
    (``data.ptx_key`` for the pretraining text).

    ``skip_blank``: a row whose text is empty or whitespace only is skipped, after the cuts,
    and such rows are counted in one log line, where it would be an error (pretraining text:
    wikitext's empty rows, which DeepSpeed-Chat tokenises without complaint).

    Raises:
        DataError: naming the file and line (or row) of the first bad row, the missing path,
        or a path that holds no row.
    """
    paths = [os.fspath(path)] if isinstance(path, (str, os.PathLike)) else [os.fspath(p) for p in path]
    if not paths:
        raise DataError("no prompt source given")
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise DataError(f"{twice[0]}: named twice among the prompt sources {paths}")
    rows = []
    blank = 0  # rows skipped for their empty text (skip_blank)
    by_source: list[tuple[str, list[PromptRow]]] = []  # of several sources
    for source in paths:
        fmt = source_format(source) if source_format is not None else None
        read = _read_source(source, fmt or prompt_key, fmt.split if fmt else split, key_name,
                            skip_blank)
        if not read:  # else a later, wrong cause: "no usable prompt (all over max_prompt_len)"
            what = ("its data files are empty, or hold" if os.path.isdir(source)
                    else "the file is empty, or holds")
            raise DataError(f"{source}: no prompt rows ({what} only blank lines or a header)")
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
        elif skip_blank:
            with_text = [r for r in read if r.text_or_messages is not None]
            blank += len(read) - len(with_text)
            read = with_text
        if len(paths) > 1:
            by_source.append((source, read))
        rows.extend(read)
    _qualify_written_ids(by_source)
    if blank:
        logger.info("%s: %d rows skipped, their %r (%s) empty or whitespace only",
                    " + ".join(paths), blank, prompt_key, key_name)
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


def _read_source(path: str, prompt_key: "str | SourceFormat", split: str, key_name: str,
                 skip_blank: bool) -> list[PromptRow]:
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        if _is_hf_datasets_dir(path):
            rows = _read_hf_dir(path, prompt_key, split, skip_blank)
        else:
            rows = []
            for file in _list_data_files(path, split):
                rows.extend(_read_file(file, prompt_key, key_name, skip_blank))
    else:
        rows = _read_file(path, prompt_key, key_name, skip_blank)
    return rows


def _name_default_ids(rows: list[PromptRow]) -> None:
    """Rows of files sharing a basename take ids naming the path below the files' common
    folder (``"<basename>:<line>"`` would give two rows one id)."""
    names = _short_names({os.path.normpath(r.source) for r in rows if r.default_id})
    for row in rows:
        source = os.path.normpath(row.source)
        if row.default_id and names[source] != _label(source):
            row.id = f"{names[source]}:{row.line}"


def _qualify_written_ids(by_source: list[tuple[str, list[PromptRow]]]) -> None:
    """The ids written in the rows of several sources, each put under its source's name
    (``a.jsonl/0``): two sources numbering their rows from 0 are no duplicates. One source's
    ids stay as written (``by_source`` is then empty), so its checkpoints keep them."""
    names = _short_names({os.path.normpath(source) for source, _ in by_source})
    for source, rows in by_source:
        for row in rows:
            if not row.default_id:
                row.id = f"{names[os.path.normpath(source)]}/{row.id}"


def _short_names(paths: set[str]) -> dict[str, str]:
    """Each of ``paths`` by its basename, or, where several share it, by its path below their
    common folder (``en/train.jsonl``, ``de/train.jsonl``)."""
    by_name: dict[str, set[str]] = {}
    for path in paths:
        by_name.setdefault(_label(path), set()).add(path)
    names = {}
    for name, group in by_name.items():
        if len(group) == 1:
            names.update(dict.fromkeys(group, name))
        else:
            common = os.path.commonpath([os.path.abspath(p) for p in group])
            names.update({p: os.path.relpath(os.path.abspath(p), common) for p in group})
    return names


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
            f"{path}: a prompt directory must hold only {_KINDS_TEXT} files (or be a datasets "
            f"save_to_disk directory); found "
            f"{[os.path.relpath(f, path) for f in unexpected]}"
        )
    if not files:
        raise DataError(f"{path}: no {_KINDS_TEXT} files in this directory")
    plain = set(files)
    twice = [f for f in files if f != _uncompressed_name(f) and _uncompressed_name(f) in plain]
    if twice:
        raise DataError(f"{path}: holds {os.path.relpath(_uncompressed_name(twice[0]), path)} "
                        f"and its compressed copy {os.path.relpath(twice[0], path)}; both would "
                        f"be read, every prompt twice: keep one")
    return _files_of_split(path, sorted(files), split)


def _files_of_split(path: str, files: list[str], split: str) -> list[str]:
    """Of ``files`` (under ``path``), those of ``split``, by the split names their files' or
    folders' names hold (``_SPLIT_IN_NAME``): the files named for ``split`` itself
    (``train_sft``), else those named for a split of its kind (``split=eval`` reads
    ``test.jsonl``); every file where no name holds a split. A DataError where none is of
    ``split``, where several split names of its kind are (``train_sft``, ``train_gen``) or
    where it lies in several folders, each a configuration of the data set (gsm8k's
    ``main/train-*`` and ``socratic/train-*``: the same questions twice)."""
    named = {f: _split_name(os.path.relpath(f, path)) for f in files}
    if not any(named.values()):
        logger.info("%s: no file or folder is named for a split (%s), so data.split %r picks "
                    "nothing: all %d files are read", path, "/".join(SPLIT_WORDS), split,
                    len(files))
        return files
    want = split.lower()
    chosen = [f for f in files if named[f] == want]
    if not chosen:
        kind = SPLIT_WORDS.get(want, want)
        chosen = [f for f in files if named[f] and SPLIT_WORDS[_split_word(named[f])] == kind]
        several = sorted({named[f] for f in chosen})
        if len(several) > 1:
            raise DataError(f"{path}: files named for several {kind} splits, {several}; set "
                            f"data.split to the one to read (e.g. data.split: {several[0]})")
    if not chosen:
        raise DataError(f"{path}: no files of split {split!r} (data.split); its files are named "
                        f"for the splits {sorted({n for n in named.values() if n})}")
    configs = sorted({_config_of(os.path.relpath(f, path)) for f in chosen})
    if len(configs) > 1:
        raise DataError(
            f"{path}: split {split!r} is in several folders, each a configuration of the data "
            f"set (read together, a data set's configurations often hold the same prompts "
            f"twice): {configs}; point data.prompts at the one to read "
            f"({os.path.join(path, configs[-1])}), or list the ones to read together")
    skipped = [os.path.relpath(f, path) for f in files if f not in chosen]
    logger.info("%s: split %r: %s; not read: %s", path, split,
                ", ".join(os.path.relpath(f, path) for f in chosen), ", ".join(skipped) or "none")
    return chosen


def _split_part(relative: str) -> Optional[tuple[int, str]]:
    """Where a data file's path names its split: the index of the first part (folder or file,
    from the top) that names one, and the split's name, lower-case (``train``,
    ``train_sft``); None where no part does."""
    for i, part in enumerate(relative.split(os.sep)):
        match = _SPLIT_IN_NAME.search(part)
        if match:
            return i, match.group(0).lower()
    return None


def _split_name(relative: str) -> Optional[str]:
    """The split a data file belongs to by its folders' or its own name, else None."""
    found = _split_part(relative)
    return found[1] if found else None


def _split_word(name: str) -> str:
    """The split word a split name starts with (``train_sft`` -> ``train``)."""
    return name.split("_", 1)[0]


def _config_of(relative: str) -> str:
    """The folders of a data file above the first part of its path that names its split
    (``main`` of ``main/train-0.parquet``, ``""`` of ``train/0.jsonl`` and of
    ``train/shard1/0.parquet``: folders below the split's are its parts): its configuration."""
    return os.path.join("", *relative.split(os.sep)[:_split_part(relative)[0]])


def _read_file(path: str, prompt_key: "str | SourceFormat", key_name: str,
               skip_blank: bool = False) -> list[PromptRow]:
    kind = _uncompressed_name(path)
    if kind.endswith(".jsonl"):
        return _read_jsonl(path, prompt_key, skip_blank)
    if kind.endswith(".json"):
        return _read_json(path, prompt_key, skip_blank)
    if kind.endswith((".csv", ".tsv")):
        return _read_csv(path, prompt_key, "\t" if kind.endswith(".tsv") else ",", key_name,
                         skip_blank)
    if path.endswith(".parquet"):
        return _read_parquet(path, prompt_key, skip_blank)
    raise DataError(f"{path}: unsupported file type; expected {_KINDS_TEXT}, or a datasets "
                    "save_to_disk directory")


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


def _loads(text: str):
    """``json.loads``, and the objects in it that gave a key twice (json keeps the last one),
    each ``id`` with that key. The check costs a dict per object; a walk of the result, run
    only where a key did repeat, finds the row."""
    repeated: dict[int, str] = {}

    def pairs_to_dict(pairs: list) -> dict:
        obj = dict(pairs)
        if len(obj) < len(pairs):
            seen = set()
            repeated[id(obj)] = next(k for k, _ in pairs if k in seen or seen.add(k))
        return obj
    return json.loads(text, object_pairs_hook=pairs_to_dict), repeated


def _repeated_key(value, repeated: dict[int, str]) -> Optional[str]:
    """The key an object in ``value`` gave twice (``repeated`` from ``_loads``), or None."""
    if isinstance(value, list):
        return next((k for k in (_repeated_key(v, repeated) for v in value) if k is not None),
                    None)
    if isinstance(value, dict):
        key = repeated.get(id(value))
        return key if key is not None else _repeated_key(list(value.values()), repeated)
    return None


def _check_unique_keys(record, repeated: dict[int, str], where: str) -> None:
    key = _repeated_key(record, repeated) if repeated else None
    if key is not None:
        raise DataError(f"{where}: key {key!r} appears twice in one object (JSON would keep "
                        f"the last one silently); keep the one you mean")


def _read_jsonl(path: str, prompt_key: "str | SourceFormat",
                skip_blank: bool = False) -> list[PromptRow]:
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
            record, repeated = _loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {_type_name(record)}")
        _check_unique_keys(record, repeated, where)
        rows.append(_make_row(record, prompt_key, path, line_no, "line", skip_blank))
    return rows


def _read_json(path: str, prompt_key: "str | SourceFormat",
               skip_blank: bool = False) -> list[PromptRow]:
    """A JSON array of objects (rows from 0), or JSON lines under a .json name."""
    try:
        with _open_bytes(path) as f:
            data = f.read(4096)
            if not data.decode("utf-8-sig", errors="replace").lstrip().startswith("["):
                return _read_jsonl(path, prompt_key, skip_blank)
            data += f.read()
    except _DECOMPRESS_ERRORS as e:
        raise DataError(f"{path}: cannot decompress: {type(e).__name__}: {e}") from None
    try:
        records, repeated = _loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    rows = []
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{path}: row {i}: expected a JSON object, got {_type_name(record)}")
        _check_unique_keys(record, repeated, f"{path}: row {i}")
        rows.append(_make_row(record, prompt_key, path, i, "row", skip_blank))
    return rows


def _read_csv(path: str, prompt_key: "str | SourceFormat", delimiter: str,
              key_name: str, skip_blank: bool = False) -> list[PromptRow]:
    """Comma- (or tab-) separated values under a header row that names the fields.

    Every cell is text, as written (no guessing of numbers or dates); an empty cell other than
    the prompt's is null, as ``datasets`` reads one, so an empty ``id`` takes the default id.
    Quoted cells may hold the delimiter and line breaks; a row is reported by the line it
    starts on. Blank lines are skipped.
    """
    csv.field_size_limit(max(csv.field_size_limit(), 1 << 30))  # long prompts: 128 KiB default

    def decoded():  # line by line, so that a byte that is not UTF-8 is named by its line
        for line_no, raw in _lines(path):
            try:
                yield raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{line_no}: not valid UTF-8 ({e.reason} at byte "
                                f"{e.start})") from None

    reader = csv.reader(decoded(), delimiter=delimiter, strict=True)
    rows: list[PromptRow] = []
    header: Optional[list[str]] = None
    header_line = 0
    start = 1  # the line the next record starts on
    while True:
        try:
            cells = next(reader, None)
        except csv.Error as e:
            raise DataError(f"{path}:{start}: malformed row: {e}") from None
        if cells is None:
            return rows
        line, start = start, reader.line_num + 1
        if not cells:
            continue
        if header is None:
            twice = sorted({c for c in cells if cells.count(c) > 1})
            if twice:
                raise DataError(f"{path}:{line}: the header names {twice[0]!r} twice")
            if isinstance(prompt_key, str) and prompt_key not in cells:
                raise DataError(f"{path}:{line}: the header has no {prompt_key!r} column "
                                f"({key_name}); its columns are {cells}")
            header, header_line = cells, line
            continue
        if len(cells) != len(header):
            raise DataError(f"{path}:{line}: {len(cells)} fields, the header (line "
                            f"{header_line}) has {len(header)}: {header}")
        record = {k: v if v != "" or k == prompt_key else None for k, v in zip(header, cells)}
        rows.append(_make_row(record, prompt_key, path, line, "line", skip_blank))


def _read_parquet(path: str, prompt_key: "str | SourceFormat",
                  skip_blank: bool = False) -> list[PromptRow]:
    import pyarrow.parquet as pq  # deferred: only parquet users pay for the import

    try:
        records = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several unrelated types for unreadable files
        raise DataError(f"{path}: cannot read parquet file: {e}") from None
    return [_make_row(r, prompt_key, path, i, "row", skip_blank) for i, r in enumerate(records)]


def _read_hf_dir(path: str, prompt_key: "str | SourceFormat", split: str,
                 skip_blank: bool = False) -> list[PromptRow]:
    import datasets  # deferred: slow import, and only needed for this format

    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path}: no split {split!r}; the dataset has {sorted(loaded)}")
        loaded = loaded[split]
    return [_make_row(r, prompt_key, path, i, "row", skip_blank)
            for i, r in enumerate(loaded.to_list())]


def _make_row(
    record: Mapping[str, Any], prompt_key: "str | SourceFormat", source: str, line: int, unit: str,
    skip_blank: bool = False,
) -> PromptRow:
    """The row of ``record``; with ``skip_blank``, a row whose text is blank has None for it
    (dropped after the cuts, as a built row without a prompt is)."""
    where = location(source, line, unit)
    if isinstance(prompt_key, SourceFormat):
        return _built_row(record, prompt_key, source, line, unit)
    if prompt_key not in record:
        raise DataError(f"{where}: no {prompt_key!r} field; the row has keys {sorted(record)}")
    value = record[prompt_key]
    if isinstance(value, str):
        if not value.strip():
            if skip_blank:
                return PromptRow(None, source, line, f"{_label(source)}:{line}", unit,
                                 default_id=True)
            raise DataError(f"{where}: {prompt_key!r} is empty or whitespace only")
    elif isinstance(value, list):
        value = _check_messages(value, where, prompt_key)
    else:
        raise DataError(
            f"{where}: {prompt_key!r} must be a string or a list of chat messages, "
            f"got {_type_name(value)}"
        )
    row_id = record.get("id")
    fields = {k: v for k, v in record.items() if k not in (prompt_key, "id")}
    if row_id is None:
        return PromptRow(value, source, line, f"{_label(source)}:{line}", unit, default_id=True,
                         fields=fields)
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise DataError(f"{where}: 'id' must be a string or an integer, got {_type_name(row_id)}")
    if isinstance(row_id, str) and not row_id.strip():
        raise DataError(f"{where}: 'id' is empty")
    return PromptRow(value, source, line, str(row_id), unit, fields=fields)


def _built_row(record: Mapping[str, Any], fmt: SourceFormat, source: str, line: int,
               unit: str) -> PromptRow:
    """A row whose prompt ``fmt`` builds from its fields (None: the row has none)."""
    where = location(source, line, unit)
    try:
        value = fmt.prompt(record)
    except (KeyError, IndexError, TypeError) as err:
        raise DataError(f"{where}: not a row of {fmt.name} as DeepSpeed-Chat reads it ({type(err).__name__}: "
                        f"{err}); the row has keys {sorted(record)} (data.deepspeed_chat_formats="
                        f"false reads the source by data.prompt_key instead)") from None
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: {fmt.name}'s prompt is not text: {_type_name(value)}")
    return PromptRow(value, source, line, f"{_label(source)}:{line}", unit, default_id=True,
                     fields={k: v for k, v in record.items() if k != "id"})


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
