"""Hugging Face <-> Megatron-core weights for Llama and Qwen2 (grouped-query attention).

Both families are the same decoder to Megatron's ``GPTModel`` with the local layer spec:
RMSNorm, rotary embeddings (non-interleaved, HF's ``rotate_half``), SwiGLU MLP, no linear
biases except Qwen2's query/key/value bias. The rotary frequencies are HF's own
(``rotary_inv_freq``): plain, or scaled as Llama 3.1/3.2/3.3 scale them (``rope_type``
``llama3``); other RoPE scalings are refused. What differs is the layout of three fused or
split matrices:

* **query/key/value.** HF keeps ``q_proj`` (n_heads*D, H), ``k_proj`` and ``v_proj``
  (n_groups*D, H). Megatron fuses them into one ``linear_qkv`` ordered by query group: for
  group g the rows are its n_heads/n_groups query heads, then its key head, then its value
  head. A tensor-parallel rank holds n_groups/tp consecutive groups (a contiguous row block
  of the fused matrix), so the fused matrix of a rank is built from the groups it owns.
  Qwen2's biases follow the same order.
* **MLP.** HF's ``gate_proj`` and ``up_proj`` (F, H) are one ``linear_fc1`` in Megatron; on a
  tensor-parallel rank it is ``[gate shard; up shard]`` (Megatron chunks the rank's own fc1
  output in two), so each is split first and then stacked per rank.
* **row-parallel matrices** (``o_proj`` -> ``linear_proj``, ``down_proj`` -> ``linear_fc2``)
  are split along their input dimension; column-parallel ones (embedding, ``lm_head`` ->
  ``output_layer``) along their output dimension, the vocabulary padded to a multiple of tp.

Tied embeddings (small Qwen2 models) become two copies in Megatron (``output_layer`` starts
equal to the embedding and trains on its own): a tied output layer would need an embedding
group across pipeline stages. Back in HF, an output layer that no longer equals the
embedding comes out as its own ``lm_head.weight`` (the model is then untied). Value models (critic, reward) are an HF base model plus
``value_head.weight`` (1, H): Megatron's ``GPTModel`` without ``output_layer`` and the same
head (``models.ValueHeadModel``).

Pipeline stages hold consecutive layers: stage p has layers ``[p*L/pp, (p+1)*L/pp)``,
numbered from 0 inside its ``GPTModel``.

Functions take a ``get(name) -> tensor`` for the HF side: an in-memory state dict's
``__getitem__``, or ``megatron.loading.SafetensorsReader``, which reads a checkpoint's tensors
one at a time. A getter that also has ``rows(name, start, stop)``, ``cols(name, start,
stop)`` and ``dims(name)`` is asked for only this rank's block of a split tensor (every split here is one
contiguous block of rows or columns per rank, the fused qkv included: a rank's query groups
are consecutive). Each converted tensor is copied out at once, so no whole HF tensor is held
longer than its own conversion.

**Layer specs that fuse the norms.** TransformerEngine's spec folds each layer's RMSNorm into
the linear after it (``TELayerNormColumnParallelLinear``): the input norm's weight becomes
``self_attention.linear_qkv.layer_norm_weight`` and the pre-MLP norm's
``mlp.linear_fc1.layer_norm_weight``; every other tensor keeps its name and layout.
``fuse_norm_names`` / ``unfuse_norm_names`` move between the two namings; the functions above
always speak the local spec's.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

ARCHS = ("llama", "qwen2")
ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1's RoPE scaling (HF ``rope_type: llama3``, the keys of ``rope_parameters``):
    wavelengths above ``original_max_position_embeddings / low_freq_factor`` are stretched by
    ``factor``, those below ``original_max_position_embeddings / high_freq_factor`` kept, the
    ones between interpolated."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class Shape:
    """What the conversion needs from an HF config."""
    arch: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    groups: int        # key/value heads
    head_dim: int
    ffn: int
    qkv_bias: bool
    eps: float
    rope_theta: float
    tied: bool
    max_positions: int
    rope_scaling: Optional[Llama3Rope] = None

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp

    def layer_range(self, pp: int, pp_rank: int) -> range:
        per = self.layers // pp
        return range(pp_rank * per, (pp_rank + 1) * per)


def shape_of(config) -> Shape:
    """The ``Shape`` of an HF Llama / Qwen2 config; ``ValueError`` for what Megatron's GPT
    with the local spec would compute differently."""
    arch = config.model_type
    if arch not in ARCHS:
        raise ValueError(f"Megatron conversion supports {', '.join(ARCHS)} models, got "
                         f"model_type {arch!r}")
    # transformers 5 holds the RoPE settings in rope_parameters; 4.x in rope_scaling (its
    # type under "rope_type", or "type" in older configs) beside rope_theta
    rope = getattr(config, "rope_parameters", None) or dict(
        getattr(config, "rope_scaling", None) or {})
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    scaling = _rope_scaling(rope)
    if arch == "llama" and (getattr(config, "attention_bias", False)
                            or getattr(config, "mlp_bias", False)):
        raise ValueError("Llama with attention_bias or mlp_bias is not converted yet")
    sliding = [i for i, kind in enumerate(getattr(config, "layer_types", None) or [])
               if kind != "full_attention"]
    if sliding:
        raise ValueError(f"layers {sliding} attend within a sliding window of "
                         f"{getattr(config, 'sliding_window', None)} tokens: Megatron's GPT "
                         f"attends to every earlier position (for a model trained without the "
                         f"window, set use_sliding_window: false in its config.json)")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r}: Megatron's SwiGLU uses silu")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return Shape(arch=arch, vocab_size=config.vocab_size, hidden=config.hidden_size,
                 layers=config.num_hidden_layers, heads=heads,
                 groups=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                 ffn=config.intermediate_size, qkv_bias=arch == "qwen2", eps=config.rms_norm_eps,
                 rope_theta=float(theta), tied=bool(getattr(config, "tie_word_embeddings", False)),
                 max_positions=config.max_position_embeddings, rope_scaling=scaling)


def _rope_scaling(rope: dict) -> Optional[Llama3Rope]:
    """The RoPE scaling of an HF ``rope_parameters`` dict: None (plain RoPE), a
    ``Llama3Rope``, or ``ValueError`` for what the conversion does not compute."""
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} (RoPE scaling) is not converted yet; only "
                         f"{' and '.join(map(repr, ROPE_TYPES))} rotary embeddings")
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0:  # the forward rotates every channel of a head
        raise ValueError(f"partial_rotary_factor {partial}: only rotary embeddings over the "
                         f"whole head (1.0) are converted")
    if rope_type == "default":
        return None
    missing = [key for key in _LLAMA3_KEYS if rope.get(key) is None]
    if missing:
        raise ValueError(f"rope_type 'llama3' without {', '.join(missing)} in rope_parameters "
                         f"(rope_scaling)")
    return Llama3Rope(*(rope[key] for key in _LLAMA3_KEYS))


def rotary_inv_freq(shape: Shape) -> torch.Tensor:
    """(head_dim/2,) fp32 rotary inverse frequencies: those transformers' own Llama rotary
    embedding computes for the shape's theta and scaling (plain, or ``rope_type`` llama3), so
    that they are the HF model's bit for bit. megatron-core's ``RotaryEmbedding`` has the
    Llama 3 scaling too (``rope_scaling=True``), but with only ``factor`` as a parameter: low
    and high frequency factors and the original context are fixed at Llama 3.1's 1, 4 and
    8192, so a checkpoint with other values would get other frequencies."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope_scaling is not None:
        rope.update(rope_type="llama3", **dataclasses.asdict(shape.rope_scaling))
    config = LlamaConfig(hidden_size=shape.heads * shape.head_dim, head_dim=shape.head_dim,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.groups,
                         max_position_embeddings=shape.max_positions, rope_parameters=rope)
    with torch.device("cpu"):
        return LlamaRotaryEmbedding(config).inv_freq.float().clone()


