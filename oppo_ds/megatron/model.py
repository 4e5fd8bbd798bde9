"""A Megatron-core ``GPTModel`` seen as a Hugging Face model.

The rollout (``rollout/generate.py``), the streaming scorers (``rollout/scorer.py``) and the
loss functions call a model as ``model(input_ids=, attention_mask=, position_ids=,
past_key_values=, use_cache=)`` and read ``.logits`` / ``.values`` / ``.past_key_values`` (an
HF ``DynamicCache``). ``MegatronModel`` gives a GPTModel exactly that interface, with one
forward for training, scoring and decoding, written over the GPTModel's own submodules and
parameters: the embedding (``VocabParallelEmbedding``), per layer the input RMSNorm,
``linear_qkv`` (column parallel), rotary embedding from the model's ``inv_freq`` (HF's,
``convert.rotary_inv_freq``), attention, ``linear_proj`` (row parallel), the pre-MLP RMSNorm
and Megatron's ``MLP``; then the final norm and ``output_layer`` or a scalar value head. Under
tensor parallelism the parallel linears communicate themselves; the vocabulary shards of the
logits are gathered.

Why not ``GPTModel.forward``: it has no KV cache that the decode loop and the scorers can
hold, select rows of and carry between steps, and its rotary embedding uses a position's index
in the batch, not the ``position_ids`` a left-padded prompt needs. Attention here takes the
2-D padding mask of the HF call (plus causality) and keys/values of a ``DynamicCache`` whose
layers hold this rank's key/value heads, ``(N, groups/tp, S, D)``; a position masked in its own
row still attends to itself, so no softmax row is empty. ``tests/test_megatron.py`` checks this
forward against ``GPTModel.forward`` and against the HF model the weights came from.

Pipeline parallelism: a stage holds some layers; the first embeds, every stage runs its layers
and sends the hidden states on (``parallel.send_to_next_stage``), the last computes logits or
values and every stage receives them (``parallel.from_last_stage``). So all ranks of a model
replica get the same output from every call and run the same decode loop, sampling the same
tokens from the same generator; each stage's cache holds its own layers.

Layer specs: megatron-core's local spec, or TransformerEngine's (``system.megatron_layers``).
The forward calls a layer's submodules, so both work unchanged: under TE's spec the norms are
``IdentityOp`` and ``linear_qkv`` / ``linear_fc1`` are TE's fused layernorm-linear modules
(their norm weights are renamed on load, ``convert.fuse_norm_names``). TE's attention module
is built but not called: attention here runs on the cache (``scaled_dot_product_attention``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..models import ValueOutput
from . import parallel
from .convert import (Shape, fuse_norm_names, fuses_norms, hf_to_megatron,
                      rotary_inv_freq, unfuse_norm_names)
from .parallel import ParallelGroups


@dataclass
class LMOutput:
    logits: torch.Tensor            # (B, T, V)
    past_key_values: object = None  # DynamicCache when use_cache=True


def transformer_config(shape: Shape, groups: ParallelGroups, dtype: torch.dtype):
    """megatron-core's TransformerConfig for an HF Llama / Qwen2 shape."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.groups, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        normalization="RMSNorm", layernorm_epsilon=shape.eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        tensor_model_parallel_size=groups.tp, pipeline_model_parallel_size=groups.pp,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        pipeline_dtype=dtype, use_cpu_initialization=True, perform_initialization=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False)


LAYER_SPECS = ("local", "transformer_engine")


def transformer_engine_usable() -> tuple[bool, str]:
    """Whether megatron-core can build TransformerEngine layers here, and if not, why."""
    if not torch.cuda.is_available():
        return False, "TransformerEngine's layers run on CUDA devices only and none is visible"
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except ImportError as err:
        return False, f"megatron.core.extensions.transformer_engine does not import ({err})"
    if not HAVE_TE:
        return False, "the transformer_engine package is not installed"
    return True, ""


def resolve_layer_spec(setting: str) -> str:
    """``system.megatron_layers`` -> "local" or "transformer_engine" (``auto`` takes
    TransformerEngine where it is usable)."""
    if setting == "auto":
        return "transformer_engine" if transformer_engine_usable()[0] else "local"
    if setting not in LAYER_SPECS:
        raise ValueError(f"layer spec must be auto, local or transformer_engine, got {setting!r}")
    return setting


