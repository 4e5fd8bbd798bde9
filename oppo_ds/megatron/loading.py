"""This rank's shard of a model read straight from a Hugging Face safetensors checkpoint.

The DeepSpeed backend builds the whole HF model (``models.build_causal_lm`` /
``build_value_model``); converting that model into a tensor/pipeline shard would hold the
whole model in host memory on every rank (~280 GB for a 70B checkpoint in fp32). Here the HF
model is never instantiated: the shape comes from ``config.json`` (``convert.shape_of``) and
``SafetensorsReader`` gives ``convert.hf_to_megatron`` one tensor at a time, reading only this
rank's rows or columns of every tensor the conversion splits (``safe_open(...).get_slice``),
and only the tensors of this rank's pipeline stage. Host memory at start-up is then this
rank's shard twice (the converted state and the ``GPTModel`` it is copied into) plus one
block being converted.

A checkpoint is a directory with ``config.json`` and either ``model.safetensors.index.json``
(sharded) or ``*.safetensors`` files. A causal LM's decoder keys start with ``model.``; so do
an HF ``*ForSequenceClassification``'s, which keeps its head as ``score.weight`` (what
oppo-ds saves a value model as, ``models.ValueHeadModel.save_pretrained``); a value model
oppo-ds saved before is an HF base model (keys without ``model.``) plus
``value_head.safetensors``. The head is found as the HF path finds it
(``models.read_value_head``) and refused the same way when a reward model has none.
"""
from __future__ import annotations

import json
import os

import torch

from ..checkpoint_files import CONVERTED_DTYPES, VALUE_HEAD_FILE, quantized_problem
from ..models import check_local_dir, read_value_head
from .convert import CheckpointError, hf_prefix


INDEX_FILE = "model.safetensors.index.json"


def weight_files(path: str) -> list[str]:
    """The safetensors weight files of a checkpoint directory (not the value head's file)."""
    return [os.path.join(path, name) for name in sorted(os.listdir(path))
            if name.endswith(".safetensors") and name != VALUE_HEAD_FILE]


def is_safetensors_checkpoint(source: str) -> bool:
    """True for a local HF checkpoint directory whose weights are safetensors."""
    return (os.path.isdir(source) and os.path.isfile(os.path.join(source, "config.json"))
            and (os.path.isfile(os.path.join(source, INDEX_FILE)) or bool(weight_files(source))))


