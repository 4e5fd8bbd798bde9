"""The Megatron-core backend on CPU over gloo (docs/megatron.md).

Tier 0: HF -> Megatron -> HF weights are exact for Llama and Qwen2 (grouped-query attention,
Qwen2's qkv bias) at every tensor / pipeline split.
Tier 1 (real processes on a free port): the Megatron model gives the HF model's logits and
values and gradients (fp32, atol 1e-5 / relative 1e-5) at tp=1, tp=2 and pp=2, with a KV
cache too, and equals megatron-core's own ``GPTModel.forward``; the reward model on its own
rank, fed chunks by point-to-point (the ``stage`` scorer), scores exactly as whole-sequence
scoring does.
Tier 2: real ``oppo_ds.train`` runs under the deepspeed launcher with 2 ranks, tp=2 and
pp=2, against a 1-rank run of the same seeds: the same responses and metrics.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
from _builders import signal_after_steps, spawn_gloo

import megatron.core  # noqa: E402,F401  the test extra installs it: missing is a failure, not a skip

from oppo_ds.megatron.convert import (fuse_norm_names, hf_to_megatron, megatron_to_hf,  # noqa: E402
                                      shape_of, unfuse_norm_names)
from oppo_ds.megatron.model import transformer_engine_usable  # noqa: E402
from oppo_ds.models import build_causal_lm, build_value_model, tiny_config  # noqa: E402
from oppo_ds.telemetry import read_history  # noqa: E402

VOCAB = 101  # not a multiple of tp: the vocabulary padding is exercised
ARCHS = ["tiny-llama", "tiny-qwen2"]
ATOL = 1e-5
JOIN_S = 120


# ------------------------------------------------------------------------------ tier 0

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_exact(arch, tp, pp):
    for kind in ("lm", "value"):
        if kind == "lm":
            state = build_causal_lm(arch, vocab_size=VOCAB, seed=0).state_dict()
            prefix = "model."
        else:
            model = build_value_model(arch, vocab_size=VOCAB, seed=0)
            torch.nn.init.normal_(model.value_head.weight)
            state = {k.removeprefix("body."): v for k, v in model.state_dict().items()}
            prefix = ""
        shape = shape_of(tiny_config(arch, VOCAB))
        heads = dict(lm_head=kind == "lm", value_head=kind == "value")
        shards = [[hf_to_megatron(state.__getitem__, shape, tp=tp, tp_rank=t, pp=pp, pp_rank=p,
                                  prefix=prefix, **heads) for t in range(tp)] for p in range(pp)]
        back = megatron_to_hf(shards, shape, prefix=prefix, **heads)
        assert set(back) == set(state)
        assert all(torch.equal(back[k], state[k]) for k in state), kind
        # each rank holds its share, not a copy
        qkv = shards[0][0]["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert qkv.shape[0] == (shape.heads + 2 * shape.groups) * shape.head_dim // tp


def test_qwen2_fused_qkv_layout_by_query_group():
    """Rows of linear_qkv: per query group, its query heads, its key head, its value head."""
    shape = shape_of(tiny_config("tiny-qwen2", VOCAB))
    state = build_causal_lm("tiny-qwen2", vocab_size=VOCAB, seed=0).state_dict()
    fused = hf_to_megatron(state.__getitem__, shape)["decoder.layers.0.self_attention.linear_qkv.bias"]
    d, per_group = shape.head_dim, shape.heads // shape.groups
    att = "model.layers.0.self_attn."
    group1 = fused[(per_group + 2) * d:]
    assert torch.equal(group1[:per_group * d], state[att + "q_proj.bias"][per_group * d:])
    assert torch.equal(group1[per_group * d:(per_group + 1) * d], state[att + "k_proj.bias"][d:])
    assert torch.equal(group1[(per_group + 1) * d:], state[att + "v_proj.bias"][d:])


def test_fused_norm_names_are_megatron_cores_own_mapping():
    """Under TransformerEngine's spec a layer's norms live in the linears after them.
    megatron-core states the correspondence itself, in the local spec's
    ``sharded_state_dict_keys_map`` (local prefix -> TE prefix, for its distributed
    checkpoints); our renaming must be the same, both ways, and touch nothing else."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    shape = shape_of(tiny_config("tiny-llama", VOCAB))
    state = hf_to_megatron(build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0).state_dict()
                           .__getitem__, shape)
    keys_map = get_gpt_layer_local_spec(normalization="RMSNorm").submodules \
        .sharded_state_dict_keys_map
    assert keys_map, "megatron-core's local spec no longer states its TE names"

    def megatron_says(key):
        layer, _, rest = key.partition(".layers.")
        index, _, name = rest.partition(".")
        for local, te in keys_map.items():
            if name.startswith(local):
                return f"{layer}.layers.{index}.{te}{name[len(local):]}"
        return key

    fused = fuse_norm_names(state)
    assert list(fused) == [megatron_says(k) if ".layers." in k else k for k in state]
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in fused
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in fused
    assert all(fused[megatron_says(k) if ".layers." in k else k] is v for k, v in state.items())
    assert unfuse_norm_names(fused).keys() == state.keys()


def test_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="llama, qwen2"):
        shape_of(tiny_config("tiny-gpt2", VOCAB))
    from transformers import Qwen2Config

    # Megatron's GPT attends to every earlier position: a window would give other logits
    # past it (0.12-0.69 off in the audit's run) instead of an error
    windowed = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
                           max_window_layers=0)
    with pytest.raises(ValueError, match=r"layers \[0, 1\] attend within a sliding window of 8"):
        shape_of(windowed)
    shape_of(Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
                         max_window_layers=2))  # every layer full: converted


# Llama 3.1's RoPE scaling (rope_type llama3) from an original context of 32 positions, so
# that each band of frequencies is exercised (tiny-llama's wavelengths are 6.3, 20.9, 70.6,
# ... positions: one kept, one interpolated, the rest stretched) and positions up to 70
# (_long_inputs) reach well past it
TINY_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def _llama3_config(vocab=VOCAB, rope=None):
    config = tiny_config("tiny-llama", vocab)
    config.rope_parameters = dict(rope or TINY_LLAMA3)
    return config


def _real_llama3(factor: float):
    """Llama 3.1/3.3 70B's shape and RoPE (factor 8; Llama 3.2's is 32) as their config.json
    on the Hub writes them (rope_theta and rope_scaling, the names older transformers use)."""
    from transformers import LlamaConfig

    return LlamaConfig.from_dict({
        "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
        "num_hidden_layers": 1, "intermediate_size": 256, "vocab_size": VOCAB,
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}})


def test_rotary_frequencies_are_hfs():
    """The converted model's inverse frequencies are the HF model's, bit for bit: plain RoPE,
    and Llama 3's scaling with its four parameters as the checkpoint gives them.
    megatron-core's own scaling (RotaryEmbedding(rope_scaling=True)) takes only the factor:
    it matches for Llama 3.1's other three, not for the tiny model's original context."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from oppo_ds.megatron.convert import rotary_inv_freq

    def megatron_cores(config, shape):
        return RotaryEmbedding(kv_channels=shape.head_dim, rotary_percent=1.0,
                               rotary_base=shape.rope_theta, rope_scaling=True,
                               rope_scaling_factor=shape.rope_scaling.factor,
                               use_cpu_initialization=True).inv_freq

    plain = tiny_config("tiny-llama", VOCAB)
    assert shape_of(plain).rope_scaling is None
    assert torch.equal(rotary_inv_freq(shape_of(plain)), LlamaRotaryEmbedding(plain).inv_freq)
    for config in (_llama3_config(), _real_llama3(8.0), _real_llama3(32.0)):
        shape = shape_of(config)
        hf = LlamaRotaryEmbedding(config).inv_freq
        ours = rotary_inv_freq(shape)
        assert ours.dtype == torch.float32 and torch.equal(ours, hf), config.rope_parameters
        unscaled = rotary_inv_freq(shape_of(tiny_config("tiny-llama", VOCAB))) \
            if config.head_dim == 16 else None
        if unscaled is not None:  # every band but the shortest wavelength moved
            assert (ours != unscaled).sum() == len(ours) - 1
        same_as_megatron = torch.allclose(megatron_cores(config, shape), hf, rtol=1e-6, atol=0)
        assert same_as_megatron == (shape.rope_scaling.original_max_position_embeddings == 8192)


@pytest.mark.parametrize("rope_type,extra", [
    ("linear", {"factor": 2.0}), ("dynamic", {"factor": 2.0}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 64}),
    ("longrope", {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                  "original_max_position_embeddings": 64})])
def test_rope_scalings_but_llama3_are_refused_by_name(rope_type, extra):
    config = _llama3_config(rope={"rope_type": rope_type, "rope_theta": 10000.0, **extra})
    with pytest.raises(ValueError, match=f"rope_type '{rope_type}' .*only 'default' and "
                                         f"'llama3'"):
        shape_of(config)


def test_incomplete_llama3_rope_is_refused():
    rope = {k: v for k, v in TINY_LLAMA3.items() if k != "high_freq_factor"}
    with pytest.raises(ValueError, match="rope_type 'llama3' without high_freq_factor"):
        shape_of(_llama3_config(rope=rope))
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        shape_of(_llama3_config(rope={**TINY_LLAMA3, "partial_rotary_factor": 0.5}))


def _clip_worker(rank, world, out, clip):
    from oppo_ds.engines.megatron_engine import MegatronTrainEngine
    from oppo_ds.megatron.model import build_model
    from oppo_ds.megatron.parallel import init_model_parallel

    groups = init_model_parallel(1, 1)
    hf = build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0)
    start = {k: v.clone() for k, v in hf.state_dict().items()}
    model = build_model(hf, groups, "lm", dtype=torch.float32, device=torch.device("cpu"))
    engine = MegatronTrainEngine(model, groups, lr=1e-2, total_steps=1, grad_clip=clip)
    engine.train_step([_token_batch()], _next_token_loss)
    moved = max(float((v - start[k]).abs().max()) for k, v in model.hf_state().items())
    out.put((clip, moved, engine.grad_norm()))


def _token_batch() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


def _next_token_loss(m, mb):
    """The language-modelling loss of a batch without padding."""
    mask = torch.ones_like(mb)
    logits = m(input_ids=mb, attention_mask=mask, position_ids=mask.cumsum(1) - 1).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(
        -1, mb[:, 1:, None]).mean().neg(), {}


@pytest.mark.parametrize("clip", [0.0, None])
def test_a_grad_clip_of_0_is_no_clipping_as_on_deepspeed(clip, torch_one_thread):
    """ppo.grad_clip 0 turned every gradient to 0 (scaled by 0 / norm): Adam then never moved a
    weight. It means no clipping, as DeepSpeed's gradient_clipping 0 does."""
    (_, moved, norm), = _spawn(_clip_worker, 1, clip)
    assert norm > 0 and moved == pytest.approx(1e-2, rel=0.01)  # Adam's first step: lr a weight