def layer_spec(spec="local"):
    """megatron-core's layer ``ModuleSpec`` by name; a ``ModuleSpec`` is returned as given."""
    from megatron.core.models.gpt import gpt_layer_specs

    if spec == "local":
        return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    if spec == "transformer_engine":
        usable, why = transformer_engine_usable()
        if not usable:
            raise ValueError(f"layer spec transformer_engine: {why}")
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    if isinstance(spec, str):
        raise ValueError(f"layer spec must be one of {LAYER_SPECS}, got {spec!r}")
    return spec


def build_gpt(shape: Shape, groups: ParallelGroups, dtype: torch.dtype, *, lm_head: bool,
              spec="local"):
    """This rank's GPTModel stage (weights uninitialised) with the layer spec ``spec``
    (see :func:`layer_spec`)."""
    from megatron.core.models.gpt import GPTModel

    gpt = GPTModel(transformer_config(shape, groups, dtype), layer_spec(spec),
                   vocab_size=shape.padded_vocab(groups.tp), max_sequence_length=shape.max_positions,
                   pre_process=groups.first_stage, post_process=groups.last_stage,
                   parallel_output=True, share_embeddings_and_output_weights=False,
                   position_embedding_type="rope", rotary_base=shape.rope_theta,
                   pg_collection=groups.pg_collection)
    # HF's frequencies, Llama 3's scaling included (megatron-core's own scaling fixes three of
    # its four parameters, see convert.rotary_inv_freq); a plain attribute, read by our forward
    # and by GPTModel.forward alike
    gpt.rotary_pos_emb.inv_freq = rotary_inv_freq(shape)
    if groups.last_stage and not lm_head:
        gpt.output_layer = None  # a value model: final norm, then the value head
    mark_tensor_parallel_weights(gpt)
    return gpt


# the layers that split their weight over the tensor-parallel ranks, and along which dim
_PARALLEL_WEIGHT_DIM = {"ColumnParallel": 0, "RowParallel": 1, "VocabParallel": 0}


