"""Model builders: the actor (causal LM), the frozen reference, and value-head models
(critic and reward: an LM body plus a scalar head on every token).

A model source is one of
  * a local Hugging Face checkpoint directory (``config.json`` + safetensors/bin weights);
  * ``tiny-llama`` / ``tiny-qwen2`` / ``tiny-gpt2``: a small architecture built from config
    with random weights (tests, length-oracle benchmarks);
  * ``qwen2.5-0.5b`` / ``qwen2.5-1.5b`` / ``qwen2.5-7b``: a real shape built from config with
    random weights (length-oracle benchmarks on GPUs).
Nothing is ever fetched from a hub: every load passes ``local_files_only=True``.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import pickle
import re
from typing import NamedTuple, Optional

import torch
from torch import nn

from .checkpoint_files import (CUT_SHORT, VALUE_HEAD_FILE, architecture_problem,
                               checkpoint_config, lfs_pointer, lfs_problem, unreadable,
                               weights_problem, weights_read)
from .kv_cache import cache_kwargs, output_cache

logger = logging.getLogger(__name__)

# files of which a saved Hugging Face tokenizer has at least one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# tokenizer_config.json classes that mean "tokenizer.json is the whole pipeline"
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Keys under which other projects store a scalar head: ours, HF *ForSequenceClassification
# (``score``), DeepSpeed-Chat's RewardModel (``v_head``), TRL's value head (``v_head.summary``).
HEAD_KEYS = ("value_head.weight", "score.weight", "v_head.weight", "v_head.summary.weight")
NO_HEAD = (f"no value head found (looked for {VALUE_HEAD_FILE} and keys {', '.join(HEAD_KEYS)}); "
           "a reward model needs a trained scalar head")


def tiny_config(arch: str, vocab_size: int, *, hidden_size: int = 64, num_layers: int = 2,
                num_heads: int = 4, max_positions: int = 512, bos_token_id: int = 1,
                eos_token_id: int = 2, pad_token_id: int = 0):
    """A small config of a real architecture. ``arch`` in TINY_ARCHS."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    special = dict(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if arch == "tiny-gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers,
                          n_head=num_heads, n_positions=max_positions, **special)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  intermediate_size=hidden_size * 2, num_attention_heads=num_heads,
                  # grouped-query attention, as in the real Llama-3 / Qwen2 families
                  num_key_value_heads=max(1, num_heads // 2),
                  max_position_embeddings=max_positions, tie_word_embeddings=False, **special)
    if arch == "tiny-llama":
        return LlamaConfig(**common)
    if arch == "tiny-qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"unknown tiny architecture {arch!r}; allowed: {', '.join(TINY_ARCHS)}")


TINY_ARCHS = ("tiny-llama", "tiny-qwen2", "tiny-gpt2")

# Real model shapes, built from config with random weights for length-oracle benchmarks
# (their published config.json values; nothing is downloaded): hidden, layers, heads, KV
# heads, MLP width, vocabulary, tied embeddings.
SHAPES = {
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False),
}
FROM_CONFIG_ARCHS = TINY_ARCHS + tuple(SHAPES)


def shape_config(arch: str, vocab_size: Optional[int] = None):
    """The config of a named real shape (``SHAPES``); ``vocab_size`` overrides its vocabulary."""
    from transformers import Qwen2Config

    if arch not in SHAPES:
        raise ValueError(f"unknown model shape {arch!r}; allowed: {', '.join(SHAPES)}")
    hidden, layers, heads, kv_heads, mlp, vocab, tied = SHAPES[arch]
    return Qwen2Config(vocab_size=vocab_size or vocab, hidden_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads,
                       intermediate_size=mlp, max_position_embeddings=32768, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)


def _torch_dtype(dtype: str | torch.dtype | None):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    table = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of {', '.join(table)}, got {dtype!r}")
    return table[dtype]