def _accumulation_worker(rank, world, out, micro_batches):
    from oppo_ds.engines.megatron_engine import MegatronTrainEngine
    from oppo_ds.megatron.model import build_model
    from oppo_ds.megatron.parallel import init_model_parallel

    groups = init_model_parallel(1, 1)
    hf = build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0)
    with torch.no_grad():  # weights bf16 can hold, so both models start from the same ones
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, VOCAB, (2, 16), generator=g) for _ in range(micro_batches)]
    exact = build_model(hf, groups, "lm", dtype=torch.float32, device=cpu)
    _next_token_loss(exact, torch.cat(batches))[0].backward()  # one batch of them all, fp32
    want = torch.cat([p.grad.reshape(-1) for p in exact.parameters() if p.requires_grad])
    model = build_model(hf, groups, "lm", dtype=torch.bfloat16, device=cpu)
    engine = MegatronTrainEngine(model, groups, lr=0.0, total_steps=1, grad_clip=None,
                                 gradient_accumulation_steps=micro_batches)
    got = []
    step = engine.optimizer.step  # the gradients the update takes, in its fp32 master copy
    engine.optimizer.step = lambda: got.append(torch.cat(
        [m.grad.reshape(-1) for m in engine._master])) or step()
    engine.train_step(batches, _next_token_loss)
    out.put(("error", float((got[0] - want).norm() / want.norm())))


@pytest.mark.parametrize("micro_batches", [1, 64])
def test_bf16_gradients_accumulate_in_fp32(micro_batches, torch_one_thread):
    """A bf16 model's update over many micro-batches takes the gradient of the one big batch
    they make (the fp32 model's here) as closely as one micro-batch does, the bf16 backward's
    own rounding (0.55% of the gradient's norm): each micro-batch's bf16 gradient is added
    into fp32 (as Megatron-core's DDP does into main_grad). Summed in bf16, each addition
    rounded to 8 bits: 64 micro-batches were 1.03% off (256: 1.74%)."""
    (_, err), = _spawn(_accumulation_worker, 1, micro_batches)
    assert err < 0.007, err


def _weights_only_worker(rank, world, out, root, dtype):
    from oppo_ds.engines.megatron_engine import MegatronTrainEngine
    from oppo_ds.megatron.model import build_model
    from oppo_ds.megatron.parallel import init_model_parallel

    groups = init_model_parallel(1, 1)

    def engine(seed, weights_only=False, vocab=VOCAB):
        hf = build_causal_lm("tiny-llama", vocab_size=vocab, seed=seed)
        model = build_model(hf, groups, "lm", dtype=dtype, device=torch.device("cpu"))
        return model, MegatronTrainEngine(model, groups, lr=1e-2, total_steps=10, grad_clip=1.0,
                                          warmup_steps=2, scheduler="cosine",
                                          weights_only=weights_only)
    model, trained = engine(0)
    for _ in range(2):
        trained.train_step([_token_batch()], _next_token_loss)
    trained.save(root, "step2")
    saved = {k: v.clone() for k, v in model.hf_state().items()}
    found = {}
    for weights_only in (True, False):
        other, loaded = engine(1)
        built_lr = loaded.lr()
        loaded.load(root, "step2", weights_only=weights_only)
        same = all(torch.equal(v, saved[k]) for k, v in other.hf_state().items())
        found[weights_only] = (same, len(loaded.optimizer.state), loaded.lr() == built_lr)
    # an engine of the weights alone (the evaluation's actor): no master copy, no optimizer
    other, alone = engine(1, weights_only=True)
    alone.load(root, "step2")
    refusals = []
    for call in (lambda: alone.train_step([_token_batch()], _next_token_loss), alone.lr,
                 lambda: alone.save(root, "step3")):
        try:
            call()
        except RuntimeError as err:
            refusals.append("weights_only=True" in str(err))
    found["alone"] = (all(torch.equal(v, saved[k]) for k, v in other.hf_state().items()),
                      hasattr(alone, "optimizer") or hasattr(alone, "_master"), refusals,
                      os.path.exists(os.path.join(root, "step3")))
    try:  # another model's checkpoint (another vocabulary): the run's checkpoint.resume error
        engine(1, weights_only=True, vocab=VOCAB + 8)[1].load(root, "step2")
    except Exception as err:
        found["other"] = type(err).__name__
    out.put(found)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weights_only_load_takes_the_module_alone(dtype, tmp_path, torch_one_thread):
    """``load(weights_only=True)`` (``oppo-train --evaluate``): the module's saved weights
    exactly (bf16: the module's own, not the fp32 master copy); the optimizer's moments and
    the schedule stay as built, where the full load restores them. An engine built
    ``weights_only`` (the evaluation's actor) holds neither master copy nor optimizer, loads
    the same weights, and refuses to train, save or give a learning rate; another model's
    checkpoint raises ``CheckpointMismatch``."""
    found, = _spawn(_weights_only_worker, 1, str(tmp_path), dtype)
    assert found[True] == (True, 0, True)
    assert found["alone"] == (True, False, [True] * 3, False)
    assert found["other"] == "CheckpointMismatch"
    same, moments, lr_as_built = found[False]
    assert same and moments > 0 and not lr_as_built


# ------------------------------------------------------------------------------ tier 1

def _spawn(target, world: int, *args) -> list:
    """``target(rank, world, out, *args)`` in ``world`` processes of a gloo group."""
    return spawn_gloo(target, world, *args, join_s=JOIN_S)


def _forward_backward(hf, meg, field, ids, mask, pos):
    """Both models' output ``field`` on the same left-padded batch, each followed by the
    backward of the same loss; returns the Megatron output and the largest difference over
    real tokens."""
    real = mask.bool()
    want = getattr(hf(input_ids=ids, attention_mask=mask, position_ids=pos), field)
    got = getattr(meg(input_ids=ids, attention_mask=mask, position_ids=pos), field)
    want[real].pow(2).mean().backward()
    got[real].pow(2).mean().backward()
    return got, float((got - want)[real].abs().max())


def _inputs():
    from _builders import left_padded_prompts

    from oppo_ds.rollout.generate import position_ids_from_mask
    ids, mask = left_padded_prompts([9, 6, 3, 8], VOCAB, 0, seed=3)
    return ids, mask, position_ids_from_mask(mask)


def _grad_error(hf_grads: dict, model, prefix: str) -> float:
    """Largest |Megatron grad - HF grad sharded like it| / max |HF grad| over the tensors."""
    g = model.groups
    want = hf_to_megatron(hf_grads.__getitem__, model.shape, tp=g.tp, tp_rank=g.tp_rank,
                          pp=g.pp, pp_rank=g.pp_rank, prefix=prefix, lm_head=model.kind == "lm",
                          value_head=model.value_head is not None)
    got = unfuse_norm_names({k.removeprefix("gpt."): p.grad for k, p in model.named_parameters()})
    assert set(got) == set(want)
    return max(float((got[k] - w).abs().max() / w.abs().max().clamp(min=1e-12))
               for k, w in want.items())


def _cached_logits(lm, ids, mask, pos):
    """Logits of the prompt fed in two pieces, then token by token, through the KV cache
    (to compare with one whole forward), and the cache."""
    step = lm(input_ids=ids[:, :4], attention_mask=mask[:, :4], position_ids=pos[:, :4],
              use_cache=True)
    parts, cache = [step.logits], step.past_key_values
    for t in range(4, ids.shape[1]):
        step = lm(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1],
                  position_ids=pos[:, t:t + 1], past_key_values=cache, use_cache=True)
        parts.append(step.logits)
    return torch.cat(parts, 1), cache


