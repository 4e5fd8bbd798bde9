"""oppo-plan: shapes against models built from config, memory against DeepSpeed's own
estimators, the simulator against hand-computed schedules and against make bench's timings,
and the planner on every shipped config."""
from __future__ import annotations

import dataclasses
import glob
import json
import math
import os

import numpy as np
import pytest
import torch

from oppo_ds.cli import plan as plan_cli
from oppo_ds.config import Config, ConfigError, load_config
from oppo_ds.plan.calibrate import fit_cpu
from oppo_ds.plan.costs import CPU, GIB, Device, get_device
from oppo_ds.plan.memory import model_states, plan_memory
from oppo_ds.plan.planner import layout, plan
from oppo_ds.plan.shapes import Shapes, named_shape, resolve_shapes, shape_in_path, tiny_shape
from oppo_ds.plan.simulate import (CostModel, Layout, LengthDist, Schedule, StepSimulator,
                                   _sum_max_linear)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "examples", "configs", "*.yaml")))
# how docs/scaling.md plans each shipped config: cluster, device, shapes for paths naming none
SHIPPED = {
    "tiny.yaml": (1, 1, "cpu", {}),
    "tiny_rule_reward.yaml": (1, 1, "cpu", {}),
    "own_models.yaml": (1, 8, "H100-80GB", {"actor": "llama3-8b", "reward": "llama3-8b"}),
    "llama3_8b_zero3.yaml": (1, 8, "H100-80GB", {}),
    "llama3_8b_grpo.yaml": (1, 8, "H100-80GB", {}),
    "llama3_8b_dapo.yaml": (1, 8, "H100-80GB", {}),
    "llama3_70b.yaml": (8, 8, "H100-80GB", {}),
    "megatron_tiny.yaml": (1, 2, "H100-80GB", {}),
    "megatron_70b.yaml": (4, 8, "H100-80GB", {}),
}


# ---------------------------------------------------------------- shapes

@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2", "tiny-gpt2"])
def test_parameter_count_equals_the_model_built_from_config(arch):
    from oppo_ds.models import build_causal_lm, build_value_model, count_parameters

    shape = tiny_shape(arch, 33)
    assert count_parameters(build_causal_lm(arch, vocab_size=33, seed=0)) == shape.params()
    assert count_parameters(build_value_model(arch, vocab_size=33, seed=0)) == shape.params(value_head=True)
    assert shape.kv_bytes_per_token(2) == 2 * shape.layers * shape.kv_heads * shape.head_dim * 2


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "qwen2.5-7b", "llama3.2-1b"])
def test_public_shapes_equal_hf_models_on_the_meta_device(name):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    s = named_shape(name)
    cls = Qwen2Config if s.qkv_bias else LlamaConfig
    cfg = cls(vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
              intermediate_size=s.intermediate, num_attention_heads=s.heads,
              num_key_value_heads=s.kv_heads, tie_word_embeddings=s.tied)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == s.params()
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert largest == s.largest_module_params()


def test_largest_layer_and_total_match_deepspeed_model_to_params():
    from deepspeed.runtime.zero.stage3 import model_to_params

    from oppo_ds.models import build_causal_lm

    model = build_causal_lm("tiny-llama", vocab_size=4096, seed=0)
    shape = tiny_shape("tiny-llama", 4096)
    assert model_to_params(model) == (shape.params(), shape.largest_module_params())


def test_shapes_from_names_paths_and_config_json(tmp_path):
    assert shape_in_path("/ckpt/Meta-Llama-3-70B-Instruct").name == "llama3-70b"
    assert shape_in_path("/ckpt/llama3-8b-rm").name == "llama3-8b"
    assert shape_in_path("/ckpt/llama3.1-8b-sft").name == "llama3-8b"
    assert shape_in_path("/ckpt/qwen2.5-72b").name == "qwen2.5-72b"
    assert shape_in_path("/ckpt/my-model") is None
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}))
    cfg = load_config(None, [f"model.actor={d}", f"model.reward={d}"])
    assert resolve_shapes(cfg).actor.params() == named_shape("llama3-8b").params()
    with pytest.raises(ValueError, match="model.actor.*--shape actor=NAME"):
        resolve_shapes(load_config(None, ["model.actor=/nowhere/my-model"]))


# ---------------------------------------------------------------- memory

@pytest.mark.parametrize("name", ["llama3-8b", "qwen2.5-7b", "llama3-70b"])
@pytest.mark.parametrize("nodes,per_node", [(1, 8), (2, 8), (8, 8), (1, 4)])
def test_model_states_within_5_percent_of_deepspeed_estimators(name, nodes, per_node):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    s = named_shape(name)
    p, largest, gpus = s.params(), s.largest_module_params(), nodes * per_node
    for offload in (False, True):
        ours = model_states(p, p, largest, zero_stage=2, offload=offload, gpus=gpus, gpus_per_node=per_node)
        _, ds_gpu = estimate_zero2_model_states_mem_needs(p, per_node, nodes, cpu_offload=offload)
        assert ours.gpu == pytest.approx(ds_gpu, rel=0.05)
        ours = model_states(p, p, largest, zero_stage=3, offload=offload, gpus=gpus, gpus_per_node=per_node)
        ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
            p, largest, per_node, nodes, cpu_offload=offload, cpu_offload_params=offload)
        assert ours.gpu == pytest.approx(ds_gpu, rel=0.05)
        if offload:  # DeepSpeed adds a buffer factor of 1.5 to its CPU figure
            assert ours.cpu_per_node * 1.5 == pytest.approx(ds_cpu, rel=0.05)


def _cfg(*overrides) -> Config:
    return load_config(None, ["model.actor=llama3-8b-sft", "model.reward=llama3-8b-rm",
                              "system.dtype=bf16", *overrides])


def test_zero1_bf16_plans_its_gradients_whole_and_in_fp32():
    """system.grad_accum_dtype auto under bf16 ZeRO-1: DeepSpeed's BF16 optimizer keeps the
    gradients in one fp32 buffer of the whole model on every rank (bf16_optimizer.py), twice
    the bytes of bf16 ones, and no fp32 gradient partition beside its master weights and
    moments (12 bytes a parameter, partitioned)."""
    dev = get_device("H100-80GB")
    shapes = resolve_shapes(_cfg())
    fp32 = plan_memory(_cfg("system.zero_stage=1"), shapes, 1, 8, dev).items
    bf16 = plan_memory(_cfg("system.zero_stage=1", "system.grad_accum_dtype=bf16"), shapes, 1, 8,
                       dev).items
    for model in ("actor", "critic"):
        assert fp32[f"{model}_grads"] == 2 * bf16[f"{model}_grads"]
        assert fp32[f"{model}_optimizer"] == pytest.approx(bf16[f"{model}_optimizer"] * 12 / 16)
    assert fp32["actor_grads"] == 4 * shapes.actor.params()
    assert fp32["actor_optimizer"] == pytest.approx(12 * shapes.actor.params() / 8)
    # ZeRO-3 accumulating in fp32: its persistent fp32 gradient partition and the step's copy
    z3 = {accum: plan_memory(_cfg("system.zero_stage=3", f"system.grad_accum_dtype={accum}"),
                             shapes, 1, 8, dev).items for accum in ("fp32", "bf16")}
    assert z3["fp32"]["actor_grads"] == 2 * z3["bf16"]["actor_grads"]