def source_problem(source: str, *, trust_remote_code: bool = False) -> Optional[str]:
    """Why ``source`` is not a model source (a local checkpoint directory whose config.json
    names a causal language model transformers has, or an architecture built from config), or
    None."""
    if source in FROM_CONFIG_ARCHS:
        return None
    return _path_problem(source) or architecture_problem(source, trust_remote_code) or \
        weights_problem(source)


def _path_problem(source: str) -> Optional[str]:
    if not os.path.isdir(source):
        return (f"model path {source!r} is not a local directory; oppo-ds never downloads "
                "weights: point the config at a local Hugging Face checkpoint or use one of "
                f"{', '.join(TINY_ARCHS)}")
    if not os.path.isfile(os.path.join(source, "config.json")):
        return f"{source!r} has no config.json: not a Hugging Face checkpoint directory"
    return None


def check_local_dir(path: str, trust_remote_code: bool = False) -> None:
    """``source_problem`` as an exception: FileNotFoundError for a path that is no
    checkpoint directory, ValueError for one whose config or weights cannot be loaded."""
    if path in FROM_CONFIG_ARCHS:
        return
    problem = _path_problem(path)
    if problem:
        raise FileNotFoundError(problem)
    problem = architecture_problem(path, trust_remote_code) or weights_problem(path)
    if problem:
        raise ValueError(problem)


def build_device(zero_stage: int = 0) -> Optional[torch.device]:
    """Where a run's models built from config are made: this process's GPU when it has one
    (on an H100 machine the random init of Qwen2.5-0.5B's reference and reward took 52 s on
    the host; made on the GPU, a whole run's start took 14 s), the CPU without one and under
    ZeRO-3
    (DeepSpeed partitions the models from there). Every builder of a run's models asks it, so
    that the models made from one seed (the actor and its reference; ours and a peer's in a
    benchmark) are equal: the same seed gives other numbers on another device."""
    if zero_stage == 3 or not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _build_tiny(from_config, arch: str, vocab_size: Optional[int], dtype, seed: Optional[int],
                device=None):
    """An architecture built from config with random weights (a tiny one, or a real shape);
    ``seed`` makes two builds identical (the actor and its reference start equal) on the same
    device. ``device``: where the weights are made and initialized (default: the CPU; see
    ``build_device``)."""
    if arch in SHAPES:
        config = shape_config(arch, vocab_size)
    elif vocab_size is None:
        raise ValueError(f"{arch} is built from config and needs vocab_size")
    else:
        config = tiny_config(arch, vocab_size)
    if seed is not None:
        torch.manual_seed(seed)
    dtype = _torch_dtype(dtype) or torch.float32
    # a 7B shape in fp32 is 30 GB: build directly in the target dtype
    with torch.device(device or "cpu"):
        return from_config(config, dtype=dtype).to(dtype)


def build_causal_lm(source: str, *, vocab_size: Optional[int] = None, dtype=None,
                    trust_remote_code: bool = False, seed: Optional[int] = None,
                    device=None) -> nn.Module:
    """The actor or the reference model. ``source``: a local HF directory or a tiny arch name
    (then ``vocab_size`` is required, ``seed`` fixes the random init and ``device`` is where
    it is built; a checkpoint loads on the CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if source in FROM_CONFIG_ARCHS:
        return _build_tiny(AutoModelForCausalLM.from_config, source, vocab_size, dtype, seed,
                           device)
    check_local_dir(source, trust_remote_code)
    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code,
                                        local_files_only=True)
    return _load_checked(AutoModelForCausalLM, source, config=config,
                         dtype=_torch_dtype(dtype) or torch.float32,
                         trust_remote_code=trust_remote_code)


class _HeldReport(logging.Filter):
    """Holds back what transformers logs below ERROR while a checkpoint loads (its load
    report: a table per load) and keeps the text, from which ``mismatches`` reads the rows
    of weights whose shape differs from the model's."""

    _ANSI = re.compile(r"\x1b\[[0-9;]*m")
    _SHAPES = re.compile(r"ckpt: torch\.Size\((\[.*?\])\) vs model: ?torch\.Size\((\[.*?\])\)")

    def __init__(self):
        super().__init__()
        self.texts: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        self.texts.append(self._ANSI.sub("", record.getMessage()))
        return False

    def mismatches(self) -> list[str]:
        """The held report's MISMATCH rows, each ``key: [shape] in the checkpoint, [shape] in
        the model``. A row can stand for many weights: transformers folds layers into one key
        (``layers.{0, 1}.mlp.up_proj.weight``, ``layers.{0...31}...`` past ten of them)."""
        rows = []
        for line in "\n".join(self.texts).splitlines():
            cells = [cell.strip() for cell in line.split("|")]
            if len(cells) >= 3 and cells[1] == "MISMATCH":
                found = self._SHAPES.search(cells[2])
                rows.append(f"{cells[0]}: {found[1]} in the checkpoint, {found[2]} in the model"
                            if found else cells[0])
        return rows