def _fused_norm_spec():
    """The local layer spec with TransformerEngine's layout: no separate norms; the RMSNorm
    applied inside ``linear_qkv`` and ``linear_fc1``, its weight named ``layer_norm_weight``.

    A CPU stand-in for ``TELayerNormColumnParallelLinear``, because TransformerEngine runs on
    CUDA only; it checks what our code does differently under TE's spec (the renamed norm
    weights, the forward through fused submodules). TE itself is tested on a GPU below."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    class FusedNormColumnLinear(ColumnParallelLinear):
        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size))
            self.eps = config.layernorm_epsilon

        def forward(self, x):
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return super().forward(self.layer_norm_weight * normed)

    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    spec.submodules.input_layernorm = IdentityOp
    spec.submodules.pre_mlp_layernorm = IdentityOp
    spec.submodules.self_attention.submodules.linear_qkv = FusedNormColumnLinear
    spec.submodules.mlp.submodules.linear_fc1 = FusedNormColumnLinear
    return spec


def _equality_worker(rank, world, out, tp, pp, layers="local"):
    from _builders import sharpen

    from oppo_ds.experience import packing_problem
    from oppo_ds.megatron.model import build_model
    from oppo_ds.megatron.parallel import gather_tensor_parallel, init_model_parallel

    groups = init_model_parallel(tp, pp)
    cpu = torch.device("cpu")
    spec = _fused_norm_spec() if layers == "fused" else layers
    ids, mask, pos = _inputs()
    real = mask.bool()
    report = {}
    for arch in ARCHS:
        hf = build_causal_lm(arch, vocab_size=VOCAB, seed=0)
        lm = build_model(hf, groups, "lm", dtype=torch.float32, device=cpu, spec=spec)
        report[arch, "fused_norms"] = lm.fused_norms
        if tp * pp == 1:  # the weights come back under HF's names, unchanged
            back = lm.to_hf().state_dict()
            report[arch, "round_trip"] = all(torch.equal(back[k], v)
                                             for k, v in hf.state_dict().items())
        got, report[arch, "logits"] = _forward_backward(hf, lm, "logits", ids, mask, pos)
        with torch.no_grad():  # the rows packed into one (system.packing_samples)
            packed = lm(input_ids=ids[real][None], position_ids=pos[real][None]).logits[0]
            report[arch, "packed"] = float((packed - got[real]).abs().max())
            report[arch, "packing_problem"] = packing_problem(
                lambda inputs: lm(**inputs).logits, VOCAB, cpu, half=False)
        report[arch, "lm_grads"] = _grad_error(
            {k: p.grad for k, p in hf.named_parameters()}, lm, "model.")
        with torch.no_grad():
            logits, cache = _cached_logits(lm, ids, mask, pos)
            report[arch, "cache"] = float((logits - got)[real].abs().max())
            report[arch, "cache_heads"] = tuple(cache.layers[0].keys.shape[:2])
            if pp == 1:  # megatron-core's own forward (no padding: it takes index positions)
                full = ids[:, :5].clone().clamp(min=3)
                causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)[None, None]
                own = lm.gpt(full, torch.arange(5)[None].expand(4, 5), causal.expand(4, 1, 5, 5))
                own = gather_tensor_parallel(own, groups)[..., :VOCAB]
                report[arch, "gpt_forward"] = float((lm(input_ids=full).logits - own).abs().max())
        value = sharpen(build_value_model(arch, vocab_size=VOCAB, seed=2), seed=12)
        value.train()
        critic = build_model(value, groups, "value", dtype=torch.float32, device=cpu, spec=spec)
        values, report[arch, "values"] = _forward_backward(value, critic, "values", ids, mask, pos)
        with torch.no_grad():
            packed = critic(input_ids=ids[real][None], position_ids=pos[real][None]).values[0]
            report[arch, "packed_values"] = float((packed - values[real]).abs().max())
        report[arch, "value_grads"] = _grad_error(
            {k.removeprefix("body."): p.grad for k, p in value.named_parameters()}, critic, "")
    out.put(("report", rank, report))


@pytest.mark.parametrize("tp,pp,layers", [(1, 1, "local"), (2, 1, "local"), (1, 2, "local"),
                                         (1, 1, "fused"), (2, 1, "fused")])
def test_megatron_model_equals_hf(tp, pp, layers, torch_one_thread):
    """``layers="fused"``: TransformerEngine's layout with a CPU stand-in for its fused
    layernorm-linear (``_fused_norm_spec``)."""
    reports = [m for m in _spawn(_equality_worker, tp * pp, tp, pp, layers) if m[0] == "report"]
    assert len(reports) == tp * pp
    for _, rank, report in reports:
        for arch in ARCHS:
            assert report[arch, "fused_norms"] == (layers == "fused")
            if tp * pp == 1:
                assert report[arch, "round_trip"], (arch, layers)
            for what in ("logits", "values", "cache", "packed", "packed_values"):
                assert report[arch, what] < ATOL, (rank, arch, what, report)
            assert report[arch, "packing_problem"] is None, (rank, arch)
            for what in ("lm_grads", "value_grads"):
                assert report[arch, what] < 1e-5, (rank, arch, what, report)
            # this rank caches its own key/value heads: 2 query groups split over tp
            assert report[arch, "cache_heads"] == (4, 2 // tp)
            if pp == 1:
                assert report[arch, "gpt_forward"] < ATOL, (rank, arch, report)


def _transformer_engine_worker(rank, world, out):
    from _builders import sharpen

    from oppo_ds.megatron.model import build_model
    from oppo_ds.megatron.parallel import init_model_parallel

    torch.backends.cuda.matmul.allow_tf32 = False
    groups = init_model_parallel(1, 1)
    gpu = torch.device("cuda", 0)
    ids, mask, pos = (t.to(gpu) for t in _inputs())
    real = mask.bool()
    report = {}
    for arch in ARCHS:
        hf = build_causal_lm(arch, vocab_size=VOCAB, seed=0).to(gpu)
        lm = build_model(hf, groups, "lm", dtype=torch.float32, device=gpu,
                         spec="transformer_engine")
        value = sharpen(build_value_model(arch, vocab_size=VOCAB, seed=2), seed=12).to(gpu)
        critic = build_model(value, groups, "value", dtype=torch.float32, device=gpu,
                             spec="transformer_engine")
        report[arch, "fused_norms"] = lm.fused_norms and critic.fused_norms
        report[arch, "logits"] = _forward_backward(hf, lm, "logits", ids, mask, pos)[1]
        report[arch, "values"] = _forward_backward(value, critic, "values", ids, mask, pos)[1]
        with torch.no_grad():
            whole = lm(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            report[arch, "cache"] = float((_cached_logits(lm, ids, mask, pos)[0] - whole)[real]
                                          .abs().max())
    out.put(("report", rank, report))


def _tied_export_worker(rank, world, out):
    from transformers import AutoModelForCausalLM

    from oppo_ds.megatron.model import build_model
    from oppo_ds.megatron.parallel import init_model_parallel

    groups = init_model_parallel(1, 1)
    config = tiny_config("tiny-qwen2", VOCAB)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lm = build_model(hf, groups, "lm", dtype=torch.float32, device=torch.device("cpu"))
    ids, mask, pos = _inputs()
    call = dict(input_ids=ids, attention_mask=mask, position_ids=pos)
    report = {"untrained_tied": lm.to_hf().config.tie_word_embeddings}
    with torch.no_grad():  # as training moves Megatron's separate output layer
        lm.gpt.output_layer.weight.add_(0.1 * torch.randn_like(lm.gpt.output_layer.weight))
        exported = lm.to_hf()
        report["trained_tied"] = exported.config.tie_word_embeddings
        report["logits"] = float((exported(**call).logits - lm(**call).logits)
                                 [mask.bool()].abs().max())
    out.put(("report", rank, report))


def _gather_worker(rank, world, out):
    import torch.distributed as dist

    from oppo_ds.megatron.parallel import gather_states

    g = torch.Generator().manual_seed(rank)
    # mixed dtypes and odd sizes: each tensor's bytes start unaligned for the next dtype
    mine = {"a": torch.randn(3, generator=g).to(torch.bfloat16),
            "b": torch.randn(2, 5, generator=g), "c": torch.arange(rank + 1),
            "empty": torch.zeros(0, 4), "h": torch.randn(7, generator=g).half()}
    if rank == 2:
        mine["only_here"] = torch.ones(2, dtype=torch.float64)
    group = dist.new_group([1, 2, 0])  # the group's first rank is its lowest global rank
    got = gather_states(mine, ("tag", rank), group)
    buf = io.BytesIO()  # tensors by value (a queue would pass shared memory of this process)
    torch.save((mine, got), buf)
    out.put((rank, buf.getvalue()))


def test_gather_states_moves_every_ranks_tensors_exactly(torch_one_thread):
    """``parallel.gather_states`` (what ``MegatronModel.hf_state`` gathers shards with): the
    lowest rank gets every rank's tag and tensors, bit for bit, in the group's order; the
    others get None."""
    results = {rank: torch.load(io.BytesIO(data)) for rank, data in _spawn(_gather_worker, 3)}
    assert results[1][1] is None and results[2][1] is None
    got = results[0][1]
    assert [tag for tag, _ in got] == [("tag", r) for r in (0, 1, 2)]
    for (_, state), rank in zip(got, (0, 1, 2)):
        want = results[rank][0]
        assert list(state) == list(want)
        for name, t in want.items():
            assert state[name].dtype == t.dtype and state[name].shape == t.shape
            assert torch.equal(state[name], t), (rank, name)


def test_tied_model_trained_apart_exports_untied(torch_one_thread):
    """Megatron keeps a tied model's output layer as its own copy and trains it; the HF export
    must keep what was trained (an untied lm_head), not fall back to the embedding."""
    report = [m for m in _spawn(_tied_export_worker, 1) if m[0] == "report"][0][2]
    assert report["untrained_tied"] is True
    assert report["trained_tied"] is False
    assert report["logits"] < ATOL, report


def _long_inputs():
    """Left-padded rows of up to 70 tokens: positions well past TINY_LLAMA3's original 32."""
    from _builders import left_padded_prompts

    from oppo_ds.rollout.generate import position_ids_from_mask
    ids, mask = left_padded_prompts([70, 41, 12, 66], VOCAB, 0, seed=3)
    return ids, mask, position_ids_from_mask(mask)


