"""Model shapes for the planner: parameter counts, KV-cache bytes and FLOPs per token, from
a Hugging Face ``config.json``, a built-in/tiny name or a table of public shapes.

Nothing is built and nothing is downloaded: a shape is a handful of integers. The counts are
exact for the Llama family (Llama, Mistral, Qwen2: RMSNorm, rotary positions, gated MLP,
grouped-query attention) and GPT-2, and are checked against models built from config in
``tests/test_plan.py``.
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, replace
from typing import Optional

from ..config import Config, ConfigError

# Public shapes (the published config.json values): hidden, layers, MLP width, attention
# heads, KV heads, vocabulary, tied embeddings, bias on q/k/v. The qwen2.5-0.5b/1.5b/7b shapes
# the length oracle builds live in oppo_ds.models.SHAPES and are read from there.
KNOWN_SHAPES: dict[str, tuple] = {
    "llama2-7b": (4096, 32, 11008, 32, 32, 32000, False, False),
    "llama2-13b": (5120, 40, 13824, 40, 40, 32000, False, False),
    "llama2-70b": (8192, 80, 28672, 64, 8, 32000, False, False),
    "llama3-8b": (4096, 32, 14336, 32, 8, 128256, False, False),
    "llama3-70b": (8192, 80, 28672, 64, 8, 128256, False, False),
    "llama3.2-1b": (2048, 16, 8192, 32, 8, 128256, True, False),
    "llama3.2-3b": (3072, 28, 8192, 24, 8, 128256, True, False),
    "mistral-7b": (4096, 32, 14336, 32, 8, 32768, False, False),
    "qwen2.5-14b": (5120, 48, 13824, 40, 8, 152064, False, True),
    "qwen2.5-32b": (5120, 64, 27648, 40, 8, 152064, False, True),
    "qwen2.5-72b": (8192, 80, 29568, 64, 8, 152064, False, True),
}
# other spellings of the same shapes, as they appear in checkpoint directory names
_ALIASES = {
    "llama3.1-8b": "llama3-8b", "llama3.1-70b": "llama3-70b", "llama3.3-70b": "llama3-70b",
    "llama-3-8b": "llama3-8b", "llama-3-70b": "llama3-70b", "llama-3.1-8b": "llama3-8b",
    "llama-3.1-70b": "llama3-70b", "llama-3.3-70b": "llama3-70b", "llama-2-7b": "llama2-7b",
    "llama-2-13b": "llama2-13b", "llama-2-70b": "llama2-70b", "llama-3.2-1b": "llama3.2-1b",
    "llama-3.2-3b": "llama3.2-3b",
}


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that memory and time depend on."""
    name: str
    family: str            # "llama" (Llama, Mistral, Qwen2) or "gpt2"
    hidden: int
    layers: int
    intermediate: int      # MLP width
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool             # input embedding shared with the LM head
    qkv_bias: bool = False
    o_bias: bool = False   # bias on the attention output projection
    mlp_bias: bool = False
    positions: int = 0     # learned position embeddings (GPT-2), 0 = rotary

    # ---------------------------------------------------------------- parameters

    @functools.lru_cache(maxsize=None)
    def linears(self) -> tuple[tuple[int, int, bool], ...]:
        """(in, out, bias) of every linear layer of one decoder layer."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.family == "gpt2":  # fused c_attn, Conv1D layers with biases
            return ((h, 3 * h, True), (h, h, True), (h, self.intermediate, True),
                    (self.intermediate, h, True))
        return ((h, q, self.qkv_bias), (h, kv, self.qkv_bias), (h, kv, self.qkv_bias),
                (q, h, self.o_bias), (h, self.intermediate, self.mlp_bias),
                (h, self.intermediate, self.mlp_bias), (self.intermediate, h, self.mlp_bias))

    @functools.lru_cache(maxsize=None)
    def layer_params(self) -> int:
        norms = 4 * self.hidden if self.family == "gpt2" else 2 * self.hidden  # LayerNorm: w + b
        return sum(i * o + (o if b else 0) for i, o, b in self.linears()) + norms

    @functools.lru_cache(maxsize=None)
    def body_params(self) -> int:
        """Embeddings, decoder layers and the final norm (the HF base model, no head)."""
        final_norm = 2 * self.hidden if self.family == "gpt2" else self.hidden
        return (self.vocab * self.hidden + self.positions * self.hidden
                + self.layers * self.layer_params() + final_norm)

    @functools.lru_cache(maxsize=None)
    def params(self, value_head: bool = False) -> int:
        """Parameters of the causal LM, or of the value model (body + a scalar head)."""
        if value_head:
            return self.body_params() + self.hidden
        return self.body_params() + (0 if self.tied else self.vocab * self.hidden)

    @functools.lru_cache(maxsize=None)
    def largest_module_params(self) -> int:
        """Parameters of the largest single module (its own, not its children's): what ZeRO-3
        gathers at once at the least (DeepSpeed's ``largest_layer_params``)."""
        biggest = max(i * o + (o if b else 0) for i, o, b in self.linears())
        return max(biggest, self.vocab * self.hidden)

    def lora_params(self, rank: int) -> int:
        """LoRA A and B matrices of rank ``rank`` on every linear of every decoder layer
        (``model.lora_module_name: layers.``)."""
        return self.layers * sum(rank * (i + o) for i, o, _ in self.linears()) if rank else 0

    def linear_weights(self) -> int:
        """The weight matrices of every decoder layer's linears (biases out): what a token
        multiplies in the layers, and what LoRA on them (``model.lora_module_name: layers.``)
        freezes."""
        return self.layers * sum(i * o for i, o, _ in self.linears())

    # ---------------------------------------------------------------- per-token costs

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values of one token in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    @functools.lru_cache(maxsize=None)
    def matmul_params(self, value_head: bool = False) -> int:
        """Weights that one token multiplies (embedding lookups excluded; the LM head, or the
        scalar value head, included)."""
        return self.linear_weights() + (self.hidden if value_head else self.vocab * self.hidden)

    def flops_per_token(self, context: float, value_head: bool = False) -> float:
        """Forward FLOPs of one token attending to ``context`` earlier tokens: 2 per weight
        and, per layer, 4 x heads x head_dim x context for the scores and the weighted sum."""
        attention = 4 * self.layers * self.heads * self.head_dim * context
        return 2 * self.matmul_params(value_head) + attention

    def activation_bytes_per_token(self, dtype_bytes: int, checkpointing: bool) -> int:
        """Activations one training token keeps for the backward pass in one layer (flash/SDPA
        attention: no seq x seq scores kept). With checkpointing only the layer's input."""
        if checkpointing:
            return self.hidden * dtype_bytes
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        # norm inputs/outputs (4h), q/k/v (q + 2kv), attention output (q), o-proj output (h),
        # MLP inputs and intermediates (gate, up, act, act*up: 4i; GPT-2 has 2 of width i)
        mlp = 4 * i if self.family != "gpt2" else 2 * i
        return (4 * h + 2 * q + 2 * kv + h + mlp) * dtype_bytes

    def forward_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """The most a no-grad forward holds at once for one token inside a layer (nothing is
        kept for a backward): the residual stream and the normed input (2h) beside the MLP's
        intermediates (gate, up and the activation: 3 of width i; GPT-2 2), or the attention's
        q, k, v and output; the widths split over ``tp`` tensor ranks."""
        h, q = self.hidden, self.heads * self.head_dim
        kv, i = self.kv_heads * self.head_dim, self.intermediate
        mlp = (3 * i if self.family != "gpt2" else 2 * i) // tp
        return (2 * h + max(mlp, (2 * q + 2 * kv) // tp)) * dtype_bytes


def _shape_from_hf(name: str, cfg: dict) -> ModelShape:
    """A ModelShape from the fields of a config.json."""
    kind = cfg.get("model_type", "")
    if kind == "gpt2":
        h = cfg["n_embd"]
        return ModelShape(name, "gpt2", h, cfg["n_layer"], cfg.get("n_inner") or 4 * h,
                          cfg["n_head"], cfg["n_head"], h // cfg["n_head"], cfg["vocab_size"],
                          tied=cfg.get("tie_word_embeddings", True), positions=cfg["n_positions"])
    try:
        h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        return ModelShape(
            name, "llama", h, cfg["num_hidden_layers"], cfg["intermediate_size"], heads,
            cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads,
            cfg["vocab_size"], tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)))
    except KeyError as err:
        raise ValueError(f"{name}: config.json of model_type {kind!r} lacks {err.args[0]!r}; "
                         f"the planner reads Llama-family (llama, mistral, qwen2) and gpt2 configs") from None


def _normalize(text: str) -> str:
    return re.sub(r"[^a-z0-9.]", "", text.lower().replace("_", "-").replace("-", ""))


def known_shape_names() -> list[str]:
    from ..models import SHAPES
    return sorted(set(KNOWN_SHAPES) | set(SHAPES))


def named_shape(name: str) -> Optional[ModelShape]:
    """A public shape by its exact name (``llama3-70b``, ``qwen2.5-7b``, an alias)."""
    from ..models import SHAPES

    key = _ALIASES.get(name, name)
    if key in KNOWN_SHAPES:
        h, layers, mlp, heads, kv, vocab, tied, bias = KNOWN_SHAPES[key]
        return ModelShape(key, "llama", h, layers, mlp, heads, kv, h // heads, vocab, tied, qkv_bias=bias)
    if key in SHAPES:  # the length oracle's shapes (Qwen2)
        h, layers, heads, kv, mlp, vocab, tied = SHAPES[key]
        return ModelShape(key, "llama", h, layers, mlp, heads, kv, h // heads, vocab, tied, qkv_bias=True)
    return None


def shape_in_path(path: str) -> Optional[ModelShape]:
    """The public shape whose name appears in a (placeholder) path's last component, e.g.
    ``/ckpt/llama3-70b-sft`` -> llama3-70b; the longest matching name wins."""
    base = _normalize(os.path.basename(path.rstrip("/")) or path)
    names = sorted(list(KNOWN_SHAPES) + list(_ALIASES) + known_shape_names(), key=len, reverse=True)
    for name in names:
        norm = _normalize(name)
        # the size must not run on into more digits: llama3-8b is not in llama3-80b
        if re.search(re.escape(norm) + r"(?![0-9])", base):
            return named_shape(name)
    return None


def tiny_shape(arch: str, vocab: int) -> ModelShape:
    """A tiny architecture of oppo_ds.models, from the same config builder the trainer uses."""
    from ..models import tiny_config

    return _shape_from_hf(arch, tiny_config(arch, vocab).to_dict())


def builtin_vocab(cfg: Config, arch: str) -> int:
    """Vocabulary of a `builtin` model: the built-in task's tokenizer, or the length oracle's."""
    from .. import workload
    from ..models import SHAPES

    if cfg.workload.kind == "length_oracle":
        return SHAPES[arch][5] if arch in SHAPES else workload.ORACLE_TINY_VOCAB
    return len(workload.VOCAB)


def resolve_shape(key: str, source: str, cfg: Config, overrides: dict[str, str]) -> ModelShape:
    """The shape of model ``key`` (actor, reference, reward, critic) whose source is ``source``:
    an override (``--shape actor=llama3-70b``), a local HF directory, ``builtin``, a tiny or
    oracle architecture, or a path naming a public shape."""
    if key in overrides:
        shape = named_shape(overrides[key])
        if shape is None:
            raise ConfigError(f"--shape {key}", f"unknown shape {overrides[key]!r}; known: "
                                                f"{', '.join(known_shape_names())}")
        return shape
    from ..models import FROM_CONFIG_ARCHS, SHAPES, TINY_ARCHS

    if source == "builtin":
        source = cfg.model.builtin_arch
    if source in TINY_ARCHS:
        return tiny_shape(source, builtin_vocab(cfg, source))
    if source in SHAPES or source in FROM_CONFIG_ARCHS:
        return named_shape(source)
    config_json = os.path.join(source, "config.json")
    if os.path.isfile(config_json):
        with open(config_json) as f:
            return _shape_from_hf(source, json.load(f))
    shape = shape_in_path(source)
    if shape is not None:
        return replace(shape, name=f"{shape.name} (from the name {source})")
    raise ConfigError(f"model.{key}", f"cannot find the shape of {source!r}: not a local directory "
                      f"with config.json, not builtin or {', '.join(TINY_ARCHS)}, and no known shape "
                      f"in its name (known: {', '.join(known_shape_names())}); pass "
                      f"--shape {key}=NAME")


@dataclass(frozen=True)
class Shapes:
    """The four models of a PPO step; the reference defaults to the actor, the critic to the
    reward model (as the trainer resolves them)."""
    actor: ModelShape
    reference: ModelShape
    reward: ModelShape
    critic: ModelShape


def resolve_shapes(cfg: Config, overrides: Optional[dict[str, str]] = None) -> Shapes:
    m, overrides = cfg.model, overrides or {}
    unknown = set(overrides) - {"actor", "reference", "reward", "critic"}
    if unknown:
        raise ConfigError("--shape", f"unknown model {sorted(unknown)[0]!r}; allowed: actor, "
                                     f"reference, reward, critic")
    actor = resolve_shape("actor", m.actor, cfg, overrides)
    reward = resolve_shape("reward", m.reward, cfg, overrides)
    reference = (resolve_shape("reference", m.reference, cfg, overrides)
                 if m.reference is not None or "reference" in overrides else actor)
    critic = (resolve_shape("critic", m.critic, cfg, overrides)
              if m.critic is not None or "critic" in overrides else reward)
    return Shapes(actor, reference, reward, critic)