def _load_checked(auto_cls, path: str, *, unused_ok: tuple[str, ...] = (), **kwargs) -> nn.Module:
    """``auto_cls.from_pretrained`` that fails when weights are missing from the checkpoint:
    transformers only logs them and leaves them randomly initialised, which for an actor or
    a reward model means training or scoring with noise (e.g. keys under another prefix).

    Checkpoint weights the model does not use are logged in one line, except those under a
    prefix of ``unused_ok`` (the LM head or the scalar head of a checkpoint loaded as a body
    only, whose head we read ourselves): transformers' own report of them is a table per load
    that calls every such key "not ok if you expect identical arch". Weights files cut short
    are refused before (``check_local_dir``), with their names."""
    hf_logger = logging.getLogger("transformers.modeling_utils")
    level, report = hf_logger.level, _HeldReport()
    hf_logger.setLevel(logging.WARNING)  # its report, held back (errors still pass)
    hf_logger.addFilter(report)
    try:
        model, info = auto_cls.from_pretrained(path, local_files_only=True,
                                               output_loading_info=True, **kwargs)
    except RuntimeError as err:  # "... look at the above report!", which was held back
        shapes = report.mismatches()
        if not shapes:
            raise
        more = f"; and {len(shapes) - 3} more" if len(shapes) > 3 else ""
        raise ValueError(f"{path}: weights of the checkpoint have other shapes than the "
                         f"architecture its config.json describes ({'; '.join(shapes[:3])}"
                         f"{more}): a config.json of another model size, or another model's "
                         f"weights") from err
    finally:
        hf_logger.removeFilter(report)
        hf_logger.setLevel(level)
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ValueError(f"{path}: {len(missing)} weights of {type(model).__name__} are not in the "
                         f"checkpoint (e.g. {', '.join(missing[:3])}); its keys do not match the "
                         f"architecture in config.json")
    unused = sorted(k for k in info.get("unexpected_keys") or () if not k.startswith(unused_ok))
    if unused:
        logger.warning("%s: %d weights in the checkpoint are not used by %s (e.g. %s)", path,
                       len(unused), type(model).__name__, ", ".join(unused[:3]))
    return model


class ValueOutput(NamedTuple):
    """A value model's output. A named tuple, so that DeepSpeed's ZeRO-3 module hooks find the
    tensor in it (a dataclass made every ZeRO-3 run warn "A module has unknown inputs or
    outputs type ... the ZeRO-3 hooks ... may not get triggered properly")."""
    values: torch.Tensor           # (B, T) one scalar per token
    past_key_values: object = None  # the body's KV cache when use_cache=True


def head_width(config) -> int:
    """The width of a body's last hidden state, which a scalar head reads: the hidden size,
    except for OPT models that project it (OPT-350m, DeepSpeed-Chat's default critic: hidden
    1024, output ``word_embed_proj_dim`` 512; HF's OPT classifier reads the same width)."""
    return getattr(config, "word_embed_proj_dim", None) or config.hidden_size