def test_memory_items_follow_the_configuration():
    dev = get_device("H100-80GB")
    cfg = _cfg("system.zero_stage=3")
    shapes = resolve_shapes(cfg)
    a = shapes.actor
    m8 = plan_memory(cfg, shapes, 1, 8, dev).items
    m16 = plan_memory(cfg, shapes, 2, 8, dev).items
    assert m8["actor_optimizer"] + m8["actor_grads"] == 16 * a.params() / 8
    assert m16["actor_optimizer"] == pytest.approx(m8["actor_optimizer"] / 2)
    seq = cfg.generation.max_prompt_len + cfg.generation.max_new_tokens
    assert m8["actor_kv"] == cfg.ppo.batch_size * seq * 2 * a.layers * a.kv_heads * a.head_dim * 2
    ckpt = plan_memory(_cfg("system.zero_stage=3", "system.gradient_checkpointing=true"), shapes, 1, 8, dev).items
    assert ckpt["activations_train"] < m8["activations_train"] / 3
    part = plan_memory(_cfg("system.zero_stage=3", "system.partition_reference=true", "oppo.stream_to=[critic]"),
                       shapes, 1, 8, dev).items
    assert part["reference"] == pytest.approx(m8["reference"] / 8)
    lora = plan_memory(_cfg("system.zero_stage=3", "model.actor_lora_dim=64", "model.only_optimize_lora=true"),
                       shapes, 1, 8, dev).items
    assert lora["actor_optimizer"] + lora["actor_grads"] == 16 * a.lora_params(64) / 8
    assert lora["actor_params"] == 2 * (a.params() + a.lora_params(64)) / 8
    # LoRA alone: the decoder layers' linear weights are frozen, everything else trains
    frozen = a.layers * sum(i * o for i, o, _ in a.linears())
    lora = plan_memory(_cfg("system.zero_stage=3", "model.actor_lora_dim=64"), shapes, 1, 8,
                       dev).items
    assert lora["actor_optimizer"] + lora["actor_grads"] == pytest.approx(
        16 * (a.params() + a.lora_params(64) - frozen) / 8)
    # the update's micro-batch: 8 rows of seq positions, whose layers' activations grow with
    # its positions and whose logits, 16 bytes each (fp32 log-softmax, entropy, gradients), are
    # those of each row's response and the position before it (8 x 193 of 8 x 224 here)
    new = cfg.generation.max_new_tokens
    logits = 16 * a.vocab
    per_token = (m8["activations_train"] - logits * 8 * (new + 1)) / (8 * seq)
    assert per_token == a.layers * a.activation_bytes_per_token(2, False)
    # micro-batches of a quarter of the tokens: their positions may all be responses' (budget
    # rows are of any length), the scoring forwards' stay
    budget = plan_memory(_cfg("system.zero_stage=3", f"ppo.micro_batch_tokens={2 * seq}"),
                         shapes, 1, 8, dev).items
    assert budget["activations_train"] == pytest.approx((per_token + logits) * 2 * seq, rel=1e-6)
    assert budget["activations_score"] == m8["activations_score"]
    # a no-grad scoring forward: its logits in bf16 and one block of rows' fp32 copies (12
    # bytes a logit for 32M logits at most), of 8 x 193 positions, or a budget's 2 x seq
    block = 12 * 32 * 2 ** 20
    assert m8["activations_score"] == 2 * 8 * (new + 1) * a.vocab + block
    scored = plan_memory(_cfg("system.zero_stage=3", f"ppo.score_batch_tokens={2 * seq}"),
                         shapes, 1, 8, dev).items
    assert scored["activations_score"] == 2 * 2 * seq * a.vocab + block
    assert scored["activations_train"] == m8["activations_train"]
    # PPO-ptx: the actor's micro-batch holds its rows' blocks too (8 x (seq + seq) positions),
    # whose every position has logits, within a budget as well
    ptx = ["ppo.ptx_coef=0.5", "data.ptx=/data/pretrain.jsonl", f"data.ptx_block_len={seq}"]
    with_ptx = plan_memory(_cfg("system.zero_stage=3", *ptx), shapes, 1, 8, dev).items
    assert with_ptx["activations_train"] == pytest.approx(
        per_token * 8 * 2 * seq + logits * 8 * (new + 1 + seq), rel=1e-6)
    ptx_budget = plan_memory(_cfg("system.zero_stage=3", f"ppo.micro_batch_tokens={4 * seq}",
                                  *ptx), shapes, 1, 8, dev).items
    assert ptx_budget["activations_train"] == pytest.approx((per_token + logits) * 4 * seq,
                                                            rel=1e-6)
    over = plan_memory(_cfg("oppo.overcommit=8", "oppo.streaming=true"), shapes, 1, 8, dev).items
    # B + Delta rows, each up to a deferred row's partial response (max_new_tokens - 1, packed
    # after its prompt) longer: the rollout then decodes max_new_tokens more for its new rows
    carried = seq + cfg.generation.max_new_tokens - 1
    assert over["actor_kv"] == pytest.approx(
        m8["actor_kv"] * (cfg.ppo.batch_size + 8) / cfg.ppo.batch_size * carried / seq)
    he = plan_memory(_cfg("system.zero_stage=3", "system.hybrid_engine=true", "system.inference_tp_size=4"),
                     shapes, 1, 8, dev).items
    assert he["hybrid_engine_copy"] == 2 * a.params() / 4
    # the static cache at its rounded length; with a graph it and the logits outlive the rollout
    static = plan_memory(_cfg("system.zero_stage=3", "generation.static_cache=true"), shapes, 1, 8, dev)
    length = -(-(seq + 1) // 64) * 64
    assert static.items["actor_kv"] == pytest.approx(m8["actor_kv"] * length / seq)
    assert static.items["kept_decode_graph"] == 0
    static_over = plan_memory(_cfg("system.zero_stage=3", "generation.static_cache=true",
                                   "oppo.overcommit=8"), shapes, 1, 8, dev)
    length_over = -(-(carried + 1) // 64) * 64
    assert static_over.items["actor_kv"] == pytest.approx(
        m8["actor_kv"] * (cfg.ppo.batch_size + 8) / cfg.ppo.batch_size * length_over / seq)
    graph = plan_memory(_cfg("system.zero_stage=3", "generation.static_cache=true",
                             "generation.cuda_graph=true"), shapes, 1, 8, dev)
    kept = graph.items["kept_decode_graph"]
    assert kept == static.items["actor_kv"] + 2 * cfg.ppo.batch_size * a.vocab
    for phase in ("score", "train"):
        assert graph.phases[phase] - static.phases[phase] == pytest.approx(kept)
    assert graph.phases["generate"] == static.phases["generate"]


def test_zero3_rollouts_hold_the_gathered_models_and_scorer_caches_as_wide_as_the_actors():
    """Under ZeRO-3 the rollout runs on the actor gathered whole on every GPU
    (``_gathered_for_generation``, with or without the hybrid engine), and on the critic too
    where it streams on the actor ranks; the planner counted one module's gather (the
    hybrid engine's copy split over inference_tp_size), so llama3_70b.yaml "fit" with
    141 GB of gathered actor weights a GPU. A pool's streaming scorer rows are as wide as the
    actor's (deferred partial responses padded to the longest, then every chunk); they were
    planned at prompt + response. (An audit's findings, 2026-11-27.)"""
    dev = get_device("H100-80GB")
    cfg = _cfg("system.zero_stage=3", "system.hybrid_engine=false")
    shapes = resolve_shapes(cfg)
    w, a, c = 2, shapes.actor, shapes.critic
    plain = plan_memory(cfg, shapes, 1, 8, dev)
    assert plain.items["generation_gathered"] == w * a.params()
    assert plain.phases["generate"] > w * a.params()
    critic = plan_memory(_cfg("system.zero_stage=3", "oppo.streaming=true",
                              "oppo.stream_to=[critic]"), shapes, 1, 8, dev).items
    assert critic["generation_gathered"] == w * a.params() + w * c.params(value_head=True)
    stage = plan_memory(_cfg("system.zero_stage=3", "oppo.streaming=true", "oppo.placement=stage",
                             "oppo.stream_to=[critic]"), shapes, 1, 8, dev).items
    assert stage["generation_gathered"] == w * a.params()  # the stage's copy is not gathered
    z2 = plan_memory(_cfg("system.zero_stage=2"), shapes, 1, 8, dev).items
    assert z2["generation_gathered"] == 0 and z2["hybrid_engine_copy"] == 0
    g = cfg.generation
    for over in ([], ["oppo.overcommit=8"]):
        items = plan_memory(_cfg("system.zero_stage=3", "oppo.streaming=true",
                                 "oppo.stream_to=[]", *over), shapes, 1, 8, dev).items
        width = g.max_prompt_len + g.max_new_tokens + (g.max_new_tokens - 1 if over else 0)
        per_row = shapes.reward.kv_bytes_per_token(w)
        assert items["scorer_kv"] == pytest.approx(
            (cfg.ppo.batch_size + (8 if over else 0)) * width * per_row)
        assert items["carried_scorer_kv"] == pytest.approx(8 * width * per_row if over else 0)


def test_forwards_inside_a_zero3_rollout_gather_nothing():
    """Inside the rollout the ZeRO-3 models are gathered once (``rollout_fixed``: the actor,
    and the critic where it streams on the actor ranks) and their forwards, the rebuilding
    prefill and every streamed chunk, issue no collective; the simulator charged a whole
    gather to each (a streamed critic chunk 0.3 s of gather for 0.01 s of compute at 70B).
    Forwards after the rollout still gather per call."""
    dev = get_device("H100-80GB")
    shape = named_shape("llama3-8b")
    lay = Layout(batch=8, micro=4, mini=8, epochs=1, prompt_len=256, gpus=8, gpus_per_node=8)
    z3 = CostModel(dev, Shapes(shape, shape, shape, shape), lay, zero_stage=3)
    z0 = CostModel(dev, Shapes(shape, shape, shape, shape), lay, zero_stage=0)
    for kind in ("actor", "critic"):
        inside = z3.prefill_job(kind, 64.0, 64.0 * 256, gathered=True)
        assert inside.memory == pytest.approx(z0.prefill_job(kind, 64.0, 64.0 * 256).memory)
        assert z3.prefill_job(kind, 64.0, 64.0 * 256).memory > 4 * inside.memory
    gather = z3._gather_s(shape.params())
    assert z3.rollout_fixed() == pytest.approx(dev.rollout_setup_s + gather)
    assert z3.rollout_fixed(streamed_critic=True) == pytest.approx(
        dev.rollout_setup_s + gather + z3._gather_s(shape.params(value_head=True)))
    assert z0.rollout_fixed(streamed_critic=True) == pytest.approx(dev.rollout_setup_s)


def test_a_wider_later_round_of_filter_groups_sizes_the_rollouts_memory():
    """Under ppo.filter_groups a later round decodes what the batch lacks times
    filter_groups_oversample, in whole prompts: with oversampling 2, up to twice the batch
    (every group of the first round dropped), plus Delta. The actor's and the streaming
    scorers' caches are planned for that widest rollout (``Config.widest_rollout``, which
    the static decode's buffers take too); the deferred rows' carried caches stay Delta's."""
    dev = get_device("H100-80GB")
    group = ["data.samples_per_prompt=4", "ppo.advantage_estimator=rloo",
             "ppo.filter_groups=true", "oppo.overcommit=4", "oppo.streaming=true"]
    base, wide = _cfg(*group), _cfg(*group, "ppo.filter_groups_oversample=2")
    b = base.ppo.batch_size
    assert base.widest_rollout == b + 4 and wide.widest_rollout == 2 * b + 4
    # what the batch lacks at most (b / 4 prompts) times 1.5, rounded up to whole prompts
    odd = _cfg(*group, "ppo.filter_groups_oversample=1.5")
    assert odd.widest_rollout == 4 * math.ceil(b // 4 * 1.5) + 4
    assert _cfg("ppo.filter_groups_oversample=2").widest_rollout == b  # no filter, no rounds
    shapes = resolve_shapes(base)
    m, w = (plan_memory(c, shapes, 1, 8, dev).items for c in (base, wide))
    for item in ("actor_kv", "scorer_kv", "decode_logits"):
        assert w[item] == pytest.approx(m[item] * (2 * b + 4) / (b + 4)), item
    assert w["carried_scorer_kv"] == m["carried_scorer_kv"] > 0


# ---------------------------------------------------------------- simulator

def test_sum_max_linear_equals_the_loop():
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b, c, d = rng.normal(size=4)
        n = int(rng.integers(0, 40))
        loop = sum(max(a + b * k, c + d * k) for k in range(n))
        assert _sum_max_linear(a, b, c, d, n) == pytest.approx(loop, abs=1e-9)


def _overhead_device(**kw) -> Device:
    """A device whose every operation costs only its call overhead (rates unbounded)."""
    base = dict(decode_flops=math.inf, prefill_flops=math.inf, train_flops=math.inf, bw=math.inf,
                intra_node_bw=math.inf, inter_node_bw=math.inf, host_link_bw=math.inf,
                decode_call_s=1.0, prefill_call_s=0.1, train_call_s=0.5, layer_s=0.0, optim_s=0.25,
                rollout_setup_s=0.05, step_other_s=0.01)
    base.update(kw)
    return Device("test", 80.0, 0.0, 0.0, **base)


def _sim(device: Device, lengths, batch=8, micro=4, mini=8) -> StepSimulator:
    shape = tiny_shape("tiny-llama", 33)
    lay = Layout(batch=batch, micro=micro, mini=mini, epochs=1, prompt_len=11)
    costs = CostModel(device, Shapes(shape, shape, shape, shape), lay)
    dist = LengthDist(192, values=tuple(lengths)) if not isinstance(lengths, LengthDist) else lengths
    return StepSimulator(costs, dist)


def test_sequential_step_of_a_fixed_length_batch_is_the_hand_sum():
    dev, L, B, micro, mini = _overhead_device(), 20, 8, 4, 8
    res = _sim(dev, [L], B, micro, mini).run(Schedule("sequential"), steps=3, warmup=0)
    generate = dev.rollout_setup_s + dev.prefill_call_s + L * dev.decode_call_s
    score = 4 * (B // micro) * dev.prefill_call_s  # actor, reference, critic, reward
    train = 2 * (B // mini) * ((mini // micro) * dev.train_call_s + dev.optim_s)
    for step in res.steps:
        assert step.phases == pytest.approx({"generate": generate, "score": score, "other": 0.01, "train": train})
        assert step.step_s == pytest.approx(generate + score + 0.01 + train)
        assert step.tail_waste == 0.0


def test_micro_batches_by_tokens_train_in_fewer_calls():
    """ppo.micro_batch_tokens in the simulation: 8 rows of 11 + 20 tokens within 248
    positions are one forward/backward per mini-batch, where micro-batches of 4 are two; within
    124, two again; the scoring forwards keep micro-batches of 4, or with
    ppo.score_batch_tokens 248 score in one call per model."""
    dev, L, B, micro, mini = _overhead_device(), 20, 8, 4, 8
    shape = tiny_shape("tiny-llama", 33)
    phases = {}
    for budget in (None, 8 * 31, 4 * 31):
        lay = Layout(batch=B, micro=micro, mini=mini, epochs=1, prompt_len=11, micro_tokens=budget)
        costs = CostModel(dev, Shapes(shape, shape, shape, shape), lay)
        res = StepSimulator(costs, LengthDist(192, values=(L,))).run(Schedule("sequential"),
                                                                     steps=2, warmup=0)
        phases[budget] = res.steps[0].phases
    calls = {None: 2, 8 * 31: 1, 4 * 31: 2}
    for budget, n in calls.items():
        assert phases[budget]["train"] == pytest.approx(2 * (n * dev.train_call_s + dev.optim_s))
        assert phases[budget]["score"] == phases[None]["score"]
    assert phases[None]["score"] == pytest.approx(4 * 2 * dev.prefill_call_s)
    lay = Layout(batch=B, micro=micro, mini=mini, epochs=1, prompt_len=11, score_tokens=8 * 31)
    costs = CostModel(dev, Shapes(shape, shape, shape, shape), lay)
    res = StepSimulator(costs, LengthDist(192, values=(L,))).run(Schedule("sequential"),
                                                                 steps=2, warmup=0)
    assert res.steps[0].phases["score"] == pytest.approx(4 * 1 * dev.prefill_call_s)


def test_the_ranks_make_as_many_micro_batches_as_the_one_that_needs_most():
    """The trainer's agreement in the simulation: within 128 positions, 8 rows of 11 + 5
    tokens are one micro-batch and 8 rows of 11 + 20 two (4 x 31), and beside the longer rank
    the shorter one makes two as well (ZeRO's gradient collectives run once per backward),
    for the actor and the critic, in every mini-batch. Under ZeRO-3 the scoring forwards of
    the actor and critic (collectives there) are agreed alike; the reference's and reward
    model's (whole copies on each rank) are each rank's own, as are all of them under ZeRO-2.
    A rank with no rows to score of a collective kind makes the others' calls on one row."""
    dev, shape = _overhead_device(), tiny_shape("tiny-llama", 33)
    short, long = np.full(8, 5), np.full(8, 20)
    lay = Layout(batch=8, micro=4, mini=8, epochs=1, prompt_len=11, groups=2, gpus=2,
                 micro_tokens=8 * 16, score_tokens=8 * 16)
    micro_batches = {}
    for ranks in ((short,), (short, long)):
        costs = CostModel(dev, Shapes(shape, shape, shape, shape), lay)
        calls = []
        costs._train_model = lambda kind, micros: calls.append(len(micros)) or 0.0
        costs.train_phase(list(ranks), np.random.default_rng(0))
        micro_batches[len(ranks)] = calls
    assert micro_batches == {1: [1, 1], 2: [2, 2, 2, 2]}  # (actor, critic) a rank

    no_rescore = np.zeros(8, dtype=bool)
    for zero_stage, agreed in ((3, {"actor", "critic"}), (2, set())):
        costs = CostModel(dev, Shapes(shape, shape, shape, shape), lay, zero_stage=zero_stage)
        assert set(costs.collective_scorers()) == agreed
        made = []
        job = costs.prefill_job
        costs.prefill_job = lambda kind, tokens, ctx, calls=1, **kw: (
            made.append((kind, calls)) or job(kind, tokens, ctx, calls, **kw))
        sim = StepSimulator(costs, LengthDist(192, values=(5,)))
        score = sim._score([(short, no_rescore), (long, no_rescore)], Schedule("sequential"))
        kinds = ("actor", "reference", "critic", "reward")
        assert made[:4] == [(k, 2 if k in agreed else 1) for k in kinds]  # the short rank
        assert made[4:] == [(k, 2) for k in kinds]
        assert score == pytest.approx(4 * 2 * dev.prefill_call_s)  # the slower rank's
    one_row = costs.scored_forwards("actor", short[:1])
    assert costs.scored_forwards("actor", short[:0], calls=3, filler=5) == \
        pytest.approx(3 * one_row)
    assert costs.scored_forwards("actor", short[:0]) == 0.0


def test_ppo_ptx_blocks_count_in_the_actors_update_and_its_budget():
    """PPO-ptx in the simulation: each row brings a block (31 tokens here) into the actor's
    forward/backward, a second forward in the same call. Within 248 positions the 8 rows of
    31 tokens are two micro-batches with their blocks (4 x 62), not one, for the critic too
    (the update splits once); the actor's calls pay a second pass of per-layer costs, the
    critic's not. The planner sets the block from data.ptx_block_len; a run without PPO-ptx
    has none."""
    dev, B = _overhead_device(layer_s=0.01), 8
    shape = tiny_shape("tiny-llama", 33)
    layer = 2 * shape.layers * dev.layer_s
    train = {}
    for ptx in (0, 31):
        lay = Layout(batch=B, micro=4, mini=8, epochs=1, prompt_len=11, micro_tokens=8 * 31,
                     ptx_block=ptx)
        costs = CostModel(dev, Shapes(shape, shape, shape, shape), lay)
        res = StepSimulator(costs, LengthDist(192, values=(20,))).run(Schedule("sequential"),
                                                                      steps=2, warmup=0)
        train[ptx] = res.steps[0].phases["train"]
    per_call = dev.train_call_s + layer
    assert train[0] == pytest.approx(2 * (per_call + dev.optim_s))
    assert train[31] == pytest.approx(2 * (per_call + layer) + 2 * per_call + 2 * dev.optim_s)
    ptx = ["ppo.ptx_coef=0.5", "data.ptx=/data/pretrain.jsonl", "data.ptx_block_len=64"]
    assert layout(_cfg(*ptx), 1, 8).ptx_block == 64
    assert layout(_cfg(), 1, 8).ptx_block == 0


def _first_sequential_step(dev, B, micro, mini, **models):
    """The phases of one simulated sequential step of B rows of 20 tokens, tiny models;
    ``models``: CostModel's critic= / reference= switches."""
    shape = tiny_shape("tiny-llama", 33)
    lay = Layout(batch=B, micro=micro, mini=mini, epochs=1, prompt_len=11)
    costs = CostModel(dev, Shapes(shape, shape, shape, shape), lay, **models)
    res = StepSimulator(costs, LengthDist(192, values=(20,))).run(Schedule("sequential"), steps=2,
                                                                  warmup=0)
    return res.steps[0].phases


def test_a_critic_free_step_neither_scores_nor_trains_a_critic():
    dev, B, micro, mini = _overhead_device(), 8, 4, 8
    phases = _first_sequential_step(dev, B, micro, mini, critic=False)
    score = 3 * (B // micro) * dev.prefill_call_s  # actor, reference, reward
    train = (B // mini) * ((mini // micro) * dev.train_call_s + dev.optim_s)  # the actor only
    assert phases["score"] == pytest.approx(score)
    assert phases["train"] == pytest.approx(train)
    h100 = get_device("H100-80GB")
    rloo = _cfg("system.zero_stage=3", "ppo.advantage_estimator=rloo", "data.samples_per_prompt=4")
    ppo = plan_memory(_cfg("system.zero_stage=3"), resolve_shapes(rloo), 1, 8, h100).items
    free = plan_memory(rloo, resolve_shapes(rloo), 1, 8, h100).items
    assert ppo["critic_optimizer"] > 0
    assert free["critic_params"] == free["critic_grads"] == free["critic_optimizer"] == 0
    assert free["actor_params"] == ppo["actor_params"]
    mega = _megatron_cfg(8, 4)
    mega = dataclasses.replace(mega, ppo=dataclasses.replace(mega.ppo, advantage_estimator="reinforce"))
    assert plan(mega, 4, 8, h100, steps=2)["breakdown_gib"]["critic_optimizer"] == 0


def test_with_the_kl_off_nothing_holds_or_scores_a_reference():
    """ppo.kl_coef=0: the step scores with the actor, critic and reward model only (3 calls per
    micro-batch, not 4), and the reference's weights leave every GPU's memory, under ZeRO-3 with
    a partitioned reference's key unset and under Megatron; the plan lists no reference."""
    dev, B, micro, mini = _overhead_device(), 8, 4, 8
    phases = _first_sequential_step(dev, B, micro, mini, reference=False)
    assert phases["score"] == pytest.approx(3 * (B // micro) * dev.prefill_call_s)
    h100 = get_device("H100-80GB")
    with_kl = plan_memory(_cfg("system.zero_stage=3"), resolve_shapes(_cfg()), 1, 8, h100).items
    no_kl = plan_memory(_cfg("system.zero_stage=3", "ppo.kl_coef=0"), resolve_shapes(_cfg()), 1, 8,
                        h100).items
    assert with_kl["reference"] > 0 and no_kl["reference"] == 0
    assert no_kl["reward"] == with_kl["reward"] and no_kl["actor_kv"] == with_kl["actor_kv"]
    mega = _megatron_cfg(8, 4)
    assert plan(mega, 4, 8, h100, steps=2)["breakdown_gib"]["reference"] > 0
    mega = dataclasses.replace(mega, ppo=dataclasses.replace(mega.ppo, kl_coef=0.0))
    out = plan(mega, 4, 8, h100, steps=2)
    assert out["breakdown_gib"]["reference"] == 0 and "reference" not in out["models"]


def test_with_a_reward_function_nothing_holds_or_scores_a_reward_model():
    """model.reward_function: the step scores with the actor, critic and reference only, no
    GPU holds a reward model, nothing streams into one, and the plan lists none (the text
    names the function instead)."""
    dev, B, micro, mini = _overhead_device(), 8, 4, 8
    phases = _first_sequential_step(dev, B, micro, mini, reward=False)
    assert phases["score"] == pytest.approx(3 * (B // micro) * dev.prefill_call_s)
    h100 = get_device("H100-80GB")
    fn = "model.reward_function=oppo_ds.workload:gold_reward"
    model = plan_memory(_cfg("system.zero_stage=3"), resolve_shapes(_cfg()), 1, 8, h100).items
    rule = plan_memory(_cfg("system.zero_stage=3", fn), resolve_shapes(_cfg()), 1, 8, h100).items
    assert model["reward"] > 0 and rule["reward"] == 0
    streamed = ["oppo.streaming=true", "oppo.stream_to=[reference]"]
    kv = {name: plan_memory(_cfg(*streamed, *extra), resolve_shapes(_cfg()), 1, 8, h100).items["scorer_kv"]
          for name, extra in (("model", []), ("rule", [fn]))}
    assert 0 < kv["rule"] < kv["model"]  # the reference's cache alone
    out = plan(_cfg(fn), 1, 8, h100, steps=2)
    assert "reward" not in out["models"] and out["breakdown_gib"]["reward"] == 0
    assert "reward    none (model.reward_function" in plan_cli.format_plan(out, "x.yaml")


def test_the_group_pool_stops_and_takes_whole_prompts():
    """per_prompt 2 (a group baseline's pool): rows 5, 9 | 3, 4 | 7, 2 tokens long. Two
    prompts are needed: the second to end is done after 7 tokens (prompt 0 only after 9),
    where rows alone would stop after 5; the batch is prompts 1 and 2, prompt 0 waits with its
    finished row."""
    from oppo_ds.plan.simulate import _Group

    dev = _overhead_device()
    shape = tiny_shape("tiny-llama", 33)
    sims = {n: StepSimulator(CostModel(dev, Shapes(shape, shape, shape, shape),
                                       Layout(batch=4, micro=4, mini=4, epochs=1, prompt_len=11,
                                              per_prompt=n)), LengthDist(192, values=(1,)))
            for n in (1, 2)}
    g = _Group()
    g.top_up(6, LengthDist(192, values=(1,)), np.random.default_rng(0), 0, per_prompt=2)
    assert g.prompt.tolist() == [0, 0, 1, 1, 2, 2]
    g.total = np.array([5, 9, 3, 4, 7, 2])
    assert sims[1].stop_token(g, 4) == 5 and sims[2].stop_token(g, 4) == 7
    lengths, rescore = sims[2]._advance(g, 7, 4, Schedule("inter", delta=2))
    assert sorted(lengths.tolist()) == [2, 3, 4, 7] and not rescore.any()
    assert g.prompt.tolist() == [0, 0] and g.finished.tolist() == [True, False]
    assert g.done.tolist() == [5, 7] and g.defer.tolist() == [1, 1]
    # the next step tops up whole prompts: 6 rows wanted, 2 held, 2 prompts drawn
    g.top_up(5, LengthDist(192, values=(1,)), np.random.default_rng(0), 1, per_prompt=2)
    assert g.prompt.tolist() == [0, 0, 3, 3, 4, 4]


def test_the_planner_simulates_whole_prompts_for_a_group_baseline():
    cfg = load_config(None, ["ppo.advantage_estimator=group_norm", "data.samples_per_prompt=4"])
    assert layout(cfg, 1, 1).per_prompt == 4
    assert layout(load_config(None, ["ppo.advantage_estimator=reinforce",
                                     "data.samples_per_prompt=4"]), 1, 1).per_prompt == 1
    rows = plan(load_config(None, ["oppo.overcommit=8"]), 1, 1, CPU, steps=20)
    prompts = plan(load_config(None, ["oppo.overcommit=8", "ppo.advantage_estimator=rloo",
                                      "data.samples_per_prompt=4"]), 1, 1, CPU, steps=20)
    # the same long tail: a prompt is as slow as its longest response, the pool recovers less
    assert prompts["modes"]["inter"]["tail_waste_frac"] > rows["modes"]["inter"]["tail_waste_frac"]


def test_streaming_hides_scoring_up_to_the_tail():
    dev, L, chunk = _overhead_device(), 32, 8
    sim = _sim(dev, [L])
    seq = sim.run(Schedule("sequential"), steps=2, warmup=0).steps[0]
    streamed = ("reward", "reference", "critic")
    # own device, prefill (0.1 s a call) far shorter than a chunk's decode (8 s): only the last
    # chunk's three prefills are left after the last token
    stage = sim.run(Schedule("intra", streamed, "stage", chunk), steps=2, warmup=0).steps[0]
    assert stage.phases["generate"] == pytest.approx(seq.phases["generate"] + 3 * dev.prefill_call_s)
    assert stage.phases["score"] == pytest.approx(seq.phases["score"] / 4)  # only the actor's log-probs
    assert stage.scoring_tail_s == pytest.approx(3 * dev.prefill_call_s)
    # inline: every prefill (the prompts, then each of the 4 chunks) runs on the actor's lane
    inline = sim.run(Schedule("intra", streamed, "inline", chunk), steps=2, warmup=0).steps[0]
    assert inline.phases["generate"] == pytest.approx(seq.phases["generate"] + 3 * (1 + L // chunk) * dev.prefill_call_s)
    # the actor streaming its own log-probs: nothing is left to score after the rollout
    own = sim.run(Schedule("intra", streamed, "stage", chunk, actor_streams=True), steps=2,
                  warmup=0).steps[0]
    assert own.phases["score"] == 0.0
    assert own.phases["generate"] == pytest.approx(stage.phases["generate"])


def test_the_stage_critic_costs_its_weights_over_the_node_before_each_rollout():
    """The stage placement's critic copy takes the critic's weights before every rollout:
    its bytes over the node's links, after a Megatron replica (tp 2) gathered its half from
    the other rank into rank 0's host memory (the whole critic out over its host link, and
    back for the send); nothing when the critic does not stream on the stage."""
    dev, L, chunk, bw = _overhead_device(intra_node_bw=1e9, host_link_bw=4e9), 32, 8, 1e9
    shape = tiny_shape("tiny-llama", 33)
    lay = Layout(batch=8, micro=4, mini=8, epochs=1, prompt_len=11, gpus_per_node=2)
    size = 2 * shape.params(value_head=True)  # bf16
    split = CostModel(dev, Shapes(shape, shape, shape, shape), lay, model_split=(2, 1),
                      whole_scorers=frozenset({"reward", "critic"}))
    assert split.critic_to_stage_s() == pytest.approx(size / 2 / bw + 2 * size / 4e9 +
                                                      size / bw)
    whole = CostModel(dev, Shapes(shape, shape, shape, shape), lay)
    assert whole.critic_to_stage_s() == pytest.approx(size / bw)
    sim = StepSimulator(whole, LengthDist(192, values=(L,)))
    with_critic = sim.run(Schedule("intra", ("reward", "critic"), "stage", chunk), steps=1, warmup=0)
    without = sim.run(Schedule("intra", ("reward",), "stage", chunk), steps=1, warmup=0)
    # the critic's prefills cost nothing on the actor's lane under stage but its last chunk's
    # (the tail); the rest of the difference is the weights
    gap = with_critic.steps[0].phases["generate"] - without.steps[0].phases["generate"]
    assert gap == pytest.approx(size / bw + dev.prefill_call_s)


def test_schedules_stream_the_actor_as_configured():
    """`actor` in oppo.stream_to is no scorer: it prefills nothing, it drops the actor's
    forward after generation (Schedule.actor_streams)."""
    from oppo_ds.plan.planner import schedules

    cfg = _cfg("oppo.streaming=true", "oppo.chunk_size=16")
    (oppo,) = schedules(cfg, "oppo")
    assert oppo.streamed == ("reward", "reference", "critic") and oppo.actor_streams
    (seq,) = schedules(cfg, "sequential")
    assert seq.streamed == () and not seq.actor_streams
    (recompute,) = schedules(_cfg("oppo.streaming=true", "oppo.chunk_size=16",
                                  "oppo.stream_to=[reference,critic]"), "intra")
    assert not recompute.actor_streams
    # under the hybrid engine the trainer recomputes them (its inference kernels differ)
    (hybrid,) = schedules(_cfg("oppo.streaming=true", "oppo.chunk_size=16",
                               "system.hybrid_engine=true"), "oppo")
    assert not hybrid.actor_streams


def test_inter_with_delta_zero_is_sequential():
    sim = _sim(CPU, LengthDist(192, median=16, sigma=0.9), batch=16, micro=8, mini=8)
    seq = sim.run(Schedule("sequential"), steps=12, seed=3)
    inter = sim.run(Schedule("inter", delta=0), steps=12, seed=3)
    assert [s.step_s for s in seq.steps] == [s.step_s for s in inter.steps]
    over = sim.run(Schedule("inter", delta=8), steps=12, seed=3)
    assert over.mean("tail_waste") < seq.mean("tail_waste")
    assert over.mean("step_s") < seq.mean("step_s")


def test_calibration_fit_recovers_known_costs():
    """Phase timings made by the simulator itself on a known device (the built-in workload's
    shapes and batch, 40 steps of long-tailed lengths, 5 ms of other work a step) give that
    device back, each fitted parameter within 1e-6, and the fitted device reproduces the
    phases: the fit uses the simulator's own cost formulas, so nothing is approximated."""
    from oppo_ds.plan.planner import cost_model, layout, length_dist, schedules

    cfg = load_config(None)
    rng = np.random.default_rng(1)
    per_step = tuple(tuple(int(x) for x in np.clip(np.rint(np.exp(rng.normal(np.log(16), 0.9, 16))), 1, 192))
                     for _ in range(40))
    true = dataclasses.replace(CPU, decode_flops=4e9, prefill_flops=3e10, train_flops=2.5e10,
                               decode_call_s=0.002, prefill_call_s=0.0025, train_call_s=0.006,
                               rollout_setup_s=0.003, bw=1e18, layer_s=0.0, optim_s=0.0,
                               step_other_s=0.005)
    dist = dataclasses.replace(length_dist(cfg), per_step=per_step)
    lay = layout(cfg, 1, 1)
    sim = StepSimulator(cost_model(cfg, resolve_shapes(cfg), true, lay), dist)
    res = sim.run(schedules(cfg, "sequential")[0], steps=40, warmup=0, seed=0)
    steps = [{"response/lengths": list(lengths), "time/step_s": s.step_s,
              **{f"time/phase/{k}": s.phases[k] for k in ("generate", "score", "train")}}
             for lengths, s in zip(per_step, res.steps)]
    dev, fit = fit_cpu(cfg, steps)
    for name in ("decode_flops", "prefill_flops", "train_flops", "decode_call_s", "prefill_call_s",
                 "train_call_s", "rollout_setup_s", "step_other_s"):
        assert getattr(dev, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    for k in ("generate", "score", "train"):
        assert fit["fitted_s"][k] == pytest.approx(fit["measured_s"][k], rel=1e-6)
        assert fit["rms_residual_s"][k] < 1e-8


# make bench's results and its four runs' metrics on the 2-core CPU VM (2026-11-22, the run
# the cpu device's constants were fitted to), kept with the tests so the check runs anywhere
BENCH = os.path.join(REPO, "tests", "data", "bench-cpu-2core", "results.json")


def test_simulator_predicts_measured_speedups_within_20_percent():
    from oppo_ds.plan.calibrate import calibrate

    out = calibrate(BENCH)
    for mode in ("inter", "oppo"):
        m = out["modes"][mode]
        assert abs(m["speedup_error"]) < 0.2, (mode, m)
    assert out["machine"] == "2-core CPU"  # named from the benchmark's own record


def test_calibration_leaves_out_the_steps_the_benchmark_did(tmp_path):
    """The calibration timed from step 3 whatever the benchmark's --warmup: a run with
    --warmup 5 was compared over other steps than oppo-bench's own figures. It reads the
    warm-up from the benchmark's JSON now."""
    from oppo_ds.plan.calibrate import calibrate

    with open(BENCH) as f:
        results = json.load(f)
    results.pop("workdir", None)
    for mode in results["modes"].values():
        mode["warmup_steps"] = 5
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    os.symlink(os.path.splitext(BENCH)[0] + ".runs", tmp_path / "results.runs")
    out = calibrate(str(path))
    for mode in ("sequential", "oppo"):
        with open(tmp_path / "results.runs" / mode / "metrics.jsonl") as f:
            steps = [json.loads(line) for line in f if line.strip()]
        assert out["modes"][mode]["measured_step_s"] == pytest.approx(
            np.mean([r["time/step_s"] for r in steps[5:]]), abs=1e-5)


def test_calibration_reads_the_runs_beside_the_json_before_the_workdir_it_names(tmp_path):
    """A benchmark JSON names the workdir its runs were written to; copied elsewhere with its
    runs beside it, that workdir may by now hold another benchmark's runs (the GPU script's
    /tmp/gpu-work on the machine that ran it): the runs beside the JSON win."""
    from oppo_ds.plan.calibrate import calibrate

    with open(BENCH) as f:
        results = json.load(f)
    other = tmp_path / "elsewhere"
    (other / "sequential").mkdir(parents=True)
    with open(os.path.join(os.path.splitext(BENCH)[0] + ".runs", "sequential",
                           "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:  # another run: every phase twice as long
        row.update({k: 2 * v for k, v in row.items() if k.startswith("time/")})
    (other / "sequential" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
    results["workdir"] = str(other)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    os.symlink(os.path.splitext(BENCH)[0] + ".runs", tmp_path / "results.runs")
    moved, original = calibrate(str(path)), calibrate(BENCH)
    assert moved["fit"]["measured_s"] == original["fit"]["measured_s"]


# oppo-bench runs on one H200 (tools/gpu_session.sh, Qwen2.5-0.5B shapes, length oracle):
# the 29th session's two (docs/benchmarks.md, "The fourth GPU run") and the 31st session's
# three ("The fifth GPU run"; run4 and run5 have no sequential run), the 34th session's two
# ("The sixth GPU run"; run7 has no sequential run), with TRL's peer runs
H200 = os.path.join(REPO, "tests", "data", "bench-h200")


@pytest.mark.parametrize("run", ["run1", "run2", "run3", "run6"])
def test_calibration_on_the_h200_runs(run):
    """The fit reproduces the H200 sequential run's mean phases (host-bound: per-call costs,
    FLOP rates left unbounded) and predicts oppo's speedup with the default decode within
    the 3.4-23.9% the first three runs gave (docs/scaling.md); a check of the calibrator on real
    GPU timings, not of a speed goal."""
    from oppo_ds.plan.calibrate import calibrate

    out = calibrate(os.path.join(H200, f"{run}.json"))
    assert out["machine"] == "NVIDIA H200"
    for phase in ("generate", "score", "train"):
        assert out["fit"]["fitted_s"][phase] == pytest.approx(out["fit"]["measured_s"][phase],
                                                              rel=0.02), phase
    assert abs(out["modes"]["oppo"]["speedup_error"]) < 0.25


def test_calibration_names_the_machine_it_was_fitted_on():
    """A fit to a GPU run says so (it was labelled "cpu device" whatever had run)."""
    from oppo_ds.plan.calibrate import _machine

    assert _machine({"cuda_device": "NVIDIA H200", "cuda_device_count": 1, "cpu_count": 16}) \
        == "NVIDIA H200"
    assert _machine({"cuda_device": "NVIDIA H100 80GB HBM3", "cuda_device_count": 8}) \
        == "8 x NVIDIA H100 80GB HBM3"
    assert _machine({}) == "the benchmark's machine"


# ---------------------------------------------------------------- the planner and its CLI

@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_planner_runs_on_every_shipped_config(path):
    name = os.path.basename(path)
    assert name in SHIPPED, f"{name}: add it to SHIPPED and to docs/scaling.md"
    nodes, per_node, gpu, shapes = SHIPPED[name]
    out = plan(load_config(path), nodes, per_node, get_device(gpu), shape_overrides=shapes, steps=4)
    assert set(out["predicted_step_s"]) == {"sequential", "intra", "inter", "oppo"}
    assert out["predicted_speedup"]["sequential"] == 1.0
    assert all(v > 0 for v in out["predicted_step_s"].values())
    assert out["peak_mem_gib"] == max(out["phases_gib"].values())
    if name in ("llama3_70b.yaml", "megatron_70b.yaml"):
        assert out["models"]["actor"]["params"] > 70e9
    if name == "llama3_70b.yaml":
        # ZeRO-3's rollout gathers the actor whole on every GPU: 141 GB of bf16 weights (the
        # config's header says so, and points to megatron_70b.yaml)
        assert not out["fits"] and out["phases_gib"]["generate"] > 200, out["phases_gib"]
    elif name == "megatron_70b.yaml":
        assert out["fits"], out["phases_gib"]
        assert out["peak_mem_gib"] <= out["usable_gib"]


# ---------------------------------------------------------------- the Megatron backend

@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_megatron_shard_sizes_equal_the_converters_shards(arch, tp, pp):
    """What the planner counts per (tensor, pipeline) rank is what ``hf_to_megatron`` gives
    that rank, for causal LMs and value models, with a vocabulary tp does not divide."""
    from oppo_ds.megatron.convert import hf_to_megatron, shape_of
    from oppo_ds.models import build_causal_lm, build_value_model, tiny_config
    from oppo_ds.plan.megatron import shard_params

    vocab = 101
    shape = tiny_shape(arch, vocab)
    meg_shape = shape_of(tiny_config(arch, vocab))
    lm = build_causal_lm(arch, vocab_size=vocab, seed=0).state_dict()
    value = {k.removeprefix("body."): v
             for k, v in build_value_model(arch, vocab_size=vocab, seed=0).state_dict().items()}
    for state, prefix, heads in ((lm, "model.", dict(lm_head=True, value_head=False)),
                                 (value, "", dict(lm_head=False, value_head=True))):
        for p in range(pp):
            for t in range(tp):
                shard = hf_to_megatron(state.__getitem__, meg_shape, tp=tp, tp_rank=t, pp=pp,
                                       pp_rank=p, prefix=prefix, **heads)
                assert sum(v.numel() for v in shard.values()) == \
                    shard_params(shape, tp, pp, p, **heads), (heads, p, t)


def _megatron_cfg(tp=2, pp=1, **oppo) -> Config:
    cfg = load_config(os.path.join(REPO, "examples/configs/megatron_70b.yaml"))
    return dataclasses.replace(cfg, system=dataclasses.replace(cfg.system, tensor_parallel=tp,
                                                               pipeline_parallel=pp),
                               oppo=dataclasses.replace(cfg.oppo, **oppo))


def test_megatron_plan_splits_memory_and_time_over_the_model_ranks():
    h100 = get_device("H100-80GB")
    split = plan(_megatron_cfg(8, 4), 4, 8, h100, steps=3)
    # per GPU: a 32nd of the 70B actor's weights (the fullest stage a little more)
    assert 70.5e9 * 2 / 32 <= split["breakdown_gib"]["actor_params"] * GIB <= 70.6e9 * 2 / 28
    assert split["breakdown_gib"]["actor_optimizer"] == \
        pytest.approx(8 * split["breakdown_gib"]["actor_params"], rel=1e-3)  # bf16: 16 vs 2 bytes
    assert split["fits"] and split["simulation"]["decode_groups"] == 1
    # more tensor ranks per replica (same 32 GPUs, 2 replicas of tp 8 x pp 2): each GPU holds
    # twice the layers, and each replica decodes its rows faster than one of tp 8 x pp 4 does
    # not: the stages work in turn, so pipeline depth adds no speed, only hand-overs
    wide = plan(_megatron_cfg(8, 2), 4, 8, h100, steps=3)
    assert wide["breakdown_gib"]["actor_params"] > 1.9 * split["breakdown_gib"]["actor_params"]
    assert wide["simulation"]["decode_groups"] == 2
    assert wide["modes"]["sequential"]["phases_s"]["generate"] < \
        split["modes"]["sequential"]["phases_s"]["generate"]
    # the same replica count with tensor parallel halved: decoding takes longer
    narrow = plan(_megatron_cfg(4, 4), 2, 8, h100, steps=3)
    assert narrow["modes"]["sequential"]["phases_s"]["generate"] > \
        split["modes"]["sequential"]["phases_s"]["generate"]


def test_megatron_plan_with_recomputation_keeps_layer_inputs_only():
    h100 = get_device("H100-80GB")
    cfg = _megatron_cfg(8, 4)
    ckpt = dataclasses.replace(cfg, system=dataclasses.replace(cfg.system, gradient_checkpointing=True))
    full, less = (plan(c, 4, 8, h100, steps=2)["breakdown_gib"]["activations_train"] for c in (cfg, ckpt))
    a = resolve_shapes(cfg).actor
    tokens = cfg.ppo.micro_batch_size * (cfg.generation.max_prompt_len + cfg.generation.max_new_tokens)
    # 20 layers per stage: their inputs (hidden x 2 bytes a token) plus one layer whole
    inputs = 20 * a.hidden * 2 * tokens / GIB
    assert less < full / 2 and less > inputs  # the logits stay
    # the update's micro-batches by tokens: half the tokens, half the layers' activations;
    # its logits (16 bytes each) are of the responses' positions (and the one before each),
    # 8 x 193 of the micro-batch of rows, of any of a budget's positions (the breakdown is
    # rounded to MiB)
    logits = 16 * a.vocab / GIB
    rows_logits = logits * cfg.ppo.micro_batch_size * (cfg.generation.max_new_tokens + 1)
    half = dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo,
                                                            micro_batch_tokens=tokens // 2))
    assert plan(half, 4, 8, h100, steps=2)["breakdown_gib"]["activations_train"] == \
        pytest.approx((full - rows_logits) / 2 + logits * (tokens // 2), abs=1e-3)


def test_megatron_plan_names_a_wrong_split():
    h100 = get_device("H100-80GB")
    with pytest.raises(ValueError, match=r"system.tensor_parallel.*k x 32 GPUs, got 8"):
        plan(_megatron_cfg(8, 4), 1, 8, h100, steps=2)
    with pytest.raises(ValueError, match=r"system.pipeline_parallel.*3 does not divide the actor's 80 layers"):
        plan(_megatron_cfg(8, 3), 3, 8, h100, steps=2)
    gpt2 = dataclasses.replace(_megatron_cfg(1, 1), model=dataclasses.replace(
        _megatron_cfg().model, actor="tiny-gpt2", reward="tiny-gpt2"))
    with pytest.raises(ValueError, match="system.backend.*Llama-family"):
        plan(gpt2, 1, 1, h100, steps=2)


def test_megatron_plan_refuses_the_checkpoints_the_run_refuses(tmp_path):
    """The planner's shape maps every model type but gpt2 to Llama: a Mistral actor, or a
    Llama whose RoPE is scaled as the run does not compute (yarn), planned as a Llama under
    backend megatron, and the run then refused its conversion at start-up. With a config.json
    at hand the plan runs the run's own check and refuses as the run does (system.backend,
    the same words); what the run converts (a plain Llama, a Llama 3.1 with its RoPE scaling,
    rope_type llama3) plans as before."""
    import transformers

    from oppo_ds.megatron.loading import load_megatron_model
    from oppo_ds.models import tiny_config

    h100 = get_device("H100-80GB")
    rope = {"rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 64}
    yarn = tiny_config("tiny-llama", 101)
    yarn.rope_parameters = {"rope_type": "yarn", **rope}
    llama31 = tiny_config("tiny-llama", 101)
    llama31.rope_parameters = {"rope_type": "llama3", "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, **rope}
    mistral = transformers.MistralConfig(vocab_size=101, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, sliding_window=None)
    windowed = transformers.Qwen2Config(vocab_size=101, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, use_sliding_window=True,
                                        sliding_window=8, max_window_layers=0)

    def actor_cfg(name, config, split=(1, 1)):
        path = str(tmp_path / name)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        cfg = _megatron_cfg(*split)
        return path, dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, actor=path))

    for name, config, words in (("yarn", yarn, "rope_type 'yarn'"),
                                ("mistral", mistral, "model_type 'mistral'"),
                                ("windowed", windowed, "attend within a sliding window of 8")):
        path, cfg = actor_cfg(name, config)
        with pytest.raises(ConfigError, match=words) as planned:
            plan(cfg, 1, 1, h100, steps=2)
        assert planned.value.key == "system.backend"
        with pytest.raises(ValueError, match=words) as ran:  # the run's conversion
            load_megatron_model(path, None, "lm", dtype=torch.float32,
                                device=torch.device("cpu"))
        assert str(planned.value).endswith(str(ran.value)), (str(planned.value), str(ran.value))
    for name, config in (("llama", tiny_config("tiny-llama", 101)), ("llama31", llama31)):
        plan(actor_cfg(name, config, (1, 2))[1], 1, 2, h100, steps=2)


def test_megatron_stage_placement_plans_the_scorer_rank():
    """Under the stage placement the reward and the reference are whole HF copies on the last
    GPU: not on the actor ranks, and the scorer rank's own entry holds them."""
    h100 = get_device("H100-80GB")
    cfg = _megatron_cfg(8, 4, placement="stage", stream_to=["reference"])
    out = plan(cfg, 1, 33, h100, steps=3)
    parts = out["breakdown_gib"]
    assert parts["reward"] == parts["reference"] == 0.0
    whole = (70.55e9 + 7.5e9) * 2 / GIB  # reference and reward in bf16
    assert parts["scorer_rank_models"] == pytest.approx(whole, rel=0.01)
    assert out["phases_gib"]["scorer_rank"] > whole
    # one replica's caches, its rows as wide as the actor's under the pool (a deferred row's
    # partial response padded to the longest, every chunk on top), as the DeepSpeed plan has
    g, shapes = cfg.generation, resolve_shapes(cfg)
    assert cfg.oppo.overcommits
    width = g.max_prompt_len + (g.max_new_tokens - 1) + g.max_new_tokens
    per_token = sum(s.kv_bytes_per_token(2) for s in (shapes.reward, shapes.reference))
    assert parts["scorer_rank_kv"] == pytest.approx(
        cfg.widest_rollout * width * per_token / GIB, rel=1e-3)
    # a 70B reference does not fit one 80 GB GPU whole: the verdict says so
    assert out["peak_phase"] == "scorer_rank" and not out["fits"]
    assert set(out["modes"]) == {"sequential", "intra", "inter", "oppo"}
    with pytest.raises(ValueError, match="plus the stage placement's scorer rank, got 32"):
        plan(cfg, 4, 8, h100, steps=2)


def test_megatron_plan_holds_only_the_models_the_actor_ranks_build():
    """The Megatron plan counts on each GPU the models its engines build
    (``Config.actor_rank_models``, as the DeepSpeed plan and both engine builders go by): no
    reward-model shard beside model.reward_function (it counted one), and a model no actor
    rank builds is not held to the model split (a reward model tp 8 cannot split was refused
    though none is built). Under the stage placement with overcommitment the frozen scorers'
    caches of the deferred rows are the scorer rank's, not the actor GPUs' (they were counted
    on both)."""
    from oppo_ds.plan.megatron import plan_memory_megatron

    h100 = get_device("H100-80GB")
    cfg = _megatron_cfg(8, 4)
    rule = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, reward_function="oppo_ds.workload:gold_reward"))
    shapes = resolve_shapes(cfg)
    assert cfg.actor_rank_models() == {"actor", "critic", "reference", "reward"}
    assert rule.actor_rank_models() == {"actor", "critic", "reference"}
    assert cfg.actor_rank_models(evaluating=True) == {"actor", "reward"}  # oppo-train --evaluate
    held = plan_memory_megatron(cfg, shapes, 4, 8, h100).items
    free = plan_memory_megatron(rule, shapes, 4, 8, h100).items
    assert held["reward"] > 0 and free["reward"] == 0.0
    assert free["actor_params"] == held["actor_params"] and free["reference"] == held["reference"]
    odd = dataclasses.replace(shapes, reward=tiny_shape("tiny-llama", 33))  # 4 heads, tp 8
    with pytest.raises(ConfigError, match="tensor_parallel: 8 does not divide the reward's"):
        plan_memory_megatron(cfg, odd, 4, 8, h100)
    assert plan_memory_megatron(rule, odd, 4, 8, h100).items["reward"] == 0.0

    stage = _megatron_cfg(8, 4, placement="stage", stream_to=["reference"])
    inline = _megatron_cfg(8, 4, placement="inline", stream_to=["reference"])
    assert stage.oppo.overcommits and inline.oppo.overcommits
    assert stage.carried_scorer_kinds == []
    assert inline.carried_scorer_kinds == ["reward", "reference"]
    assert stage.streamed_frozen_scorers == inline.streamed_frozen_scorers == ["reward", "reference"]
    assert stage.scorer_rank_models() == ["reward", "reference"]
    assert stage.scorer_rank_models(evaluating=True) == ["reward"]
    assert stage.actor_rank_models() == {"actor", "critic"}
    on_stage = plan_memory_megatron(stage, shapes, 1, 33, h100).items
    assert on_stage["carried_scorer_kv"] == 0.0 and on_stage["scorer_rank_kv"] > 0
    assert plan_memory_megatron(inline, shapes, 1, 32, h100).items["carried_scorer_kv"] > 0


def test_deepspeed_stage_placement_plans_the_scorer_rank():
    """ZeRO-3 with the stage placement (8B, one node of 8): the actor ranks are 7 GPUs, over
    which ZeRO-3 partitions, and hold neither the reward nor the streamed reference; the
    scorer rank holds both whole and one set of KV caches per actor rank (it serves their
    rollouts at once); 7 decode groups are simulated, sharing the one scorer lane."""
    h100 = get_device("H100-80GB")
    path = os.path.join(REPO, "examples/configs/llama3_8b_zero3.yaml")
    cfg = load_config(path, ["oppo.streaming=true", "oppo.placement=stage",
                             "oppo.stream_to=[reference]"])
    colocated = load_config(path, ["oppo.streaming=true", "oppo.placement=colocated",
                                   "oppo.stream_to=[reference]"])
    out, ref = plan(cfg, 1, 8, h100, steps=3), plan(colocated, 1, 8, h100, steps=3)
    parts, ref_parts = out["breakdown_gib"], ref["breakdown_gib"]
    assert parts["reward"] == parts["reference"] == parts["scorer_kv"] == 0.0
    assert ref_parts["reward"] > 13 and ref_parts["scorer_kv"] > 0
    assert parts["actor_params"] == pytest.approx(ref_parts["actor_params"] * 8 / 7, rel=1e-3)
    assert parts["scorer_rank_models"] == pytest.approx((8.03e9 + 7.50e9) * 2 / GIB, rel=0.01)
    rows = 32 + 0  # batch_size 32, overcommit 0 in the config
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    assert parts["scorer_rank_kv"] == pytest.approx(7 * 2 * rows * 512 * kv_per_token / GIB,
                                                    rel=1e-3)  # 7 ranks, reward + reference
    assert out["phases_gib"]["scorer_rank"] == pytest.approx(
        parts["scorer_rank_models"] + parts["scorer_rank_kv"] + 2.0, rel=1e-3)
    assert out["simulation"]["decode_groups"] == 7
    # the shared scorer lane: streamed scoring on the scorer rank takes longer per rank than
    # on a side stream of each rank's own GPU
    assert out["modes"]["intra"]["phases_s"]["generate"] > ref["modes"]["intra"]["phases_s"]["generate"]
    with pytest.raises(ConfigError, match="oppo.placement.*at least 2, got 1"):
        plan(cfg, 1, 1, h100, steps=2)


def test_cli_writes_json_and_names_bad_input(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = plan_cli.main(["--config", os.path.join(REPO, "examples/configs/llama3_8b_zero3.yaml"),
                          "--nodes", "1", "--gpus-per-node", "8", "--gpu", "h100-80gb",
                          "--steps", "3", "--json", str(out)])
    data = json.loads(out.read_text())
    assert code == (0 if data["fits"] else 1)
    for key in ("fits", "peak_mem_gib", "predicted_step_s", "predicted_speedup", "breakdown_gib"):
        assert key in data
    printed = capsys.readouterr().out
    assert "per-GPU memory" in printed
    # a GPU's costs are not fitted: the plan says so, and where they were measured off
    assert data["simulation"]["costs"] == "assumed"
    assert "costs assumed" in printed and "--calibrate" in printed
    assert plan_cli.main(["--gpu", "cpu", "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert "costs assumed" not in printed
    assert plan_cli.main(["--gpu", "V100"]) == 2
    err = capsys.readouterr().err
    assert "--gpu" in err and "H100-80GB" in err and "cpu" in err
    assert plan_cli.main(["--gpu", "H100-80GB", "model.actor=/x/unknown-model"]) == 2
    assert "model.actor" in capsys.readouterr().err
    # a plan that cannot fit: a 70B actor in full on one 40 GB GPU
    assert plan_cli.main(["--gpu", "A100-40GB", "--steps", "2", "--shape", "actor=llama3-70b",
                          "model.actor=/x/a", "model.reward=llama3-8b"]) == 1


@pytest.mark.parametrize("argv, words", [
    (["--json", "{tmp}/nodir/plan.json"], "argument --json: cannot write {tmp}/nodir/plan.json: "
                                          "its folder {tmp}/nodir does not exist"),
    (["--json", "{tmp}"], "argument --json: {tmp} is a directory: name the file to write in it"),
    (["--seed", "-1"], "argument --seed: must be in [0, 2**32 - 1] (a 32-bit seed), got -1"),
])
def test_cli_bad_output_path_or_seed_stops_before_planning(tmp_path, capsys, argv, words):
    """--json to a missing folder or a directory raised FileNotFoundError / IsADirectoryError
    after the plan was computed; --seed -1 said "expected non-negative integer", no flag."""
    argv = [a.format(tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main(["--gpu", "cpu", "--steps", "2", *argv])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    last = captured.err.strip().splitlines()[-1]
    assert last == "oppo-plan: error: " + words.format(tmp=tmp_path)
    assert captured.out == ""  # no plan printed


def test_memory_fits_tracks_capacity():
    cfg = _cfg("system.zero_stage=3")
    shapes = resolve_shapes(cfg)
    big = plan_memory(cfg, shapes, 1, 8, get_device("H200"))
    small = dataclasses.replace(get_device("H200"), mem_gib=big.peak / GIB)
    assert big.fits and not plan_memory(cfg, shapes, 1, 8, small).fits


def test_the_rollout_s_passing_tensors_are_planned():
    """The generate phase holds, beside the caches, the largest of its passing tensors: the
    prefill's (one layer's no-grad activations over the widest context, and with deferred rows
    the logits of their partial responses: the forward keeps max_new_tokens positions of them,
    scored a block of rows at a time), or the decode's (a token's fp32 logits and, with the
    reference streaming, a chunk's logits twice: the forward's and the rows' copy)."""
    dev = get_device("H100-80GB")
    shapes = resolve_shapes(_cfg())
    a, block = shapes.actor, 12 * 32 * 2 ** 20
    new, prompt = 192, 32
    plain = plan_memory(_cfg(), shapes, 1, 8, dev)
    assert plain.items["prefill_logits"] == plain.items["stream_logits"] == 0
    assert plain.items["prefill_activations"] == \
        16 * prompt * (2 * a.hidden + 3 * a.intermediate) * 2
    over = plan_memory(_cfg("oppo.overcommit=8"), shapes, 1, 8, dev)
    rows = 16 + 8
    # 24 x 192 x 128k logits pass a block (32M): a block's rows at a time, in the model's
    # dtype and fp32 (12 bytes)
    assert rows * new * a.vocab > 32 * 2 ** 20
    assert over.items["prefill_logits"] == (2 + 12) * 32 * 2 ** 20
    assert over.items["prefill_activations"] == \
        rows * (prompt + new - 1) * (2 * a.hidden + 3 * a.intermediate) * 2
    streamed = plan_memory(_cfg("oppo.overcommit=8", "oppo.streaming=true",
                                "oppo.chunk_size=auto"), shapes, 1, 8, dev)
    chunk = rows * 64 * a.vocab  # auto: the largest candidate
    assert streamed.items["stream_logits"] == 2 * 2 * chunk + min(12 * chunk, block)
    items = streamed.items
    caches = items["actor_kv"] + items["scorer_kv"]
    passing = max(items["prefill_activations"] + items["prefill_logits"],
                  items["decode_logits"] + items["stream_logits"])
    assert passing == items["decode_logits"] + items["stream_logits"]  # the larger here
    resident = streamed.phases["train"] - items["activations_train"] - items["carried_scorer_kv"]
    assert streamed.phases["generate"] == pytest.approx(resident + caches + passing)
    # the reference on the scorer rank: nothing of it streams here
    staged = plan_memory(_cfg("oppo.streaming=true", "oppo.placement=stage"), shapes, 1, 8, dev)
    assert staged.items["stream_logits"] == 0


@pytest.mark.parametrize("stage,optimizer", [(0, 8), (1, 16), (2, 16), (3, 8)])
def test_fp32_training_under_zero_1_and_2_holds_an_fp32_master_copy(stage, optimizer):
    """DeepSpeed's ZeRO-1/2 optimizer clones an fp32 partition of the weights it updates even
    when they are fp32 (stage_1_and_2.py), beside its fp32 gradient partition and Adam's
    moments: 16 bytes a parameter as in mixed precision. At stage 3 the fp32 partition is
    used as it is, and at stage 0 torch's Adam updates the weights: its moments alone, 8."""
    states = model_states(1000, 1000, 10, zero_stage=stage, offload=False, gpus=1,
                          gpus_per_node=1, dtype="fp32")
    assert states.optimizer == optimizer * 1000