def _llama3_worker(rank, world, out, root):
    """A tiny Llama 3.1 read from its checkpoint as the run reads it, against the HF model:
    logits (whole and through the KV cache), megatron-core's own forward, and the two HF
    exports of its weights (the run's, gathered in memory, and a checkpoint's shards)."""
    from transformers import AutoModelForCausalLM

    from oppo_ds.engines.megatron_engine import MegatronTrainEngine
    from oppo_ds.megatron.loading import load_megatron_model
    from oppo_ds.megatron.parallel import gather_tensor_parallel, init_model_parallel

    groups = init_model_parallel(world, 1)
    cpu = torch.device("cpu")
    hf = AutoModelForCausalLM.from_pretrained(f"{root}/llama31", dtype=torch.float32).eval()
    lm = load_megatron_model(f"{root}/llama31", groups, "lm", dtype=torch.float32, device=cpu)
    ids, mask, pos = _long_inputs()
    real = mask.bool()
    call = dict(input_ids=ids, attention_mask=mask, position_ids=pos)
    report = {}
    with torch.no_grad():
        want, got = hf(**call).logits, lm(**call).logits
        report["logits"] = float((got - want)[real].abs().max())
        report["cache"] = float((_cached_logits(lm, ids, mask, pos)[0] - want)[real].abs().max())
        full = ids[:1, -64:]  # megatron-core's forward takes index positions: no padding
        causal = torch.triu(torch.ones(64, 64, dtype=torch.bool), 1)[None, None]
        own = gather_tensor_parallel(lm.gpt(full, torch.arange(64)[None], causal), groups)
        report["gpt_forward"] = float((lm(input_ids=full).logits - own[..., :VOCAB]).abs().max())
    engine = MegatronTrainEngine(lm, groups, lr=1e-3, total_steps=1)
    engine.save(f"{root}/checkpoints", "step1")  # shards and config.json, as a run saves them
    lm.save_pretrained(f"{root}/exported")  # the run's own export (checkpoint.export_hf)
    out.put(("report", rank, report))


@pytest.mark.parametrize("tp", [1, 2])
def test_llama31_rope_scaling_equals_hf_and_exports(tp, tmp_path, torch_one_thread):
    """Llama 3.1/3.2/3.3 scale their RoPE (rope_type llama3): the Megatron model gives the
    HF model's logits at positions past the original context, at tp=1 and tp=2, and both
    exports (the run's, and ``python -m oppo_ds.megatron.export`` of its shards) are the same
    model: rope_scaling in their config.json, the same logits. Without the scaling the logits
    would be far off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from oppo_ds.megatron.export import export

    config = _llama3_config()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path / "llama31")
    reports = [m for m in _spawn(_llama3_worker, tp, str(tmp_path)) if m[0] == "report"]
    assert len(reports) == tp
    for _, rank, report in reports:
        for what in ("logits", "cache", "gpt_forward"):
            assert report[what] < ATOL, (rank, what, report)
    assert export(str(tmp_path / "checkpoints" / "step1"), str(tmp_path / "offline")) == "lm"
    ids, mask, pos = _long_inputs()
    real = mask.bool()
    call = dict(input_ids=ids, attention_mask=mask, position_ids=pos)
    with torch.no_grad():
        want = hf(**call).logits
        for name in ("exported", "offline"):
            saved = AutoConfig.from_pretrained(tmp_path / name)
            assert saved.rope_parameters == TINY_LLAMA3, (name, saved.rope_parameters)
            model = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32)
            assert torch.equal(model.eval()(**call).logits[real], want[real]), name
        plain = AutoModelForCausalLM.from_config(tiny_config("tiny-llama", VOCAB),
                                                 dtype=torch.float32)
        plain.load_state_dict(hf.state_dict())
        unscaled = plain.eval()(**call).logits
    # 5e-3 apart (logits up to 0.65), where the conversion is within ATOL
    assert float((unscaled - want)[real].abs().max()) > 100 * ATOL


_TE_USABLE, _TE_WHY = transformer_engine_usable()


@pytest.mark.skipif(not _TE_USABLE, reason=f"needs TransformerEngine on a GPU: {_TE_WHY}")
def test_transformer_engine_layers_equal_hf_on_gpu(torch_one_thread):
    """The real TE spec (fused layernorm-linear modules, TE's kernels) in fp32 on one GPU.
    Tolerance 2e-3: TE normalises and multiplies with its own kernels, whose reduction order
    differs from PyTorch's; the CPU tests above hold the conversion itself to 1e-5."""
    reports = [m for m in _spawn(_transformer_engine_worker, 1) if m[0] == "report"]
    assert len(reports) == 1
    report = reports[0][2]
    for arch in ARCHS:
        assert report[arch, "fused_norms"], arch
        for what in ("logits", "values", "cache"):
            assert report[arch, what] < 2e-3, (arch, what, report)


def _stage_worker(rank, world, out):
    """Rank 0 decodes with a Megatron actor and streams chunks to rank 1, whose Megatron
    reward and reference models score them from their KV caches (the stage scorer)."""
    from _builders import left_padded_prompts, sharpen

    from oppo_ds.experience import response_logprobs, sequence_scores
    from oppo_ds.megatron.model import build_model
    from oppo_ds.megatron.parallel import init_model_parallel
    from oppo_ds.rollout.generate import SamplingParams
    from oppo_ds.rollout.stage import RemoteScorers, ScorerStage
    from oppo_ds.rollout.stage_stream import stage_stream_generate
    from oppo_ds.rollout.stage_layout import Link
    from oppo_ds.rollout.streaming import StreamingScorer

    groups = init_model_parallel(1, 1)  # two data-parallel ranks, each a whole model
    cpu = torch.device("cpu")
    reward = build_model(sharpen(build_value_model("tiny-llama", vocab_size=VOCAB, seed=2), 12),
                         groups, "value", dtype=torch.float32, device=cpu).eval()
    reference = build_model(sharpen(build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=1), 11),
                            groups, "lm", dtype=torch.float32, device=cpu).eval()
    if rank == 1:
        served = ScorerStage([StreamingScorer(reward, "reward"),
                              StreamingScorer(reference, "reference")], Link.in_world(0),
                             timeout=timedelta(seconds=60)).serve()
        out.put(("served", rank, served))
        return
    actor = build_model(sharpen(build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0), 10,
                                scale=0.5), groups, "lm", dtype=torch.float32, device=cpu).eval()
    params = SamplingParams(max_new_tokens=16, eos_token_ids=(2, 5, 7), pad_token_id=0)
    ids, mask = left_padded_prompts([3, 7, 5, 6, 2, 4], VOCAB, 0, seed=1)
    remote = RemoteScorers(Link.in_world(1), timeout=timedelta(seconds=60))
    try:
        for chunk in (1, 3):
            with torch.no_grad():
                gen, streamed, _ = stage_stream_generate(
                    actor, remote, ids, mask, params, torch.Generator().manual_seed(7), chunk)
                args = (gen.prompt_ids, gen.prompt_mask, gen.response_ids, gen.response_mask)
                whole = sequence_scores(reward, *args)
                ref = response_logprobs(reference, *args, 1.0)[0] * gen.response_mask
            out.put(("stage", chunk, {
                "reward": float((streamed["reward"] - whole).abs().max()),
                "reference": float((streamed["reference"] - ref).abs().max()),
                "spread": float(whole.std()), "lengths": sorted(set(gen.lengths.tolist()))}))
    finally:
        remote.close()


def test_reward_stage_scores_equal_whole_sequence_scoring(torch_one_thread):
    messages = _spawn(_stage_worker, 2)
    stages = {chunk: m for kind, chunk, m in messages if kind == "stage"}
    assert sorted(stages) == [1, 3]
    for chunk, m in stages.items():
        assert m["reward"] < 1e-5 and m["reference"] < 1e-5, (chunk, m)
        assert m["spread"] > 0.05 and len(m["lengths"]) >= 2, m  # real, varied scores
    assert [n for kind, _, n in messages if kind == "served"] == [2]


# ------------------------------------------------------------------------------ tier 2

SMALL = ["workload.num_prompts=64", "workload.sft_steps=20", "workload.reward_steps=20",
         "generation.max_new_tokens=24", "ppo.batch_size=4", "ppo.mini_batch_size=4",
         "ppo.micro_batch_size=2", "logging.progress=false", "logging.log_every=0",
         "logging.tensorboard=false", "system.torch_threads=1", "system.backend=megatron",
         "checkpoint.export_hf=false", "steps=2"]
SAME = ("reward/mean", "gold/mean", "kl/mean", "value/mean", "loss/policy", "loss/value",
        "policy/entropy", "response/len_mean", "grad_norm/actor", "grad_norm/critic")
# a critic-free run (group_norm) logs no value or critic figure
SAME_WITHOUT_CRITIC = tuple(k for k in SAME if "value" not in k and "critic" not in k)
# what a replica's ranks must agree on exactly under ppo.filter_groups
FILTER_SAME = ("filter/rounds", "filter/dropped_groups", "filter/fallback_groups",
               "filter/prompts_drawn", "response/lengths")