class ValueHeadModel(nn.Module):
    """An LM body (the HF base model, no LM head) with a linear scalar head on every token.
    The critic reads per-token values; the reward model reads the value at the last token."""

    def __init__(self, body: nn.Module, value_head: Optional[nn.Linear] = None):
        super().__init__()
        self.body = body
        self.config = body.config
        hidden = head_width(body.config)
        self.value_head = value_head if value_head is not None else nn.Linear(hidden, 1, bias=False)
        if value_head is None:
            # A zero head makes a fresh critic predict 0 everywhere instead of noise.
            nn.init.zeros_(self.value_head.weight)
        self.value_head.to(next(body.parameters()).dtype)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache: bool = False) -> ValueOutput:
        out = self.body(input_ids=input_ids, attention_mask=attention_mask,
                        position_ids=position_ids, use_cache=use_cache,
                        **cache_kwargs(self.body, past_key_values))
        values = self.value_head(out.last_hidden_state).squeeze(-1)
        return ValueOutput(values=values, past_key_values=output_cache(out) if use_cache else None)

    def save_pretrained(self, path: str, state_dict: Optional[dict] = None) -> None:
        """An HF ``*ForSequenceClassification`` checkpoint with one label, the head as its
        ``score.weight``: what TRL takes as a value or reward model, and what
        ``AutoModelForSequenceClassification`` loads and scores with (at the last token that
        is not the pad token). An architecture without such a class is saved as its base
        model plus ``value_head.safetensors``. ``state_dict`` (this module's keys, e.g. with
        LoRA merged) replaces the module's own weights."""
        from safetensors.torch import save_file
        from transformers import AutoModelForSequenceClassification

        os.makedirs(path, exist_ok=True)
        own = self.state_dict() if state_dict is None else state_dict
        body = {k[len("body."):]: v for k, v in own.items() if k.startswith("body.")}
        head = own["value_head.weight"].detach().contiguous()
        stale = os.path.join(path, VALUE_HEAD_FILE)  # an earlier export's head would be read first
        if os.path.isfile(stale):
            os.remove(stale)
        config = copy.deepcopy(self.body.config)
        config.num_labels = 1
        try:
            with torch.device("meta"):  # its config and save logic; the weights are ours
                classifier = AutoModelForSequenceClassification.from_config(config)
        except ValueError:  # no sequence classifier for this architecture
            self.body.save_pretrained(path, state_dict=body, safe_serialization=True)
            save_file({"weight": head.cpu()}, stale)
            return
        prefix = classifier.base_model_prefix
        weights = {f"{prefix}.{k}": v for k, v in body.items()}
        weights["score.weight"] = head
        classifier.save_pretrained(path, state_dict=weights, safe_serialization=True)

    @classmethod
    def from_config(cls, config, dtype=None) -> "ValueHeadModel":
        from transformers import AutoModel

        kwargs = {"dtype": dtype} if dtype is not None else {}
        return cls(AutoModel.from_config(config, **kwargs))

    @classmethod
    def from_pretrained(cls, path: str, *, dtype=None, trust_remote_code: bool = False,
                        require_head: bool = False) -> "ValueHeadModel":
        """Load from a directory saved by us, or from any HF checkpoint of the same family
        (a causal LM or a sequence classifier). ``require_head``: fail when the checkpoint
        carries no scalar head (a reward model without one would score noise)."""
        from transformers import AutoModel

        check_local_dir(path, trust_remote_code)
        # the body only: a causal LM's head and any scalar head are not its weights
        heads = ("lm_head.", *(k.rsplit(".", 1)[0] + "." for k in HEAD_KEYS))
        body = _load_checked(AutoModel, path, dtype=_torch_dtype(dtype) or torch.float32,
                             trust_remote_code=trust_remote_code, unused_ok=heads)
        weight = read_value_head(path, head_width(body.config), require_head=require_head)
        if weight is None:
            return cls(body)
        head = nn.Linear(head_width(body.config), 1, bias=False)
        with torch.no_grad():
            head.weight.copy_(weight)
        return cls(body, head)