def mark_tensor_parallel_weights(module: nn.Module) -> None:
    """Mark the weights that tensor parallelism splits (``tensor_model_parallel``), as
    megatron-core does when it initialises them: with ``perform_initialization=False`` (we
    load the weights ourselves) it leaves the weights of its parallel linear and embedding
    layers unmarked, and a gradient norm that counts unmarked parameters once, on tensor
    rank 0, would leave out every other rank's part of them. Megatron's and Transformer
    Engine's layers alike (by class name); weights already marked are left as they are."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for layer in module.modules():
        name = type(layer).__name__
        dim = next((d for kind, d in _PARALLEL_WEIGHT_DIM.items() if kind in name), None)
        weight = getattr(layer, "weight", None)
        if dim is not None and isinstance(weight, torch.Tensor) \
                and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


class MegatronModel(nn.Module):
    """One rank's part of a causal LM (``kind="lm"``) or value model (``kind="value"``).

    Attributes:
        gpt: the megatron-core ``GPTModel`` of this pipeline stage.
        value_head: ``nn.Linear(H, 1)`` on the last stage of a value model, else None.
        config: the HF config the weights came from.
        recompute: keep only each layer's input in a training forward and run the layer again
            in the backward (``system.gradient_checkpointing``; Megatron's full recompute,
            with torch.utils.checkpoint, whose RNG handling works on CPU and GPU alike). A
            forward without gradients, or one that fills a KV cache, is unaffected.
    """

    def __init__(self, gpt, shape: Shape, groups: ParallelGroups, kind: str, hf_config=None):
        super().__init__()
        if kind not in ("lm", "value"):
            raise ValueError(f"kind must be 'lm' or 'value', got {kind!r}")
        self.gpt, self.shape, self.groups, self.kind = gpt, shape, groups, kind
        self.config = hf_config
        self.value_head = nn.Linear(shape.hidden, 1, bias=False) \
            if kind == "value" and groups.last_stage else None
        attention = gpt.decoder.layers[0].self_attention
        self.local_heads = attention.num_attention_heads_per_partition
        self.local_groups = attention.num_query_groups_per_partition
        self.recompute = False
        self.head_dim = attention.hidden_size_per_attention_head
        # TransformerEngine's spec: each norm lives inside the linear after it
        self.fused_norms = fuses_norms(gpt.state_dict().keys())

    @property
    def cache_layers(self) -> int:
        """Decoder layers this rank holds, its pipeline stage's: the layers of its KV cache
        (the whole model has ``config.num_hidden_layers``)."""
        return len(self.gpt.decoder.layers)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.gpt.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.gpt.parameters()).device

    # -- weights --------------------------------------------------------------------------

    def load_hf_state(self, get, prefix: str) -> None:
        """Load this rank's shard of HF tensors (``get(name)``; ``prefix`` of the decoder's
        names, see ``convert.hf_to_megatron``)."""
        g = self.groups
        state = hf_to_megatron(get, self.shape, tp=g.tp, tp_rank=g.tp_rank, pp=g.pp,
                               pp_rank=g.pp_rank, prefix=prefix, lm_head=self.kind == "lm",
                               value_head=self.value_head is not None)
        head = state.pop("value_head.weight", None)
        if self.fused_norms:
            state = fuse_norm_names(state)
        # megatron's _extra_state entries (fp8 metadata) are not weights
        missing, unexpected = self.gpt.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"converted weights do not fit the GPTModel: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
        if head is not None:
            with torch.no_grad():
                self.value_head.weight.copy_(head)

    def megatron_state(self) -> dict[str, torch.Tensor]:
        """This rank's weights under ``convert``'s names (for ``megatron_to_hf``)."""
        return {k: v.detach().cpu() for k, v in megatron_names(self.state_dict()).items()}

    # every rank of a replica calls these; the gathering rank gets the result
    collective_save = True

    def hf_state(self) -> Optional[dict[str, torch.Tensor]]:
        """The whole model's weights under HF names (``convert.megatron_to_hf``), on the first
        rank of data-parallel replica 0's model-parallel group (global rank 0); None on every
        other rank. Collective over that group when tp x pp > 1: its ranks send their shards
        to the first (``parallel.gather_states``), which needs host memory for the whole
        model."""
        g = self.groups
        if g.dp_rank != 0:  # the replicas hold the same weights
            return None
        mine = self.megatron_state()
        if g.tp * g.pp == 1:
            shards = [[mine]]
        else:
            received = parallel.gather_states(mine, (g.pp_rank, g.tp_rank), g.mp_group)
            if received is None:
                return None
            shards = [[None] * g.tp for _ in range(g.pp)]
            for (pp_rank, tp_rank), state in received:
                shards[pp_rank][tp_rank] = state
        return state_to_hf(shards, self.shape, self.kind)

    def to_hf(self):
        """The HF model of these weights, on the CPU in the model's dtype, on the rank
        :meth:`hf_state` gathers on (None elsewhere; collective like it)."""
        state = self.hf_state()
        return None if state is None else hf_model(self.config, state, self.kind, self.shape.tied)

    def save_pretrained(self, path: str, **kwargs) -> None:
        """HF format (what the trainer's export writes), through :meth:`to_hf`: every rank of
        the model calls it, the gathering rank writes."""
        model = self.to_hf()
        if model is not None:
            model.save_pretrained(path, **kwargs)

    # -- forward --------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, past_key_values=None,
                use_cache: bool = False, logits_to_keep: int = 0):
        """HF-style forward. input_ids (N, S); attention_mask (N, past + S) over the cached
        and the new positions; position_ids (N, S). Returns ``LMOutput`` (logits (N, S, V),
        or the last ``logits_to_keep`` positions) or ``models.ValueOutput`` (values (N, S))."""
        n, s = input_ids.shape
        cache = past_key_values
        if use_cache and cache is None:
            from transformers import DynamicCache
            cache = DynamicCache()
        # packed sequences (system.packing_samples), told apart as transformers does: no mask,
        # no cache, and positions that start again at 0
        segments = packed_segments(position_ids) \
            if attention_mask is None and position_ids is not None and cache is None else None
        if attention_mask is not None:
            past = attention_mask.shape[1] - s
        else:
            past = cache.get_seq_length() if cache is not None and len(cache.layers) else 0
            attention_mask = torch.ones(n, past + s, dtype=torch.long, device=input_ids.device)
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=input_ids.device)[None].expand(n, s)
        g = self.groups
        if g.first_stage:
            hidden = self.gpt.embedding(input_ids=input_ids, position_ids=position_ids)  # (S, N, H)
        else:
            hidden = parallel.recv_from_prev_stage((s, n, self.shape.hidden), self.dtype,
                                                   input_ids.device, g)
        mask = _attention_mask(attention_mask, s) if segments is None else _packed_mask(segments)
        cos, sin = self._rotary(position_ids, hidden.dtype)
        recompute = self.recompute and torch.is_grad_enabled() and not use_cache
        for index, layer in enumerate(self.gpt.decoder.layers):
            if recompute:  # every tensor rank recomputes the same layers: collectives pair up
                hidden = checkpoint(self._layer, layer, hidden, cos, sin, mask, None, index,
                                    use_reentrant=False)
            else:
                hidden = self._layer(layer, hidden, cos, sin, mask, cache if use_cache else None,
                                     index)
        keep = s if not logits_to_keep else min(logits_to_keep, s)
        if g.last_stage:
            hidden = self.gpt.decoder.final_layernorm(hidden[-keep:] if self.kind == "lm" else hidden)
            out = self._head(hidden)
        else:
            out = parallel.send_to_next_stage(hidden, g)
        shape = (n, keep, self.shape.vocab_size) if self.kind == "lm" else (n, s)
        out = parallel.from_last_stage(out, shape, self.dtype, g)
        cache = cache if use_cache else None
        if self.kind == "lm":
            return LMOutput(logits=out, past_key_values=cache)
        return ValueOutput(values=out, past_key_values=cache)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, N, H) final hidden states -> (N, S, V) logits or (N, S) values."""
        if self.kind == "value":
            return self.value_head(hidden).squeeze(-1).transpose(0, 1)
        logits, _ = self.gpt.output_layer(hidden)                   # (S, N, V/tp)
        logits = parallel.gather_tensor_parallel(logits, self.groups)
        return logits[..., :self.shape.vocab_size].transpose(0, 1)  # drop the vocab padding

    def _rotary(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """cos, sin (N, 1, S, D) at the given positions; computed in fp32 as HF does."""
        rope = self.gpt.rotary_pos_emb
        if rope.inv_freq.device != position_ids.device:
            # a plain attribute, built on the CPU (use_cpu_initialization): moved once, as
            # megatron's own get_emb does, not copied to the GPU at every forward
            rope.inv_freq = rope.inv_freq.to(position_ids.device)
        inv_freq = rope.inv_freq.float()
        freqs = position_ids[..., None].float() * inv_freq             # (N, S, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _layer(self, layer, hidden, cos, sin, mask, cache, index: int) -> torch.Tensor:
        """One TransformerLayer on (S, N, H) hidden states, with its keys/values cached."""
        attention = layer.self_attention
        x = layer.input_layernorm(hidden)
        qkv, _ = attention.linear_qkv(x)                  # (S, N, groups*(per_group+2)*D)
        s, n = qkv.shape[:2]
        per_group, d = self.local_heads // self.local_groups, self.head_dim
        qkv = qkv.view(s, n, self.local_groups, (per_group + 2) * d)
        q, k, v = qkv.split([per_group * d, d, d], dim=-1)
        q = q.reshape(s, n, self.local_heads, d).permute(1, 2, 0, 3)  # (N, heads, S, D)
        k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)         # (N, groups, S, D)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k.contiguous(), v.contiguous(), index)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 enable_gqa=self.local_heads != self.local_groups)
        context = context.permute(2, 0, 1, 3).reshape(s, n, self.local_heads * d)
        out, bias = attention.linear_proj(context)
        hidden = hidden + (out if bias is None else out + bias)
        out, bias = layer.mlp(layer.pre_mlp_layernorm(hidden))
        return hidden + (out if bias is None else out + bias)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def packed_segments(position_ids: torch.Tensor) -> torch.Tensor:
    """(N, S) the number of the packed sequence each position belongs to: a new one starts
    wherever the position is not the one before plus 1."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).long().cumsum(-1)


def _packed_mask(segments: torch.Tensor) -> torch.Tensor:
    """(N, 1, S, S) boolean, True where a query may attend: a key at or before it in the same
    packed sequence."""
    s = segments.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    return (causal & (segments[:, :, None] == segments[:, None, :]))[:, None]


def _attention_mask(padding: torch.Tensor, s: int) -> torch.Tensor:
    """(N, 1, S, past + S) boolean, True where a query may attend: a real key at or before the
    query's own position, and the query itself (so a padded query's row is never empty)."""
    total = padding.shape[1]
    query = torch.arange(total - s, total, device=padding.device)[:, None]
    key = torch.arange(total, device=padding.device)[None, :]
    allowed = (key <= query) & padding.bool()[:, None, :]
    return (allowed | (key == query))[:, None]


def build_model(hf_model, groups: ParallelGroups, kind: str, *, dtype: torch.dtype,
                device: torch.device, spec="local") -> MegatronModel:
    """This rank's ``MegatronModel`` with the weights of ``hf_model`` (an HF Llama / Qwen2
    causal LM for ``kind="lm"``, a ``models.ValueHeadModel`` for ``kind="value"``)."""
    from .convert import hf_prefix

    state = hf_model.state_dict()
    if kind == "value":
        state = {k[len("body."):] if k.startswith("body.") else k: v for k, v in state.items()}
    return build_from_tensors(hf_model.config, state.__getitem__, hf_prefix(state), groups, kind,
                              dtype=dtype, device=device, spec=spec)


def build_from_tensors(hf_config, get, prefix: str, groups: ParallelGroups, kind: str, *,
                       dtype: torch.dtype, device: torch.device, spec="local") -> MegatronModel:
    """This rank's ``MegatronModel`` of the shape of ``hf_config``, its shard converted from
    ``get(name)`` (HF names under ``prefix``, see ``convert.hf_to_megatron``)."""
    from .convert import shape_of

    shape = shape_of(hf_config)
    model = MegatronModel(build_gpt(shape, groups, dtype, lm_head=kind == "lm", spec=spec),
                          shape, groups, kind, hf_config=hf_config)
    model.load_hf_state(get, prefix)
    return model.to(device=device, dtype=dtype)


def megatron_names(module_state: dict) -> dict:
    """A ``MegatronModel.state_dict()`` (as saved in the Megatron engine's checkpoint shards)
    under ``convert``'s names: without the ``gpt.`` prefix and TE's ``_extra_state`` entries,
    norms under the local spec's names, the value head as ``value_head.weight``."""
    state = {k.removeprefix("gpt."): v for k, v in module_state.items()
             if not k.endswith("_extra_state")}
    return unfuse_norm_names(state) if fuses_norms(state) else state


def state_to_hf(shards: list[list[dict]], shape: Shape, kind: str) -> dict[str, torch.Tensor]:
    """HF tensors (``models.ValueHeadModel`` names for ``kind="value"``) from every rank's
    ``MegatronModel.megatron_state()``, ``shards[pp_rank][tp_rank]``."""
    from .convert import megatron_to_hf

    state = megatron_to_hf(shards, shape, prefix="model." if kind == "lm" else "",
                           lm_head=kind == "lm", value_head=kind == "value")
    if kind == "value":
        state = {(k if k == "value_head.weight" else "body." + k): v for k, v in state.items()}
    return state


def hf_model(hf_config, state: dict, kind: str, tied: bool):
    """The HF causal LM (``kind="lm"``) or ``ValueHeadModel`` of ``hf_config`` holding
    ``state`` (from :func:`state_to_hf`; its tensors become the parameters, not copied), on
    the CPU in the state's dtype. A tied model whose output layer was trained apart from the
    embedding comes back untied (``tie_word_embeddings: false``, its own ``lm_head``).
    The model is built without its random initialisation (every parameter is replaced by
    ``state``): the stage placement calls this before every rollout for the critic, and
    initialising a 121M-parameter model alone took 1.8-2.5 s on the development VM."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from ..models import ValueHeadModel

    cls = AutoModelForCausalLM if kind == "lm" else ValueHeadModel
    tied = tied and kind == "lm"  # a value model has no output layer to tie (only a body)
    untie = tied and "lm_head.weight" in state  # trained apart (convert.megatron_to_hf)
    if untie:
        hf_config = copy.deepcopy(hf_config)
        hf_config.tie_word_embeddings = False
    with no_init_weights():
        model = cls.from_config(hf_config, dtype=next(iter(state.values())).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    allowed = {"lm_head.weight"} if tied and not untie else set()
    if set(missing) - allowed or unexpected:  # an uninitialised parameter would be garbage
        raise ValueError(f"the HF {kind} model of these weights: missing "
                         f"{sorted(set(missing) - allowed)[:4]}, unexpected {unexpected[:4]}")
    if tied and not untie:
        model.tie_weights()
    return model