def _train(out_dir, cache_dir, ranks, *overrides):
    from oppo_ds.engines.deepspeed_engine import find_free_port

    launcher = shutil.which("deepspeed", path=os.path.dirname(sys.executable))
    assert launcher, "the deepspeed launcher is installed with deepspeed"
    cmd = [launcher, "--num_gpus", str(ranks), "--master_port", str(find_free_port()),
           "--module", "oppo_ds.train", *SMALL, f"workload.cache_dir={cache_dir}",
           f"logging.output_dir={out_dir}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out_dir, "launcher.log"), "w") as log:
        log.write(proc.stdout + proc.stderr)
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return rows, json.loads(open(os.path.join(out_dir, "summary.json")).read())


# a held-out evaluation of 5 prompts before the first step and after the last, greedy: a model
# replica split over ranks must answer as the whole model does
GREEDY_EVAL = ("eval.prompts=builtin", "eval.num_prompts=5", "eval.temperature=0")


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("megatron-1")
    return _train(str(out), cache_dir, 1, *GREEDY_EVAL) + (out,)


@pytest.mark.parametrize("parallel", ["system.tensor_parallel=2", "system.pipeline_parallel=2"])
def test_two_rank_model_parallel_run_equals_one_rank(parallel, one_rank_run, cache_dir, tmp_path):
    """tp=2 streams its reward and reference (KV caches merged and compacted under tensor
    parallel); pp=2 scores whole sequences. Both must repeat the one-rank run: one model
    replica (data parallel 1), the same prompts, tokens, scores and updates."""
    want, _, one_dir = one_rank_run
    stream = ["oppo.streaming=true", "oppo.chunk_size=3", "oppo.stream_to=[reference]"] \
        if "tensor" in parallel else []
    got, summary = _train(str(tmp_path / "run"), cache_dir, 2, parallel, *stream,
                          "checkpoint.export_hf=true", *GREEDY_EVAL)
    assert summary["world_size"] == 1 and summary["samples"] == 2 * 4  # one replica
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(want, got):
        assert a["response/lengths"] == b["response/lengths"]
        for key in SAME:
            assert b[key] == pytest.approx(a[key], abs=1e-4, rel=1e-4), (a["step"], key)
        assert b["train/ratio_mean"] == pytest.approx(1.0, abs=1e-2)
    want_answers, got_answers = (read_history(str(d / "eval_samples.jsonl"))
                                 for d in (one_dir, tmp_path / "run"))
    assert [(a["step"], a["prompt_id"]) for a in got_answers] == \
        [(s, f"builtin-eval-{i}") for s in (0, 2) for i in range(5)]
    for a, b in zip(want_answers, got_answers):
        assert a["response"] == b["response"], (a["step"], a["prompt_id"])
        assert b["reward"] == pytest.approx(a["reward"], abs=1e-4, rel=1e-4)
    # each (tensor, pipeline) rank saved its own shard of each trained model
    shards = sorted(os.listdir(tmp_path / "run" / "checkpoints" / "actor" / "step2"))
    assert shards == ["config.json"] + (["mp_rank_00_000.pt", "mp_rank_01_000.pt"]
                                        if "tensor" in parallel
                                        else ["mp_rank_00_000.pt", "mp_rank_00_001.pt"])
    assert sorted(os.listdir(one_dir / "checkpoints" / "actor" / "step2")) == \
        ["config.json", "mp_rank_00_000.pt"]
    _check_export(tmp_path / "run", tmp_path / "offline")
    if "tensor" in parallel:  # oppo-train --evaluate loads the shards: the run's last answers
        # from the actor's weights alone (the shard mapped, its optimizer state unread): the
        # critic is not read at all
        shutil.rmtree(tmp_path / "run" / "checkpoints" / "critic")
        _train(str(tmp_path / "run"), cache_dir, 2, "--evaluate", parallel, *stream,
               *GREEDY_EVAL)
        figures = json.loads((tmp_path / "run" / "evaluations" / "step_2.json").read_text())
        assert (figures["actor"], figures["settings"]["ranks"]) == ("checkpoint step2", 1)
        again = read_history(str(tmp_path / "run" / "evaluations" / "step_2_samples.jsonl"))
        last = [a for a in got_answers if a["step"] == 2]
        assert [a["response"] for a in again] == [a["response"] for a in last]
        assert [a["reward"] for a in again] == pytest.approx([a["reward"] for a in last],
                                                             abs=1e-5)


@pytest.mark.parametrize("parallel", ["system.tensor_parallel=2", "system.pipeline_parallel=2"])
def test_recomputation_gives_the_one_rank_run(parallel, one_rank_run, cache_dir, tmp_path):
    """system.gradient_checkpointing on the Megatron engine: every layer of the actor and critic
    runs again in the backward (its tensor-parallel collectives again, in the same order on
    both ranks); the run, losses and gradient norms are the one-rank run's without it (1e-4,
    as above). That it keeps fewer activations: the next test."""
    want, _, _ = one_rank_run
    got, _ = _train(str(tmp_path / "run"), cache_dir, 2, parallel, "system.gradient_checkpointing=true",
                    *GREEDY_EVAL)
    for a, b in zip(want, got):
        assert a["response/lengths"] == b["response/lengths"]
        for key in SAME:
            assert b[key] == pytest.approx(a[key], abs=1e-4, rel=1e-4), (a["step"], key)


def test_packed_sequences_give_the_one_rank_run(one_rank_run, cache_dir, tmp_path):
    """system.packing_samples on the Megatron engine under tensor parallel: the start's check
    passes on both ranks, and the run, losses and gradient norms are the one-rank padded run's
    (1e-4, as above)."""
    want, _, _ = one_rank_run
    got, _ = _train(str(tmp_path / "run"), cache_dir, 2, "system.tensor_parallel=2",
                    "system.packing_samples=true", *GREEDY_EVAL)
    for a, b in zip(want, got):
        assert a["response/lengths"] == b["response/lengths"]
        for key in SAME:
            assert b[key] == pytest.approx(a[key], abs=1e-4, rel=1e-4), (a["step"], key)


def _recompute_worker(rank, world, out):
    from oppo_ds.megatron.model import build_model
    from oppo_ds.megatron.parallel import init_model_parallel

    groups = init_model_parallel(1, 1)
    model = build_model(build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0), groups, "lm",
                        dtype=torch.float32, device="cpu", spec="local")
    ids, mask, pos = _inputs()

    def run(recompute):
        model.recompute = recompute
        model.zero_grad(set_to_none=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                      lambda t: t):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        logits[mask.bool()].logsumexp(-1).mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()], sum(saved)

    base_logits, base_grads, base_saved = run(False)
    logits, grads, saved = run(True)
    with torch.no_grad():
        model.recompute = True
        no_grad = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    out.put(("report", rank, {
        "saved": (saved, base_saved), "logits": bool(torch.equal(logits, base_logits)),
        "grads": max(float((a - b).abs().max()) for a, b in zip(base_grads, grads)),
        "no_grad": bool(torch.equal(no_grad, base_logits))}))


def test_recomputation_keeps_only_layer_inputs_for_the_backward(torch_one_thread):
    """One rank, tiny Llama in fp32: a training forward with recompute on saves fewer tensors
    for the backward, and gives the same logits and gradients exactly (the same ops run
    again); a forward without gradients is unaffected."""
    report = [m for m in _spawn(_recompute_worker, 1) if m[0] == "report"][0][2]
    saved, base_saved = report["saved"]
    assert saved < base_saved / 2, report
    assert report["logits"] and report["no_grad"] and report["grads"] == 0.0, report


def test_ptx_under_tensor_parallel_equals_one_rank(cache_dir, tmp_path):
    """PPO-ptx on the Megatron engine: the pretraining loss of a replica split over two tensor
    ranks is the one-rank replica's, and so are the updates it joins (1e-4: tensor-parallel
    sums in another order)."""
    text = tmp_path / "ptx.jsonl"
    text.write_text("".join(json.dumps({"text": " ".join("abcdefghijklmnopqrstuvwx"[i:] * 2)}) + "\n"
                            for i in range(12)))
    ptx = ("ppo.ptx_coef=0.5", "data.ptx_block_len=16", f"data.ptx={text}")
    one, _ = _train(str(tmp_path / "one"), cache_dir, 1, *ptx)
    two, _ = _train(str(tmp_path / "two"), cache_dir, 2, "system.tensor_parallel=2", *ptx)
    for a, b in zip(one, two):
        assert 0 < a["loss/ptx"] < 5
        for key in ("loss/ptx", *SAME):
            assert b[key] == pytest.approx(a[key], abs=1e-4, rel=1e-4), (a["step"], key)


def test_critic_free_under_tensor_parallel_equals_one_rank(cache_dir, tmp_path):
    """RLOO on the Megatron engine with the group pool and the GRPO paper's per-response loss
    averaging: no critic is built or saved, and a replica split over two tensor ranks (which
    must stop decoding on the same whole groups) repeats the one-rank run (1e-4, as above)."""
    rloo = ("ppo.advantage_estimator=rloo", "data.samples_per_prompt=2", "oppo.overcommit=2",
            "ppo.loss_agg_mode=seq_mean_token_mean", "steps=3", "checkpoint.every=3")
    one, _ = _train(str(tmp_path / "one"), cache_dir, 1, *rloo)
    two, _ = _train(str(tmp_path / "two"), cache_dir, 2, "system.tensor_parallel=2", *rloo)
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        assert a["response/lengths"] == b["response/lengths"]
        assert a["pool/deferrals"] == b["pool/deferrals"]
        for key in SAME_WITHOUT_CRITIC:
            assert b[key] == pytest.approx(a[key], abs=1e-4, rel=1e-4), (a["step"], key)
        assert "loss/value" not in b and "grad_norm/critic" not in b
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["actor", "latest", "trainer"]