def read_value_head(path: str, hidden_size: int, *, require_head: bool) -> Optional[torch.Tensor]:
    """The scalar head's (1, hidden) weight saved in checkpoint ``path``, or None (a fresh
    head starts at zero). ``ValueError`` when ``require_head`` and there is none (a reward
    model without one would score noise) or when its shape does not fit ``hidden_size``."""
    weight = _find_head_weight(path)
    if weight is None:
        if require_head:
            raise ValueError(f"{path}: {NO_HEAD}")
        logger.info("%s: no value head in checkpoint, starting from a zero head", path)
        return None
    if tuple(weight.shape) != (1, hidden_size):
        raise ValueError(f"{path}: value head has shape {tuple(weight.shape)}, expected "
                         f"(1, {hidden_size})")
    return weight


def has_value_head(path: str) -> bool:
    """Whether checkpoint ``path`` carries a scalar head (see :func:`read_value_head`)."""
    return _find_head_weight(path) is not None


def _find_head_weight(path: str) -> Optional[torch.Tensor]:
    """The scalar head's weight in checkpoint ``path``: its own file's, else the first of
    ``HEAD_KEYS`` in the weight files transformers reads for the body (``weights_read``:
    safetensors or pickled ``.bin``), then in the other safetensors files there by name (a
    head saved in a file of its own); None without one. So a shard an earlier save left
    beside a whole ``model.safetensors``, which sorts first, is read only when the body's
    files hold no head. Of a sharded checkpoint only the shard its index names for a head
    is opened."""
    own = os.path.join(path, VALUE_HEAD_FILE)
    files, weight_map, _ = weights_read(path)
    # an index says which shard holds a head, if any does (a .bin shard is unpickled to look)
    body = files if weight_map is None else \
        sorted({weight_map[key] for key in HEAD_KEYS if key in weight_map})
    others = sorted(name for name in os.listdir(path)
                    if name.endswith(".safetensors") and name not in files)
    candidates = [(VALUE_HEAD_FILE, ("weight",))] if os.path.isfile(own) else []
    candidates += [(name, HEAD_KEYS) for name in body + others if name != VALUE_HEAD_FILE]
    for name, keys in candidates:
        found = _read_first_key(os.path.join(path, name), keys)
        if found is not None:
            if weight_map is not None and name in body:  # its bias may sit in another shard
                key = next(k for k in HEAD_KEYS if weight_map.get(k) == name)
                shard = weight_map.get(_bias_key(key))
                if shard not in (None, name):
                    _check_no_bias(os.path.join(path, name), key, _read_first_key(
                        os.path.join(path, shard), (_bias_key(key),)))
            return found
    return None


def _read_first_key(file: str, keys: tuple[str, ...]) -> Optional[torch.Tensor]:
    """The tensor under the first of ``keys`` that weights ``file`` holds, or None; a
    ``ValueError`` naming the file when it cannot be read, or when the head found has a bias
    that is not zero (TRL's ``v_head.summary`` has one; the scalar head here has none, and
    dropping it would move every score by it). A safetensors file is read by its header; a
    pickled ``.bin`` (older TRL and transformers saves) is mapped, not read whole (a 10 GB
    shard for one row of a head), and unpickled with ``weights_only``, so a checkpoint cannot
    run code."""
    from safetensors import SafetensorError, safe_open

    if file.endswith(".safetensors"):
        try:
            with safe_open(file, "pt") as f:
                names = set(f.keys())
                found = next((key for key in keys if key in names), None)
                if found is None:
                    return None
                bias = _bias_key(found)
                _check_no_bias(file, found, f.get_tensor(bias) if bias in names else None)
                return f.get_tensor(found)
        except SafetensorError as err:
            raise ValueError(unreadable(file, err)) from err
    state = _load_pickled(file)
    found = next((key for key in keys if key in state), None)
    if found is None:
        nested = [k for k, v in state.items() if isinstance(v, dict)]
        if nested and len(nested) == len(state):
            raise ValueError(f"{file} holds its tensors under {', '.join(map(repr, nested))}, "
                             "not at the top: save the inner state dict, as transformers "
                             "reads it")
        return None
    _check_no_bias(file, found, state.get(_bias_key(found)))
    return state[found].clone()