def check_parallel(shape: Shape, tp: int, pp: int) -> None:
    """``ValueError`` unless heads, groups, MLP width and layers divide evenly."""
    for what, n, by in (("num_attention_heads", shape.heads, tp),
                        ("num_key_value_heads", shape.groups, tp),
                        ("intermediate_size", shape.ffn, tp),
                        ("num_hidden_layers", shape.layers, pp)):
        if n % by:
            raise ValueError(f"{what}={n} is not divisible by "
                             f"{'tensor' if by == tp else 'pipeline'}_parallel={by}")


# ------------------------------------------------------------------------------ helpers

class CheckpointError(ValueError):
    """HF tensors that do not fit the model: a tensor missing, or of another size than
    config.json implies."""


def _read_block(get, name: str, dim: int, start: int, stop: int, total: int) -> torch.Tensor:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of HF tensor ``name``, which
    must have ``total`` of them: only those are read when ``get`` can (it then has ``rows`` /
    ``cols`` and ``dims``, the size from the file's header)."""
    read = getattr(get, ("rows", "cols")[dim], None)
    if read is None:
        whole = get(name)
        have, block = whole.shape[dim], whole.narrow(dim, start, stop - start)
    else:
        have, block = get.dims(name)[dim], read(name, start, stop)
    if have != total:
        raise CheckpointError(f"{name} has {have} {('rows', 'columns')[dim]}, config.json "
                              f"implies {total}")
    return block


def _read_rows(get, name: str, start: int, stop: int, total: int) -> torch.Tensor:
    return _read_block(get, name, 0, start, stop, total)


def _read_cols(get, name: str, start: int, stop: int, total: int) -> torch.Tensor:
    return _read_block(get, name, 1, start, stop, total)


def _row_block(get, name: str, rows: int, tp: int, tp_rank: int) -> torch.Tensor:
    """This rank's block of a tensor of ``rows`` rows split by rows into ``tp`` parts."""
    per = rows // tp
    return _read_rows(get, name, tp_rank * per, (tp_rank + 1) * per, rows)


def _col_block(get, name: str, cols: int, tp: int, tp_rank: int) -> torch.Tensor:
    per = cols // tp
    return _read_cols(get, name, tp_rank * per, (tp_rank + 1) * per, cols)


def _vocab_block(get, name: str, shape: Shape, tp: int, tp_rank: int) -> torch.Tensor:
    """This rank's rows of an (V, H) embedding or LM head padded to ``padded_vocab(tp)``
    rows: the real rows read, the padding zeros."""
    per = shape.padded_vocab(tp) // tp
    start, stop = tp_rank * per, (tp_rank + 1) * per
    real = _read_rows(get, name, min(start, shape.vocab_size), min(stop, shape.vocab_size),
                      shape.vocab_size)
    if real.shape[0] == per:
        return real
    return torch.cat([real, real.new_zeros(per - real.shape[0], *real.shape[1:])])


def _fuse_qkv(get, names: tuple[str, str, str], shape: Shape, tp: int,
              tp_rank: int) -> torch.Tensor:
    """HF q (n_heads*D, ...), k, v (n_groups*D, ...) -> this rank's rows of linear_qkv: its
    groups are consecutive, so it needs one row block of each of q, k and v."""
    per_group, d, local = shape.heads // shape.groups, shape.head_dim, shape.groups // tp
    q = _row_block(get, names[0], shape.heads * d, tp, tp_rank)
    k = _row_block(get, names[1], shape.groups * d, tp, tp_rank)
    v = _row_block(get, names[2], shape.groups * d, tp, tp_rank)
    q = q.reshape(local, per_group * d, *q.shape[1:])
    k = k.reshape(local, d, *k.shape[1:])
    v = v.reshape(local, d, *v.shape[1:])
    fused = torch.cat([q, k, v], dim=1)          # (local groups, (per_group + 2) * D, ...)
    return fused.reshape(-1, *q.shape[2:])


def _split_qkv(fused: list[torch.Tensor], shape: Shape):
    """Every tp rank's linear_qkv rows (in rank order) -> HF q, k, v."""
    per_group = shape.heads // shape.groups
    d = shape.head_dim
    whole = torch.cat(fused, dim=0)
    whole = whole.reshape(shape.groups, (per_group + 2) * d, *whole.shape[1:])
    q, k, v = whole.split([per_group * d, d, d], dim=1)
    return (q.reshape(-1, *whole.shape[2:]), k.reshape(-1, *whole.shape[2:]),
            v.reshape(-1, *whole.shape[2:]))


def hf_prefix(names) -> str:
    """'model.' for a causal LM's keys, '' for a base model's (a value model's body)."""
    return "model." if any(n.startswith("model.layers.") for n in names) else ""


# ------------------------------------------------------------------------------ HF -> Megatron

def hf_to_megatron(get: Callable[[str], torch.Tensor], shape: Shape, *, tp: int = 1,
                   tp_rank: int = 0, pp: int = 1, pp_rank: int = 0, prefix: str = "model.",
                   lm_head: bool = True, value_head: bool = False) -> dict[str, torch.Tensor]:
    """The state dict of one (tp_rank, pp_rank) Megatron ``GPTModel`` from HF tensors.

    Args:
        get: HF tensor by name (``state_dict().__getitem__``, or a
            ``loading.SafetensorsReader``, whose ``rows`` / ``cols`` are used for split tensors).
        prefix: of the decoder's HF names: ``"model."`` (causal LM) or ``""`` (base model).
        lm_head: the last stage gets ``output_layer`` (causal LM; ``lm_head.weight``, or the
            embedding when tied).
        value_head: the last stage gets ``value_head.weight`` (critic, reward).
    """
    check_parallel(shape, tp, pp)
    out: dict[str, torch.Tensor] = {}

    def put(key: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            # FP8 or int8 values mean something only with scales the conversion does not apply
            raise CheckpointError(f"{key} would be made of {tensor.dtype} weights: only fp32, "
                                  f"bf16 and fp16 weights are converted (a quantized "
                                  f"checkpoint must be dequantized to bf16 first)")
        # an owned contiguous copy now: a view would keep a whole HF tensor alive
        out[key] = tensor.detach().clone(memory_format=torch.contiguous_format)

    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        put("embedding.word_embeddings.weight",
            _vocab_block(get, f"{prefix}embed_tokens.weight", shape, tp, tp_rank))
    for local, layer in enumerate(shape.layer_range(pp, pp_rank)):
        src, dst = f"{prefix}layers.{layer}.", f"decoder.layers.{local}."
        att = src + "self_attn."
        put(dst + "input_layernorm.weight", get(src + "input_layernorm.weight"))
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            put(dst + f"self_attention.linear_qkv.{kind}", _fuse_qkv(
                get, tuple(f"{att}{m}_proj.{kind}" for m in "qkv"), shape, tp, tp_rank))
        put(dst + "self_attention.linear_proj.weight",
            _col_block(get, att + "o_proj.weight", shape.heads * shape.head_dim, tp, tp_rank))
        put(dst + "pre_mlp_layernorm.weight", get(src + "post_attention_layernorm.weight"))
        put(dst + "mlp.linear_fc1.weight", torch.cat(
            [_row_block(get, src + f"mlp.{m}_proj.weight", shape.ffn, tp, tp_rank)
             for m in ("gate", "up")]))
        put(dst + "mlp.linear_fc2.weight",
            _col_block(get, src + "mlp.down_proj.weight", shape.ffn, tp, tp_rank))
    if last:
        put("decoder.final_layernorm.weight", get(f"{prefix}norm.weight"))
        if lm_head:
            head = f"{prefix}embed_tokens.weight" if shape.tied else "lm_head.weight"
            put("output_layer.weight", _vocab_block(get, head, shape, tp, tp_rank))
        if value_head:
            put("value_head.weight", get("value_head.weight"))
    return out


# ------------------------------------------------------------------------------ Megatron -> HF

def megatron_to_hf(shards: list[list[dict]], shape: Shape, *, prefix: str = "model.",
                   lm_head: bool = True, value_head: bool = False) -> dict[str, torch.Tensor]:
    """HF tensors from every rank's Megatron state dict: ``shards[pp_rank][tp_rank]``."""
    pp, tp = len(shards), len(shards[0])
    check_parallel(shape, tp, pp)
    out: dict[str, torch.Tensor] = {}

    def cat(stage: int, name: str, dim: int) -> torch.Tensor:
        return torch.cat([shards[stage][r][name] for r in range(tp)], dim=dim)

    out[f"{prefix}embed_tokens.weight"] = \
        cat(0, "embedding.word_embeddings.weight", 0)[:shape.vocab_size]
    for stage in range(pp):
        for local, layer in enumerate(shape.layer_range(pp, stage)):
            src, dst = f"decoder.layers.{local}.", f"{prefix}layers.{layer}."
            att = dst + "self_attn."
            first = shards[stage][0]
            out[dst + "input_layernorm.weight"] = first[src + "input_layernorm.weight"]
            q, k, v = _split_qkv([shards[stage][r][src + "self_attention.linear_qkv.weight"]
                                  for r in range(tp)], shape)
            out.update({att + "q_proj.weight": q, att + "k_proj.weight": k,
                        att + "v_proj.weight": v})
            if shape.qkv_bias:
                q, k, v = _split_qkv([shards[stage][r][src + "self_attention.linear_qkv.bias"]
                                      for r in range(tp)], shape)
                out.update({att + "q_proj.bias": q, att + "k_proj.bias": k,
                            att + "v_proj.bias": v})
            out[att + "o_proj.weight"] = cat(stage, src + "self_attention.linear_proj.weight", 1)
            out[dst + "post_attention_layernorm.weight"] = first[src + "pre_mlp_layernorm.weight"]
            halves = [shards[stage][r][src + "mlp.linear_fc1.weight"].chunk(2) for r in range(tp)]
            out[dst + "mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves])
            out[dst + "mlp.up_proj.weight"] = torch.cat([h[1] for h in halves])
            out[dst + "mlp.down_proj.weight"] = cat(stage, src + "mlp.linear_fc2.weight", 1)
    last = shards[-1][0]
    out[f"{prefix}norm.weight"] = last["decoder.final_layernorm.weight"]
    if lm_head:
        head = cat(pp - 1, "output_layer.weight", 0)[:shape.vocab_size]
        # tied: Megatron's output layer is a copy trained on its own; kept once it differs
        if not shape.tied or not torch.equal(head, out[f"{prefix}embed_tokens.weight"]):
            out["lm_head.weight"] = head
    if value_head:
        out["value_head.weight"] = last["value_head.weight"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


# local spec name -> name under a spec that fuses the norm into the linear after it (TE)
_FUSED_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
_UNFUSED_NORMS = {fused: local for local, fused in _FUSED_NORMS.items()}
_LAYER_KEY = re.compile(r"^(decoder\.layers\.\d+\.)(.+)$")


def _rename_layer_keys(state: dict, names: dict) -> dict:
    out = {}
    for key, value in state.items():
        match = _LAYER_KEY.match(key)
        if match and match.group(2) in names:
            key = match.group(1) + names[match.group(2)]
        out[key] = value
    return out


def fuse_norm_names(state: dict) -> dict:
    """``state`` under the local spec's names -> the names of a spec whose column-parallel
    linears carry the norm before them (TransformerEngine); same tensors."""
    return _rename_layer_keys(state, _FUSED_NORMS)


def unfuse_norm_names(state: dict) -> dict:
    """The inverse of :func:`fuse_norm_names`."""
    return _rename_layer_keys(state, _UNFUSED_NORMS)


def fuses_norms(state_keys) -> bool:
    """Whether a GPTModel with these state-dict keys keeps its norms inside the linears."""
    return any(key.endswith(".linear_qkv.layer_norm_weight") for key in state_keys)