@pytest.mark.parametrize("parallel, overcommit", [
    ("system.tensor_parallel=2", 0), ("system.tensor_parallel=2", 2), ("system.pipeline_parallel=2", 2)],
    ids=["tp-rounds", "tp-pool", "pp-pool"])
def test_dynamic_sampling_under_model_parallel_equals_one_rank(cache_dir, tmp_path, parallel, overcommit):
    """ppo.filter_groups on the Megatron engine with OpenRLHF's reward-range rule on the
    reward model's scores, without and with the rollout pool: the two ranks of one replica
    (tensor or pipeline parallel) drop the same prompts and run the same rounds (their
    collectives pair up), count the replica's prompts once, and repeat the one-rank run
    (1e-4, as above)."""
    dapo = ("ppo.advantage_estimator=group_norm", "data.samples_per_prompt=2", "steps=3",
            "ppo.filter_groups=true", "ppo.filter_groups_reward_range=[0.5,1e9]",
            f"oppo.overcommit={overcommit}")
    one, _ = _train(str(tmp_path / "one"), cache_dir, 1, *dapo)
    two, _ = _train(str(tmp_path / "two"), cache_dir, 2, parallel, *dapo)
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        for key in FILTER_SAME:
            assert a[key] == b[key], (a["step"], key)
        for key in SAME_WITHOUT_CRITIC:
            assert b[key] == pytest.approx(a[key], abs=1e-4, rel=1e-4), (a["step"], key)
    assert sum(r["filter/dropped_groups"] for r in two) > 0 and max(r["filter/rounds"] for r in two) > 1


# the gold rule on rank 0, its scores in reverse order elsewhere: a function whose ranks
# disagree (a shift or a scale would not do: group_norm's advantages ignore both)
RANKED_RULE = """
import os
from oppo_ds.workload import gold_reward


def ranked(prompts, completions, **fields):
    scores = gold_reward(prompts, completions, **fields)
    return scores if int(os.environ.get("RANK", "0")) == 0 else scores[::-1]
"""


@pytest.mark.parametrize("parallel", ["system.tensor_parallel=2", "system.pipeline_parallel=2"])
def test_a_reward_function_under_model_parallel_takes_the_replicas_first_rank(
        cache_dir, tmp_path, parallel):
    """model.reward_function on the Megatron engine: no reward model is built, and a
    replica's ranks train on its first rank's scores. The function here gives rank 1 the
    gold rule's scores in reverse order; the run repeats the one-rank run (rank 0's scores,
    1e-4 as above), whose reward is the gold rule's."""
    rule = tmp_path / "rule.py"
    rule.write_text(RANKED_RULE)
    grpo = ("ppo.advantage_estimator=group_norm", "data.samples_per_prompt=2", "steps=2",
            f"model.reward_function={rule}:ranked")
    one, _ = _train(str(tmp_path / "one"), cache_dir, 1, *grpo)
    two, _ = _train(str(tmp_path / "two"), cache_dir, 2, parallel, *grpo)
    assert "reward the function" in open(tmp_path / "two" / "launcher.log").read()
    for a, b in zip(one, two):
        assert a["response/lengths"] == b["response/lengths"]
        assert b["reward/mean"] == pytest.approx(b["gold/mean"], abs=1e-6)
        for key in SAME_WITHOUT_CRITIC:
            assert b[key] == pytest.approx(a[key], abs=1e-4, rel=1e-4), (a["step"], key)


def test_the_kl_off_builds_no_reference_on_the_megatron_engine(cache_dir, tmp_path):
    """ppo.kl_coef=0 under backend megatron: the run names no reference, logs no KL, trains."""
    rows, summary = _train(str(tmp_path / "run"), cache_dir, 1, "ppo.kl_coef=0", "steps=2")
    assert summary["steps"] == 2 and [r["step"] for r in rows] == [1, 2]
    assert all("kl/mean" not in r and r["loss/policy"] == r["loss/policy"] for r in rows)
    assert "reference none (ppo.kl_coef 0)" in open(tmp_path / "run" / "launcher.log").read()


def test_actor_average_of_tensor_parallel_shards(cache_dir, tmp_path):
    """model.actor_ema on the Megatron engine: each rank averages its shard; beta 1 keeps the
    starting weights, so the exported average (shards swapped in, collected by the export) is
    the prepared SFT actor exactly."""
    from safetensors.torch import load_file

    _train(str(tmp_path / "run"), cache_dir, 2, "system.tensor_parallel=2", "checkpoint.export_hf=true",
           "model.actor_ema=true", "model.actor_ema_beta=1.0")
    sft_dir = [d for d in os.scandir(cache_dir) if d.is_dir() and not d.name.startswith(".")][0].path
    sft = load_file(os.path.join(sft_dir, "actor", "model.safetensors"))
    ema = load_file(str(tmp_path / "run" / "actor_ema" / "model.safetensors"))
    actor = load_file(str(tmp_path / "run" / "actor" / "model.safetensors"))
    assert ema.keys() == sft.keys()
    for name in sft:
        torch.testing.assert_close(ema[name], sft[name], atol=0, rtol=0, msg=name)
    assert any(not torch.equal(actor[n], sft[n]) for n in sft)


def test_stage_placement_with_tensor_parallel(one_rank_run, cache_dir, tmp_path):
    """``oppo.placement: stage`` on the Megatron backend: actor and critic tensor parallel over
    ranks 0-1, the reward and reference models and an HF copy of the critic on rank 2 (the
    scorer rank, outside megatron's groups, fed chunks point-to-point). Before each rollout
    the replica gathers its critic's two shards on rank 0 in HF layout, which sends them to
    the copy. The two actor ranks of the replica decode the same tokens; only rank 0 streams
    them, and rank 1 receives the scores from it. The run must repeat the one-rank run's
    responses and metrics (its critic values included: step 2's come from weights step 1
    trained, sent over), and its held-out answers and their rewards, which stream to the
    scorer rank as a rollout's do."""
    want, _, one_dir = one_rank_run
    got, summary = _train(str(tmp_path / "run"), cache_dir, 3, "system.tensor_parallel=2",
                          "oppo.streaming=true", "oppo.placement=stage", "oppo.chunk_size=3",
                          "oppo.stream_to=[reference,critic]", *GREEDY_EVAL)
    log = (tmp_path / "run" / "launcher.log").read_text()
    assert "rank 2 scores (reward, reference, critic) for actor ranks [0, 1] (streamed by " \
        "ranks [0], one per model replica); the critic's weights go to it from rank 0 after " \
        "every update (gathered from its replica's shards in HF layout first)" in log
    # sent before every rollout that follows an update: step 1's went with the evaluation
    # before it, step 2's in its own rollout
    assert [r["stream/critic_weights_s"] > 0 for r in got] == [False, True]
    # one rollout per step, not one per rank of the replica, and two per evaluation (5 prompts
    # in batches of 4)
    assert "scorer rank 2: served 6 rollouts from actor ranks [0]" in log
    assert "tensor_parallel=2 pipeline_parallel=1 data_parallel=1" in log
    assert summary["world_size"] == 1 and summary["samples"] == 2 * 4
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(want, got):
        assert a["response/lengths"] == b["response/lengths"]
        for key in SAME:
            assert b[key] == pytest.approx(a[key], abs=1e-4, rel=1e-4), (a["step"], key)
        assert b["stream/scoring_hidden_frac"] > 0
    want_answers, got_answers = (read_history(str(d / "eval_samples.jsonl"))
                                 for d in (one_dir, tmp_path / "run"))
    assert len(got_answers) == len(want_answers) == 10
    for a, b in zip(want_answers, got_answers):
        assert (a["step"], a["prompt_id"], a["response"]) == (b["step"], b["prompt_id"], b["response"])
        assert b["reward"] == pytest.approx(a["reward"], abs=1e-4, rel=1e-4)


def test_stage_placement_with_two_replicas_shares_one_critic_copy(cache_dir, tmp_path):
    """Two data-parallel replicas (tp 1) and the scorer rank: each replica's rank streams its
    own rollouts; replica 0 sends the critic's weights (the same in both after the
    all-reduced update), replica 1 has the stage await them. Same metrics as the same two
    replicas with every scorer inline."""
    args = ["oppo.streaming=true", "oppo.chunk_size=3", "oppo.stream_to=[reference,critic]"]
    want, _ = _train(str(tmp_path / "inline"), cache_dir, 2, *args)
    got, summary = _train(str(tmp_path / "stage"), cache_dir, 3, "oppo.placement=stage", *args)
    log = (tmp_path / "stage" / "launcher.log").read_text()
    assert "rank 2 scores (reward, reference, critic) for actor ranks [0, 1]; the critic's " \
        "weights go to it from rank 0 after every update" in log
    assert "scorer rank 2: served 4 rollouts from actor ranks [0, 1]" in log
    assert summary["world_size"] == 2 and summary["samples"] == 2 * 2 * 4
    assert all(r["stream/critic_weights_s"] > 0 for r in got)
    for a, b in zip(want, got):
        assert a["response/lengths"] == b["response/lengths"]
        for key in SAME:
            assert b[key] == pytest.approx(a[key], abs=1e-4, rel=1e-4), (a["step"], key)
    # the two replicas' checkpoint evaluates on one rank (--evaluate; the other way round:
    # test_evaluate_on_more_data_parallel_ranks_than_the_run)
    _train(str(tmp_path / "inline"), cache_dir, 1, "--evaluate", *GREEDY_EVAL)
    figures = json.loads((tmp_path / "inline" / "evaluations" / "step_2.json").read_text())
    assert (figures["actor"], figures["settings"]["ranks"]) == ("checkpoint step2", 1)
    answers = read_history(str(tmp_path / "inline" / "evaluations" / "step_2_samples.jsonl"))
    assert [a["prompt_id"] for a in answers] == [f"builtin-eval-{i}" for i in range(5)]