def _bias_key(weight_key: str) -> str:
    return weight_key[: -len("weight")] + "bias"


def _check_no_bias(file: str, key: str, bias: Optional[torch.Tensor]) -> None:
    if bias is not None and bias.abs().max() > 0:
        raise ValueError(f"{file}: the scalar head {key} has a bias ({_bias_key(key)} = "
                         f"{bias.flatten()[:1].item():.6g}), and the head here has none: every "
                         "score would be moved by it. Delete the bias from the checkpoint to "
                         "take the scores without it")


# what pickle and torch's weights-only unpickler say of a pickle cut short
_CUT_TEXTS = ("Ran out of input", "EOF", "truncated", "Unsupported operand")


def _load_pickled(file: str) -> dict:
    """The state dict in pickled weights ``file``, mapped; ``ValueError`` naming the file."""
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:  # saved in torch's format before 1.6: no zip to map
            if "mmap" not in str(err):
                raise
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # torch wraps every weights-only failure so
        if any(text in str(err) for text in _CUT_TEXTS):
            raise ValueError(f"{file} cannot be read as a pickled state dict of tensors "
                             f"({type(err).__name__}): {CUT_SHORT}") from err
        raise ValueError(f"{file} holds objects other than tensors, which are not unpickled "
                         "here (a checkpoint could run code): save it as safetensors") from err
    except Exception as err:  # pickle's, zipfile's and torch's errors of a file cut short
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{file} cannot be read as a pickled state dict of tensors ({first}): "
                         f"{CUT_SHORT}") from err
    if not isinstance(state, dict):
        raise ValueError(f"{file} holds a {type(state).__name__}, not a state dict of tensors")
    return state


def build_value_model(source: str, *, vocab_size: Optional[int] = None, dtype=None,
                      trust_remote_code: bool = False, require_head: bool = False,
                      seed: Optional[int] = None, device=None) -> ValueHeadModel:
    """The critic or the reward model, from a local directory or a tiny arch name (built on
    ``device``, as ``build_causal_lm``)."""
    if source in FROM_CONFIG_ARCHS:
        return _build_tiny(ValueHeadModel.from_config, source, vocab_size, dtype, seed, device)
    return ValueHeadModel.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code,
                                          require_head=require_head)


class CheckpointFileError(ValueError):
    """A file of a checkpoint directory is not what it should be (cut short, a git-lfs
    pointer); the message names it."""


class TokenizerFileError(CheckpointFileError):
    """A file of a saved tokenizer is not what it should be (cut short, a git-lfs pointer)."""


# the files a tokenizer is read from; the .json ones must parse
_TOKENIZER_READS = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")


def _tokenizer_file_problem(path: str) -> Optional[str]:
    """Why a file of the tokenizer in directory ``path`` cannot be read (a git-lfs pointer, a
    JSON file that does not parse: a copy cut short), or None; looked at once a load failed."""
    for name in _TOKENIZER_READS:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if lfs_pointer(file):
            return (f"{file} is a git-lfs pointer (a small text file starting \"version "
                    "https://git-lfs\"), not the file itself: run `git lfs pull` in the "
                    "repository it came from, or copy the tokenizer again")
        if name.endswith(".json"):
            try:
                with open(file, encoding="utf-8") as f:
                    json.load(f)
            except (OSError, ValueError) as err:  # UnicodeDecodeError is a ValueError
                return (f"{file} cannot be read as JSON ({err}): a copy cut short; copy the "
                        "tokenizer again")
    return None


