"""What a Hugging Face checkpoint directory holds, checked before any model is built: its
config.json, the weight files transformers would read (``WEIGHT_FILES``, a sharded index and
its shards), and what a copy can leave broken (a git-lfs pointer never pulled, a safetensors
or torch file cut short, shards without their index). A 70B checkpoint's shards take minutes
to load; these checks read headers and file ends only, and name the file and the fix."""
from __future__ import annotations

import json
import os
import re
from typing import NamedTuple, Optional

VALUE_HEAD_FILE = "value_head.safetensors"  # a value model's scalar head, beside its body


def checkpoint_config(path: str) -> Optional[dict]:
    """The ``config.json`` of the checkpoint directory ``path``, or None where it has none."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)


# the weights of a checkpoint directory in the order transformers looks for them: it reads the
# first that is there and ignores the rest (a repo can ship both indexes with one kind of shards)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
CUT_SHORT = "a weights file cut short or not in safetensors format; copy the checkpoint again"
# how a git-lfs pointer file starts: what a clone without `git lfs pull` holds for a large file
LFS_POINTER = b"version https://git-lfs"


def lfs_pointer(path: str) -> bool:
    """Whether the file ``path`` is a git-lfs pointer (the file itself never fetched)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(LFS_POINTER)) == LFS_POINTER
    except OSError:  # unreadable: said by whoever reads it
        return False


def lfs_problem(path: str) -> str:
    folder = os.path.dirname(path)
    return (f"{path} is a git-lfs pointer, not the file itself: run `git lfs pull` in the "
            f"repository of {folder}, or copy the checkpoint again")


def unreadable(file: str, err: Exception) -> str:
    """What to say of a safetensors ``file`` that safetensors cannot open (its own message
    names no file)."""
    return f"{file} cannot be read ({err}): {CUT_SHORT}"


class WeightsRead(NamedTuple):
    """The weight files transformers reads from a checkpoint directory: the first of
    ``WEIGHT_FILES`` there, or the shards its index names (none when there is neither); the
    index's map of tensor names to files (None without an index); and why the index cannot
    be used (it does not parse, or names shards the directory does not hold), or None."""
    files: list[str]
    weight_map: Optional[dict]
    problem: Optional[str]


def weights_read(source: str) -> WeightsRead:
    """:class:`WeightsRead` of checkpoint directory ``source``."""
    first = next((name for name in WEIGHT_FILES if os.path.isfile(os.path.join(source, name))),
                 None)
    if first is None or not first.endswith(".index.json"):
        return WeightsRead([first] if first else [], None, None)
    path = os.path.join(source, first)
    try:
        with open(path) as f:
            weight_map = dict(json.load(f)["weight_map"])
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        if lfs_pointer(path):
            return WeightsRead([], None, lfs_problem(path))
        return WeightsRead([], None, f"{path} cannot be read as a weights index (a weight_map "
                                     f"of files): {err!r}")
    missing = [name for name in shards if not os.path.isfile(os.path.join(source, name))]
    if missing:
        return WeightsRead([], None, f"{path} lists {len(missing)} weight file(s) the directory "
                                     f"does not hold ({', '.join(missing[:3])}): a checkpoint "
                                     "copied in part")
    return WeightsRead(shards, weight_map, None)


def weights_problem(source: str) -> Optional[str]:
    """Why the weights transformers would read from checkpoint directory ``source``
    (``weights_read``, and a value head file) cannot be loaded, as far as is cheap to see
    before any model is built (a 70B checkpoint's shards take minutes to load): a shard its
    index lists is missing, or a safetensors file's header does not parse or does not cover
    the file (a copy cut short; ``safe_open`` maps the file and reads the header alone).
    Of a pickled ``.bin`` file only the zip directory at its end is read. A directory with
    no weights file (only config and tokenizer; shards without their index) is a problem
    too: transformers would say so only when the engines are built."""
    from safetensors import SafetensorError, safe_open

    names, _, problem = weights_read(source)
    if problem:
        return problem
    if not names and "transformers_weights" not in (checkpoint_config(source) or {}):
        return no_weights(source)
    if os.path.isfile(os.path.join(source, VALUE_HEAD_FILE)):
        names.append(VALUE_HEAD_FILE)
    for name in names:
        path = os.path.join(source, name)
        if name.endswith(".safetensors"):
            if lfs_pointer(path):  # safetensors says only "header too large"
                return lfs_problem(path)
            try:
                with safe_open(path, "pt"):
                    pass
            except (SafetensorError, OSError) as err:
                return unreadable(path, err)
        else:
            problem = torch_file_problem(path)
            if problem:
                return f"{path} cannot be read: {problem}: {CUT_SHORT}"
    return None