def test_stage_placement_with_overcommitment_and_tensor_parallel(cache_dir, tmp_path):
    """Full OPPO on the stage placement with a tp=2 replica: the pool's rows (deferred ones
    with their responses so far) go to the scorer rank from rank 0 only, rank 1 gets the
    finished rows' scores from rank 0 (the critic's from the stage's copy, which prefills
    every carried row again with the weights step 1 trained), and the run repeats the
    one-rank pool run (critic streamed in that process) at 1e-4 for
    the 2 steps tp=2 is known to repeat (see docs/megatron.md: Adam turns reduction-order
    noise into visible drift from the third step on); step 2 continues rows step 1 deferred."""
    pool = ["oppo.streaming=true", "oppo.chunk_size=3", "oppo.stream_to=[reference,critic]",
            "oppo.overcommit=2", "steps=2"]
    want, _ = _train(str(tmp_path / "one"), cache_dir, 1, *pool)
    got, summary = _train(str(tmp_path / "stage"), cache_dir, 3, "system.tensor_parallel=2",
                          "oppo.placement=stage", *pool)
    log = (tmp_path / "stage" / "launcher.log").read_text()
    assert "scorer rank 2: served 2 rollouts from actor ranks [0]" in log
    assert summary["samples"] == 2 * 4
    assert got[0]["pool/carried"] > 0
    for a, b in zip(want, got):
        assert a["response/lengths"] == b["response/lengths"]
        for key in SAME + ("pool/carried", "pool/deferred_frac"):
            assert b[key] == pytest.approx(a[key], abs=1e-4, rel=1e-4), (a["step"], key)


def test_stage_placement_with_dynamic_sampling_and_tensor_parallel(cache_dir, tmp_path):
    """Everything at once: a tp=2 replica, the scorer rank, the rollout pool and
    ppo.filter_groups with the reward-range rule. A filter round is one rollout of rank 0's
    to the stage (rank 1 takes rank 0's scores), so the stage serves exactly the rounds the
    run logs, and the run repeats the one-rank run (group_norm: no critic; reward and
    reference streamed in that process): the same rounds and drops, the rest at 1e-4 for the
    2 steps tp=2 repeats (see above)."""
    args = ["oppo.streaming=true", "oppo.chunk_size=3", "oppo.stream_to=[reference]",
            "oppo.overcommit=2", "steps=2", "ppo.advantage_estimator=group_norm",
            "data.samples_per_prompt=2", "ppo.filter_groups=true",
            "ppo.filter_groups_reward_range=[0.5,1e9]"]
    want, _ = _train(str(tmp_path / "one"), cache_dir, 1, *args)
    got, _ = _train(str(tmp_path / "stage"), cache_dir, 3, "system.tensor_parallel=2",
                    "oppo.placement=stage", *args)
    rounds = sum(r["filter/rounds"] for r in got)
    assert rounds > len(got) and sum(r["filter/dropped_groups"] for r in got) > 0
    log = (tmp_path / "stage" / "launcher.log").read_text()
    assert f"scorer rank 2: served {rounds} rollouts from actor ranks [0]" in log
    for a, b in zip(want, got):
        for key in FILTER_SAME:
            assert a[key] == b[key], (a["step"], key)
        for key in (*SAME_WITHOUT_CRITIC, "pool/carried"):
            assert b[key] == pytest.approx(a[key], abs=1e-4, rel=1e-4), (a["step"], key)


def _rank_process(rank, world, port, out_dir, cache_dir, *overrides):
    """One rank of a run started without a launcher (the test needs each rank's pid)."""
    from _builders import rank_process

    return rank_process(rank, world, port, [*SMALL, f"workload.cache_dir={cache_dir}",
                                            f"logging.output_dir={out_dir}", *overrides])


def test_pipeline_parallel_pool_resumes_with_its_scorer_caches(cache_dir, tmp_path):
    """pp=2 with the rollout pool and streaming: the step-2 checkpoint carries the deferred
    rows with the frozen scorers' K/V caches, each stage's holding only its own decoder layer
    (of 2). Resumed from there, step 3 repeats the uninterrupted run's (was: a ValueError,
    the saved K/V of 1 layer checked against the whole model's 2)."""
    args = ["system.pipeline_parallel=2", "oppo.streaming=true", "oppo.chunk_size=3",
            "oppo.stream_to=[reference]", "oppo.overcommit=2", "steps=3", "checkpoint.every=2"]
    out = str(tmp_path / "run")
    want, _ = _train(out, cache_dir, 2, *args)
    assert want[1]["pool/carried"] > 0  # step 2 deferred rows into the checkpoint
    got, _ = _train(out, cache_dir, 2, *args, "checkpoint.resume=step2")
    assert "resumed from step2 at step 2" in (tmp_path / "run" / "launcher.log").read_text()
    assert [r["step"] for r in got] == [1, 2, 3]
    a, b = want[2], got[2]
    assert a["response/lengths"] == b["response/lengths"]
    for key in SAME + ("pool/carried", "pool/deferred_frac"):
        assert b[key] == pytest.approx(a[key], abs=1e-4, rel=1e-4), key