class SafetensorsReader:
    """The tensors of a safetensors checkpoint by HF name, read when asked: whole
    (``reader(name)``) or a block of rows / columns (``rows``, ``cols``), which is all that
    ``convert.hf_to_megatron`` reads of a tensor it splits (checking its size, ``dims``).

    ``extra`` holds in-memory tensors served before the files (the value head, found apart
    from the body's weights). Files are opened on first use and kept open until ``close``;
    they are memory-mapped, so only the bytes of the blocks asked for are read.
    """

    def __init__(self, path: str):
        self.path = path
        index, whole = os.path.join(path, INDEX_FILE), os.path.join(path, "model.safetensors")
        # as transformers reads it: a whole model.safetensors before any index beside it
        # (a stale one, whose shards may be gone), else the index, else every weights file
        if os.path.isfile(index) and not os.path.isfile(whole):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._where = {name: os.path.join(path, file) for name, file in weight_map.items()}
            self._listing = index
        else:
            from safetensors import safe_open

            self._where = {}
            files = [whole] if os.path.isfile(whole) else weight_files(path)
            for file in files:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        self._where.setdefault(name, file)
            self._listing = ", ".join(os.path.basename(f) for f in files) or "no files"
        self._open: dict[str, tuple[object, set]] = {}
        self.extra: dict[str, torch.Tensor] = {}

    def names(self) -> set[str]:
        return set(self._where) | set(self.extra)

    def _handle(self, name: str):
        """The open file holding ``name``; ``CheckpointError`` naming the key and the file
        (or the index / files searched) when it is not there."""
        from safetensors import safe_open

        file = self._where.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in the checkpoint "
                                  f"(searched {self._listing}); its keys do not match the "
                                  f"architecture in config.json")
        if file not in self._open:
            if not os.path.isfile(file):
                raise CheckpointError(f"{file}: file missing (the index lists {name!r} in it)")
            handle = safe_open(file, framework="pt")
            self._open[file] = (handle, set(handle.keys()))
        handle, keys = self._open[file]
        if name not in keys:
            raise CheckpointError(f"{file}: no tensor {name!r} (the index lists it there)")
        return handle

    def _slice(self, name: str):
        """The file's lazy view of ``name``; ``CheckpointError`` naming the tensor and the
        file when it is stored in a dtype the conversion does not take (FP8, int8: values
        that mean something only with scales the conversion would not apply)."""
        part = self._handle(name).get_slice(name)
        dtype = part.get_dtype()
        if dtype not in CONVERTED_DTYPES:
            raise CheckpointError(
                f"{self._where[name]}: tensor {name!r} is stored as {dtype}; system.backend "
                f"megatron converts {', '.join(CONVERTED_DTYPES)} weights only (a quantized "
                f"checkpoint's values need scales it does not apply): dequantize the "
                f"checkpoint to bf16 first")
        return part

    def __call__(self, name: str) -> torch.Tensor:
        if name in self.extra:
            return self.extra[name]
        self._slice(name)  # the dtype checked
        return self._handle(name).get_tensor(name)

    def dims(self, name: str) -> tuple[int, ...]:
        """The size of ``name`` (from the file's header; nothing read)."""
        if name in self.extra:
            return tuple(self.extra[name].shape)
        return tuple(self._slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name in self.extra:
            return self.extra[name][start:stop]
        return self._slice(name)[start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name in self.extra:
            return self.extra[name][:, start:stop]
        return self._slice(name)[:, start:stop]

    def close(self) -> None:
        self._open.clear()

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_checkpoint(path: str, kind: str, *, require_head: bool = False,
                    trust_remote_code: bool = False):
    """``(hf_config, reader, prefix)`` of a safetensors checkpoint for ``kind`` "lm" (actor,
    reference) or "value" (critic, reward; the reader then serves ``value_head.weight``: the
    checkpoint's head, or zeros when it has none and ``require_head`` is false)."""
    from transformers import AutoConfig

    if kind not in ("lm", "value"):
        raise ValueError(f"kind must be 'lm' or 'value', got {kind!r}")
    check_local_dir(path)
    problem = quantized_problem(path)
    if problem:
        raise CheckpointError(problem)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code,
                                        local_files_only=True)
    reader = SafetensorsReader(path)
    prefix = hf_prefix(reader.names())
    if kind == "value":
        try:
            head = read_value_head(path, config.hidden_size, require_head=require_head)
        except ValueError as err:
            raise CheckpointError(str(err)) from None
        if head is None:
            head = torch.zeros(1, config.hidden_size)
        reader.extra["value_head.weight"] = head
    return config, reader, prefix


def load_megatron_model(path: str, groups, kind: str, *, dtype: torch.dtype,
                        device: torch.device, require_head: bool = False,
                        trust_remote_code: bool = False, spec="local"):
    """This rank's ``MegatronModel`` read from the safetensors checkpoint ``path`` (no HF
    model built). ``ValueError`` for a shape the conversion cannot take, ``CheckpointError``
    for missing or misshapen tensors."""
    from .model import build_from_tensors

    config, reader, prefix = open_checkpoint(path, kind, require_head=require_head,
                                             trust_remote_code=trust_remote_code)
    with reader:
        try:
            return build_from_tensors(config, reader, prefix, groups, kind, dtype=dtype,
                                      device=device, spec=spec)
        except CheckpointError as err:  # the conversion's size checks do not know the path
            if str(err).startswith(path):
                raise
            raise CheckpointError(f"{path}: {err}") from None