_SHARD = re.compile(r"^(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)$")


def no_weights(source: str) -> str:
    """What to say of checkpoint directory ``source`` holding none of ``WEIGHT_FILES``
    (transformers would fail only when the engines are built: "Error no file named ...")."""
    text = (f"{source} holds no weights transformers can load (looked for "
            f"{', '.join(WEIGHT_FILES)})")
    shards = sorted(name for name in os.listdir(source) if _SHARD.match(name))
    if shards:
        index = "model.safetensors.index.json" if shards[0].endswith(".safetensors") else \
            "pytorch_model.bin.index.json"
        return (f"{text}: it holds shards ({', '.join(shards[:3])}) but not {index}, the index "
                "that lists them: a checkpoint copied in part; copy the checkpoint again")
    return f"{text}: a config and tokenizer alone are no checkpoint; copy its weights too"


def torch_file_problem(path: str) -> Optional[str]:
    """Why ``path`` cannot be a file torch saved (torch's own errors name no file), or
    None: a file in torch's zip format (every save since torch 1.6) whose directory, at its
    end, is gone (a copy cut short); or one that is neither that nor the older format, a
    pickle (an empty file, a git-lfs pointer never pulled). Reads the file's first bytes and
    its end only."""
    import zipfile

    with open(path, "rb") as f:
        head = f.read(4)
    if head[:1] == b"\x80":  # torch's format before 1.6: a pickle, checked as it loads
        return None
    if head != b"PK\x03\x04":
        what = "empty" if not head else "a git-lfs pointer" if head == b"vers" else \
            "not torch's weights format"
        return f"the file is {what}"
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError):
        return "its zip directory, at the end of the file, is missing or broken"


# safetensors' names of the dtypes the Megatron conversion takes
CONVERTED_DTYPES = ("F32", "BF16", "F16")


def quantized_problem(source: str) -> Optional[str]:
    """Why the Megatron backend cannot read checkpoint directory ``source``: its config.json
    has a ``quantization_config`` (FP8, int8, GPTQ, ...), whose weights are stored with scales
    the conversion does not apply (it would cast FP8 values to bf16 without their
    ``weight_scale``: garbage), or None."""
    quant = (checkpoint_config(source) or {}).get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    return (f"{os.path.join(source, 'config.json')} has a quantization_config (quant_method "
            f"{method}): system.backend megatron converts unquantized weights only "
            f"({', '.join(CONVERTED_DTYPES)}) and does not dequantize; dequantize the "
            f"checkpoint to bf16 first")


def architecture_problem(source: str, trust_remote_code: bool) -> Optional[str]:
    """Why the checkpoint directory ``source`` cannot be built as a causal LM (the actor, the
    reference) or the body of one (the critic, the reward model): its config.json is not a
    JSON object, or its `model_type` is not one transformers knows (a typo, a newer release)
    or not a causal LM's (T5, BART, BERT-style encoders: AutoModelForCausalLM has no class for
    it). None for a config.json without a model_type
    (transformers then goes by the directory's name), and a checkpoint that ships its own
    code (`auto_map`) under ``trust_remote_code``."""
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    file = os.path.join(source, "config.json")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        return f"{file} cannot be read as JSON: {err}"
    if not isinstance(config, dict):
        return f"{file} holds no JSON object: not a Hugging Face model config"
    model_type = config.get("model_type")
    if model_type is None or (trust_remote_code and "auto_map" in config):
        return None
    supported = ("supported: a model type that transformers' AutoModelForCausalLM loads (e.g. "
                 "llama, qwen2, mistral, gemma, gpt2, opt)")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        own_code = ("; it ships code of its own (auto_map): set model.trust_remote_code: true to "
                    "run it" if "auto_map" in config else "")
        return (f"{source}: config.json has model_type {model_type!r}, which transformers "
                f"{__version__} does not know; {supported}{own_code}")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (f"{source}: config.json has model_type {model_type!r}, not a causal language "
                f"model (every model of a run decodes or scores left to right); {supported}")
    return None