def load_tokenizer(path: str, *, trust_remote_code: bool = False):
    """A tokenizer from a local directory; pad token falls back to EOS (decoder-only models
    often ship without one), else to id 0, and padding is on the left, as decoding needs.

    A directory whose tokenizer_config.json names the generic class (`TokenizersBackend`,
    `PreTrainedTokenizerFast`: tokenizer.json is the whole pipeline, as our built-in
    workload saves it) is loaded with that class. AutoTokenizer would pick the model type's
    own class for some types (Qwen2 among them) whatever the file says, and rebuild a
    byte-level BPE over the vocabulary: "bold c ->" came back as "boldc", "->" lost."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer path {path!r} is not a local directory")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{path!r} holds no tokenizer (looked for {', '.join(TOKENIZER_FILES)})")
    try:
        declared = None
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_file):
            with open(config_file) as f:
                declared = json.load(f).get("tokenizer_class")
        if declared in GENERIC_TOKENIZER_CLASSES and \
                os.path.isfile(os.path.join(path, "tokenizer.json")):
            tok = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        else:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                local_files_only=True)
    except Exception as err:  # the loaders' own errors name no file ("Expecting value: ...")
        problem = _tokenizer_file_problem(path)
        if problem is None:
            raise
        raise TokenizerFileError(problem) from err
    if tok.pad_token_id is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    elif tok.pad_token_id is None:  # padding is masked everywhere: any token will do
        tok.pad_token = tok.convert_ids_to_tokens(0)
        logger.warning("%s: the tokenizer has neither a pad nor an EOS token; padding with id 0 "
                       "(%r), which is masked wherever it pads", path, tok.pad_token)
    tok.padding_side = "left"
    return tok


def checkpoint_eos_ids(path: str) -> list[int]:
    """The token ids at which Hugging Face's ``generate`` stops for the checkpoint at ``path``:
    ``eos_token_id`` of its ``generation_config.json`` (one id or a list), else of its
    ``config.json``; [] for a source that is not a directory or names none
    (``CheckpointFileError`` for a file there that does not parse). Chat models list
    their end-of-turn token there beside the tokenizer's EOS (Llama-3-Instruct: 128001 and
    128009 ``<|eot_id|>``; Qwen2.5-Instruct: ``<|im_end|>`` and ``<|endoftext|>``)."""
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file) as f:
                ids = json.load(f).get("eos_token_id")
        except (ValueError, AttributeError) as err:  # transformers skips it; the ids are ours
            raise CheckpointFileError(lfs_problem(file) if lfs_pointer(file) else (
                f"{file} cannot be read as a JSON object ({err}): a copy cut short; copy the "
                "checkpoint again")) from err
        if ids is None:
            continue
        ids = [ids] if isinstance(ids, int) else ids
        return [int(i) for i in ids if i is not None]
    return []


# model types whose positions are a learned table: a position past its end is an index error
# (a device-side assert on a GPU), not just an untrained rotary angle
LEARNED_POSITIONS = {"gpt2": "n_positions", "gpt_bigcode": "n_positions",
                     "opt": "max_position_embeddings", "gpt_neo": "max_position_embeddings"}


def position_limit(source: str, vocab_size: Optional[int] = None) -> Optional[tuple[int, str, bool]]:
    """(positions, config key, hard) of a model source (a checkpoint directory or an
    architecture built from config): how many positions it was built for, and whether more
    is an error (a learned table, ``LEARNED_POSITIONS``) or only untrained (rotary); None when
    its config does not say."""
    if source in FROM_CONFIG_ARCHS:
        config = (shape_config(source) if source in SHAPES else
                  tiny_config(source, vocab_size or 1)).to_dict()
    else:
        config = checkpoint_config(source)
        if config is None:
            return None
    config = config.get("text_config") or config
    learned = LEARNED_POSITIONS.get(config.get("model_type"))
    for key in ([learned] if learned else ["max_position_embeddings", "n_positions"]):
        if isinstance(config.get(key), int):
            return config[key], key, learned is not None
    return None


def response_end_ids(setting, actor_source: str, tokenizer) -> tuple[int, ...]:
    """The ids a response ends at under ``generation.eos_token_ids`` = ``setting``: ``auto``
    gives those of the actor checkpoint (:func:`checkpoint_eos_ids`), then the tokenizer's
    EOS; a list gives itself (duplicates dropped)."""
    if setting != "auto":
        return tuple(dict.fromkeys(setting))
    found = checkpoint_eos_ids(actor_source) if os.path.isdir(actor_source) else []
    return tuple(dict.fromkeys(i for i in [*found, tokenizer.eos_token_id] if i is not None))


def _embedded_ids(config: dict) -> Optional[int]:
    """How many token ids a model's config says its embedding holds (None: not stated)."""
    for section in (config, config.get("text_config") or {}):
        size = section.get("vocab_size", section.get("padded_vocab_size"))
        if isinstance(size, int):
            return size
    return None