def test_signal_to_one_rank_of_a_replica_stops_the_replica(cache_dir, tmp_path):
    """A signal that reaches one rank of a tensor-parallel replica stops both ranks after the
    same step with a loadable checkpoint. The decision used to be agreed over the
    data-parallel group, which under tp=2, dp=1 holds each rank alone: rank 1 stopped and
    rank 0 went on into a step whose collectives rank 1 never joined (a hang). The run also
    streams with ``chunk_size: auto`` (exploring every 3 steps) and ``overcommit: auto``, the
    other decisions both ranks of the replica must take alike, or their tensor-parallel
    scorer calls and stop checks stop pairing up."""
    from oppo_ds.engines.deepspeed_engine import find_free_port
    from oppo_ds.preemption import PREEMPTED_EXIT

    out = tmp_path / "run"
    args = ["steps=400", "checkpoint.every=0", "system.tensor_parallel=2",
            "oppo.streaming=true", "oppo.chunk_size=auto", "oppo.chunk_candidates=[2,3,5]",
            "oppo.chunk_explore_every=3", "oppo.overcommit=auto", "oppo.delta_max=2",
            "oppo.delta_window=2", "oppo.stream_to=[reference,critic]"]
    port = find_free_port()
    procs = [_rank_process(r, 2, port, out, cache_dir, *args) for r in range(2)]
    metrics = out / "metrics.jsonl"
    logs = signal_after_steps(procs, metrics, 8, [1])  # rank 1 only
    assert [p.returncode for p in procs] == [PREEMPTED_EXIT] * 2, logs[0][-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    done = len(rows)
    assert 8 <= done < 400
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step{done}"
    # the replica's ranks took the controllers' decisions together: one log of each
    assert "chunk_size=" in logs[0] and "after exploring" in logs[0]
    assert len({r["oppo/chunk_size"] for r in rows}) > 1

    # the checkpoint loads: the same command, one step further, resumes from it
    proc = subprocess.run(
        [shutil.which("deepspeed", path=os.path.dirname(sys.executable)), "--num_gpus", "2",
         "--master_port", str(find_free_port()), "--module", "oppo_ds.train", *SMALL,
         f"workload.cache_dir={cache_dir}", f"logging.output_dir={out}",
         *args[1:], f"steps={done + 1}"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from step{done} at step {done}" in proc.stdout + proc.stderr
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == \
        list(range(1, done + 2))


def _check_export(run_dir, offline_dir):
    """The run's HF export (every rank's shard gathered to rank 0 at the end) equals the
    offline export of its last checkpoint (the shard files, ``python -m
    oppo_ds.megatron.export``), tensor for tensor, and loads as the HF classes."""
    from transformers import AutoModelForCausalLM

    from oppo_ds.models import ValueHeadModel

    for name, cls in (("actor", AutoModelForCausalLM), ("critic", ValueHeadModel)):
        tag = run_dir / "checkpoints" / name / "step2"
        proc = subprocess.run([sys.executable, "-m", "oppo_ds.megatron.export", str(tag),
                               str(offline_dir / name)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        exported = cls.from_pretrained(str(run_dir / name)).state_dict()
        offline = cls.from_pretrained(str(offline_dir / name)).state_dict()
        assert exported.keys() == offline.keys() and len(exported) > 10
        assert all(torch.equal(exported[k], offline[k]) for k in exported), name
    assert os.path.isfile(run_dir / "actor" / "tokenizer.json")


# ------------------------------------------------------------------------------ config

def test_layer_spec_settings():
    from oppo_ds.config import ConfigError, load_config
    from oppo_ds.engines.megatron_engine import check_megatron_config
    from oppo_ds.megatron.model import resolve_layer_spec

    with pytest.raises(ConfigError, match="needs backend: megatron") as err:
        load_config(None, ["system.megatron_layers=local"])
    assert err.value.key == "system.megatron_layers"
    with pytest.raises(ConfigError, match="'auto', 'local', 'transformer_engine'"):
        load_config(None, ["system.backend=megatron", "system.megatron_layers=te"])
    assert resolve_layer_spec("local") == "local"
    assert resolve_layer_spec("auto") == ("transformer_engine" if _TE_USABLE else "local")
    cfg = load_config(None, ["system.backend=megatron", "system.megatron_layers=transformer_engine",
                             "checkpoint.export_hf=false"])
    if _TE_USABLE:
        check_megatron_config(cfg)
    else:  # asked for explicitly where it cannot run: the key and the reason, before any build
        with pytest.raises(ConfigError, match="transformer_engine: .*use local or auto") as err:
            check_megatron_config(cfg)
        assert err.value.key == "system.megatron_layers"


@pytest.mark.parametrize("split", [["system.tensor_parallel=2"], ["system.pipeline_parallel=2"],
                                   ["system.tensor_parallel=2", "system.pipeline_parallel=2"]])
def test_colocated_placement_is_refused_over_model_parallel_ranks(split):
    """The colocated scorer thread's forwards would be collectives beside the decode's (over
    gloo: a collective mismatch): refused at load, naming the placements that work; one rank
    per model keeps it (its forwards are no collectives)."""
    from oppo_ds.config import ConfigError, load_config

    base = ["system.backend=megatron", "oppo.streaming=true"]
    with pytest.raises(ConfigError, match="colocated cannot run .*use inline or stage") as err:
        load_config(None, base + split + ["oppo.placement=colocated"])
    assert err.value.key == "oppo.placement"
    for placement in ("inline", "stage"):
        load_config(None, base + split + [f"oppo.placement={placement}"])
    load_config(None, base + ["oppo.placement=colocated"])


def test_hf_model_holds_exactly_the_given_weights():
    """``hf_model`` builds without random initialisation (the stage calls it before every
    rollout), so a weight the state lacks would be left as whatever memory held: it is an
    error naming the weight; a tied LM may lack only its lm_head, which is the embedding."""
    from oppo_ds.megatron.model import hf_model
    from oppo_ds.models import ValueHeadModel

    config = tiny_config("tiny-qwen2", VOCAB)
    torch.manual_seed(0)
    ref = ValueHeadModel.from_config(config, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    model = hf_model(config, dict(state), "value", tied=False)
    for name, p in model.named_parameters():
        assert torch.equal(p, state[name]), name
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():  # buffers (the rotary frequencies) are built as usual
        assert torch.equal(model.eval()(input_ids=ids).values, ref.eval()(input_ids=ids).values)
    del state["body.norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['body.norm.weight'\]"):
        hf_model(config, state, "value", tied=False)
    config.tie_word_embeddings = True
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tied = {k: v.detach().clone() for k, v in lm.state_dict().items() if k != "lm_head.weight"}
    out = hf_model(config, tied, "lm", tied=True)
    assert out.lm_head.weight is out.model.embed_tokens.weight
    # a critic or reward model of a tied checkpoint (Qwen2.5-0.5B/1.5B, tie_word_embeddings:
    # true) is a body and a scalar head: nothing to tie (it died in tie_weights, at the export
    # and, under the stage placement, at every critic hand-over)
    value = ValueHeadModel.from_config(config, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in value.state_dict().items()}
    out = hf_model(config, dict(state), "value", tied=True)
    for name, p in out.named_parameters():
        assert torch.equal(p, state[name]), name


def test_export_names_what_is_missing(tmp_path):
    from oppo_ds.megatron.export import main

    assert main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    for name in ("mp_rank_00_000.pt", "mp_rank_01_001.pt"):  # tp 2 x pp 2 with two missing
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="mp_rank_01_000.pt, mp_rank_00_001.pt"):
        from oppo_ds.megatron.export import shard_files
        shard_files(str(tmp_path))


def test_a_resume_takes_the_configured_learning_rate(tmp_path):
    """As with DeepSpeed (test_engines): the Megatron engine's saved optimizer and scheduler
    state carried the checkpoint's peak learning rate and weight decay, which replaced the
    configured ones on resume (Adam's betas and epsilon too); the configuration wins now, and
    the log says so."""
    from _builders import single_process_env, tiny_run_overrides

    env = single_process_env()
    common = tiny_run_overrides(tmp_path, steps=2) + [
        "system.backend=megatron", "checkpoint.every=1", "ppo.lr_schedule=linear"]

    def run(*extra):
        proc = subprocess.run([sys.executable, "-m", "oppo_ds.train", *common, *extra], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr

    run()
    log = run("steps=4", "ppo.actor_lr=1e-05", "ppo.weight_decay=0.1",
              "ppo.adam_betas=[0.8,0.99]", "ppo.adam_eps=1e-06")
    assert "ppo.actor_lr: 1e-05, not the 0.0005 checkpoint step2 was written with" in log
    assert "ppo.weight_decay: 0.1, not the 0 checkpoint step2 was written with" in log
    assert "ppo.adam_betas: [0.8, 0.99], not the [0.9, 0.95] checkpoint step2 was written with" \
        in log
    assert "ppo.adam_eps: 1e-06, not the 1e-08 checkpoint step2 was written with" in log
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # the lr after update 3 of 4 (linear, no warm-up): 1e-5 x (1 - 3/4)
    assert rows[2]["lr/actor"] == pytest.approx(1e-5 * 0.25)


def test_micro_batches_sized_by_tokens_under_megatron(tmp_path):
    """ppo.micro_batch_tokens under system.backend megatron: a budget of 4 sequences of the
    longest (4 x (32 + 6)) makes one micro-batch of each mini-batch of 4, and the engine takes
    it as the update (its loss divided by the 2 accumulation steps of micro-batches of 2, as
    the normaliser assumes); the run is the one in micro-batches of 2 (1e-5, relative for the
    value loss in the hundreds: summation order)."""
    from _builders import single_process_env, tiny_run_overrides

    env = single_process_env()
    rows = {}
    for name, extra in (("micro2", []), ("tokens", ["ppo.micro_batch_tokens=152"])):
        common = tiny_run_overrides(tmp_path / name, steps=2) + [
            "system.backend=megatron", "checkpoint.export_hf=false", *extra]
        proc = subprocess.run([sys.executable, "-m", "oppo_ds.train", *common], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[name] = read_history(str(tmp_path / name / "run" / "metrics.jsonl"))
    assert [r["train/micro_batches"] for r in rows["micro2"]] == [2, 2]
    assert [r["train/micro_batches"] for r in rows["tokens"]] == [1, 1]
    for fixed, tokens in zip(rows["micro2"], rows["tokens"], strict=True):
        assert fixed["response/lengths"] == tokens["response/lengths"]
        for key in ("reward/mean", "kl/mean", "loss/policy", "loss/value", "grad_norm/actor",
                    "grad_norm/critic"):
            # the value loss of the untrained tiny critic is in the hundreds: 1e-5 relative
            assert tokens[key] == pytest.approx(fixed[key], rel=1e-5, abs=1e-5), \
                (key, fixed, tokens)


def test_evaluate_on_more_data_parallel_ranks_than_the_run(one_rank_run, cache_dir, tmp_path):
    """``oppo-train --evaluate`` of a one-rank Megatron checkpoint on two ranks (two model
    replicas, data parallel 2): the module's weights load on both, the evaluation's prompts
    are shared out, and the answers are the run's last ones, greedy (rewards to 1e-4: the
    prompts share batches with others than in the run, so their padding differs). Equal
    greedy tokens assume no near-tie between a step's two likeliest tokens, which fp32 (the
    run's dtype) keeps to differences of about 1e-6; checked for these 5 prompts."""
    _, _, one_dir = one_rank_run
    run = tmp_path / "run"
    shutil.copytree(one_dir, run)  # the run's folder, as --evaluate finds it after training
    _train(str(run), cache_dir, 2, "--evaluate", *GREEDY_EVAL)
    figures = json.loads((run / "evaluations" / "step_2.json").read_text())
    assert (figures["actor"], figures["settings"]["ranks"]) == ("checkpoint step2", 2)
    again = read_history(str(run / "evaluations" / "step_2_samples.jsonl"))
    last = [a for a in read_history(str(one_dir / "eval_samples.jsonl")) if a["step"] == 2]
    assert sorted(a["prompt_id"] for a in again) == sorted(a["prompt_id"] for a in last)
    by_id = {a["prompt_id"]: a for a in again}
    for a in last:
        assert by_id[a["prompt_id"]]["response"] == a["response"], a["prompt_id"]
        assert by_id[a["prompt_id"]]["reward"] == pytest.approx(a["reward"], abs=1e-4)


def test_a_transformers_4_config_s_rope_scaling_is_read_too():
    """transformers 4.x holds RoPE scaling in ``rope_scaling`` (its type under ``rope_type``,
    or ``type`` in older configs) beside ``rope_theta``, where 5.x has ``rope_parameters``:
    read from either, a Llama 3.1 under 4.x converts scaled, not silently as plain RoPE, and
    another scaling is refused by name."""
    from types import SimpleNamespace

    base = dict(model_type="llama", num_attention_heads=4, hidden_size=64, num_hidden_layers=2,
                vocab_size=32, intermediate_size=128, rms_norm_eps=1e-5, hidden_act="silu",
                max_position_embeddings=128, rope_theta=500000.0)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    shape = shape_of(SimpleNamespace(**base, rope_scaling=llama3))
    assert shape.rope_theta == 500000.0 and shape.rope_scaling is not None
    assert shape.rope_scaling.original_max_position_embeddings == 32
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        shape_of(SimpleNamespace(**base, rope_scaling={"type": "linear", "factor": 2.0}))