def tokenizer_mismatch(path: str, tokenizer, *, trust_remote_code: bool = False
                       ) -> tuple[Optional[str], Optional[str]]:
    """(error, warning) about the checkpoint at ``path`` reading the token ids of
    ``tokenizer`` (the actor's); (None, None) when it reads them as they are (or ``path`` is
    not a checkpoint directory).

    Every model of a run reads the actor's token ids as they are, with no re-tokenising
    (DeepSpeed-Chat and OpenRLHF share one tokenizer the same way). An error: an embedding
    smaller than the tokenizer (it would index past it: a device-side assert on a GPU, an
    IndexError mid-step on the CPU), or a saved tokenizer that gives a token another id (it
    scores other words). A warning: tokens only one of the two tokenizers has (e.g. a pad
    token added to one of them), harmless unless the actor samples them."""
    config = checkpoint_config(path)
    if config is None:
        return None, None
    size = _embedded_ids(config)
    n = len(tokenizer)
    if size is not None and size < n:
        return (f"its embedding holds {size} token ids, the actor's tokenizer has {n}: it was "
                "trained with another tokenizer"), None
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return None, None  # weights only: nothing to compare
    try:
        theirs = load_tokenizer(path, trust_remote_code=trust_remote_code).get_vocab()
    except Exception as e:  # noqa: BLE001 - a tokenizer we cannot load is reported, not fatal
        return None, (f"its tokenizer could not be loaded to compare with the actor's "
                      f"({type(e).__name__}: {e})")
    ours = tokenizer.get_vocab()
    moved = sorted(t for t in ours.keys() & theirs.keys() if ours[t] != theirs[t])
    if moved:
        return (f"its tokenizer is not the actor's: {len(moved)} token(s) have other ids, e.g. "
                f"{moved[0]!r} is {theirs[moved[0]]} there and {ours[moved[0]]} in the actor's"), None
    only = sorted(ours.keys() ^ theirs.keys())
    if only:
        side = "the actor's" if only[0] in ours else "its"
        return None, (f"{len(only)} token(s) are in only one of its tokenizer and the actor's, "
                      f"e.g. {only[0]!r} (in {side})")
    return None, None


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def model_card(model: nn.Module) -> str:
    cfg = model.config
    return json.dumps({"model_type": cfg.model_type, "hidden_size": cfg.hidden_size,
                       "layers": getattr(cfg, "num_hidden_layers", None),
                       "params": count_parameters(model)})


def disable_dropout(model: nn.Module) -> nn.Module:
    """PPO ratios compare two forwards of the same weights; dropout would make them differ
    for no reason, so RLHF trainers switch it off (in place; returns the model)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        # Llama-family attention keeps its dropout as a float, not as a Dropout module
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model
