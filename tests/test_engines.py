"""Tier 1: real DeepSpeed engines on tiny models, in this one pytest process (gloo on CPU).

torch.distributed is initialised once for the session (free port). The first
``deepspeed.initialize`` in a fresh environment JIT-compiles DeepSpeed's shm_comm op (~40 s)
and the offload test compiles DeepSpeedCPUAdam (~65 s); both are cached in
~/.cache/torch_extensions afterwards.
"""

import copy
import os

import deepspeed
import pytest
import torch
import transformers
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine

from oppo_ds.kv_cache import cache_kwargs, output_cache
from oppo_ds.engines import (
    HYBRID_KERNELS,
    CheckpointMismatch,
    HYBRID_NO_KERNELS_CPU,
    HYBRID_OFF,
    DeepSpeedTrainEngine,
    build_ds_config,
    init_distributed_if_needed,
    lr_multiplier,
    prepare_frozen,
)

VOCAB = 64
_RENDEZVOUS_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


@pytest.fixture(scope="session", autouse=True)
def distributed():
    """One single-process group for the whole session, on a free port."""
    before = {key: os.environ.get(key) for key in _RENDEZVOUS_KEYS}
    init_distributed_if_needed()
    assert torch.distributed.is_initialized()
    assert torch.distributed.get_world_size() == 1
    # the rendezvous variables it invented are gone again, so subprocesses started by
    # other tests do not inherit (and collide on) this port
    assert {key: os.environ.get(key) for key in _RENDEZVOUS_KEYS} == before
    yield
    init_distributed_if_needed()  # a second call is a no-op


# --- tiny models and data -------------------------------------------------------------

def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB,
                                         n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, bos_token_id=VOCAB - 1,
                                         eos_token_id=VOCAB - 1)
        return transformers.GPT2LMHeadModel(config)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=128)
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    raise ValueError(arch)


def fixed_batch(size: int = 4, length: int = 16, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, VOCAB, (size, length), generator=generator)}


def lm_loss(model, batch):
    out = model(input_ids=batch["input_ids"], labels=batch["input_ids"])
    return out.loss, {"loss": out.loss.detach()}


def split(batch: dict, parts: int) -> list[dict]:
    return [{k: v for k, v in zip(batch, values)}
            for values in zip(*(t.chunk(parts) for t in batch.values()))]


def make_engine(arch="gpt2", model=None, **overrides) -> DeepSpeedTrainEngine:
    kwargs = dict(lr=1e-2, total_steps=100, micro_batch_size=4, gradient_accumulation_steps=1,
                  zero_stage=0, offload=False, dtype="fp32", grad_clip=1.0, seed=0)
    kwargs.update(overrides)
    return DeepSpeedTrainEngine(model if model is not None else tiny_model(arch), **kwargs)


def full_params(engine) -> dict[str, torch.Tensor]:
    """Full fp32 copies of the weights, gathered under ZeRO-3 (no-op otherwise)."""
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {name: p.detach().float().clone() for name, p in params.items()}


def assert_params_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


def tensors_of(state, prefix="") -> dict[str, torch.Tensor]:
    """Every tensor in a nested optimizer state dict, keyed by its path."""
    found = {}
    if isinstance(state, torch.Tensor):
        found[prefix] = state.detach().clone()
    elif isinstance(state, dict):
        for key, value in state.items():
            found.update(tensors_of(value, f"{prefix}/{key}"))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            found.update(tensors_of(value, f"{prefix}/{i}"))
    return found


def greedy_decode(module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Prefill, then one token at a time through the model's KV cache."""
    out = module(input_ids=prompt, use_cache=True)
    tokens = [out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(new_tokens - 1):
        out = module(input_ids=tokens[-1], use_cache=True, **cache_kwargs(module, output_cache(out)))
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat([prompt, *tokens], dim=1)


# --- configs DeepSpeed accepts ----------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_deepspeed_parses_built_configs(stage, dtype):
    config = build_ds_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                             world_size=1, zero_stage=stage, offload=stage > 0, dtype=dtype,
                             grad_clip=1.0, hybrid_engine=True, tensorboard_dir=None)
    parsed = DeepSpeedConfig(config)
    assert parsed.zero_optimization_stage == stage
    assert parsed.train_batch_size == 4 and parsed.gradient_accumulation_steps == 2
    assert parsed.hybrid_engine.enabled and parsed.gradient_clipping == 1.0
    assert parsed.bfloat16_config.enabled == (dtype == "bf16")
    assert parsed.float16_config.enabled == (dtype == "fp16")
    if stage == 3:
        assert parsed.zero_config.param_persistence_threshold == 10_000
        assert parsed.zero_config.offload_param.device == "cpu"


# --- training ---------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_goes_down_each_zero_stage(stage):
    engine = make_engine(zero_stage=stage)
    assert engine.hybrid_engine_path == HYBRID_OFF
    assert engine.world_size == 1 and engine.rank == 0 and engine.device.type == "cpu"
    batch = fixed_batch()
    losses = [engine.train_step([batch], lm_loss)[0]["loss"].item() for _ in range(8)]
    assert losses[-1] < 0.7 * losses[0], losses
    assert engine.grad_norm() > 0


@pytest.mark.parametrize("stage", [0, 2])
def test_two_micro_batches_equal_one_mini_batch(stage):
    model = tiny_model("gpt2")
    twin = copy.deepcopy(model)
    # Adam's first update is lr * g / (|g| + eps): with a small eps that is lr * sign(g),
    # and gradients near 0 flip sign under a different summation order. eps = 1 makes the
    # update a smooth function of the gradient (about lr * g), so this compares gradients.
    optim = dict(lr=1.0, eps=1.0, grad_clip=None)
    accumulated = make_engine(model=model, zero_stage=stage, micro_batch_size=2,
                              gradient_accumulation_steps=2, **optim)
    whole = make_engine(model=twin, zero_stage=stage, micro_batch_size=4,
                        gradient_accumulation_steps=1, **optim)
    before = full_params(whole)
    batch = fixed_batch()
    stats = accumulated.train_step(split(batch, 2), lm_loss)
    assert len(stats) == 2
    whole.train_step([batch], lm_loss)
    after = full_params(whole)
    assert any(not torch.equal(before[n], after[n]) for n in after)  # an update happened
    assert max((after[n] - before[n]).abs().max().item() for n in after) > 1e-3
    assert_params_close(full_params(accumulated), after, atol=1e-5)
    assert accumulated.ds_engine.global_steps == whole.ds_engine.global_steps == 1


def test_grad_norm_is_reported_before_clipping_at_every_stage():
    # Stage 0 fp32 is measured by oppo_ds, the others by DeepSpeed's ZeRO optimizers.
    norms = []
    for stage in (0, 2):
        engine = make_engine(zero_stage=stage, grad_clip=0.5)
        engine.train_step([fixed_batch()], lm_loss)
        norms.append(engine.grad_norm())
    assert norms[0] > 0.5  # not the clipped value
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


@pytest.mark.parametrize("stage, dtype", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"),
                                          (1, "bf16")])
def test_any_number_of_micro_batches_is_one_update(stage, dtype):
    """Micro-batches sized by tokens (ppo.micro_batch_tokens) come in any number: three, then
    one, on an engine of 2 accumulation steps are one update each (DeepSpeed counts
    global_steps 1, then 2), whose gradient is the sum of the micro-batches' losses divided by
    2, whatever their number: the same parameters as an engine of one step given that sum in
    one micro-batch (1e-5 in fp32; in bf16, DeepSpeed's BF16 optimizer of ZeRO-1, within
    bf16's rounding of the weights, 1/128 of their size). ZeRO-1 to 3 reduce at the call's
    last micro-batch, not at DeepSpeed's own count. No micro-batch at all is refused."""
    model = tiny_model("gpt2")
    twin = copy.deepcopy(model)
    # eps 1: the update is about lr * g
    optim = dict(lr=1.0, eps=1.0, grad_clip=None, dtype=dtype)
    counted = make_engine(model=model, zero_stage=stage, micro_batch_size=2,
                          gradient_accumulation_steps=2, **optim)
    summed = make_engine(model=twin, zero_stage=stage, micro_batch_size=6,
                         gradient_accumulation_steps=1, **optim)
    if dtype == "bf16":
        assert type(counted.ds_engine.optimizer).__name__ == "BF16_Optimizer"
    atol = 1e-5 if dtype == "fp32" else None

    def half_of_the_sum(module, parts):
        return sum(lm_loss(module, part)[0] for part in parts) / 2, {}

    parts = split(fixed_batch(6), 3)
    before = full_params(summed)
    assert len(counted.train_step(parts, lm_loss)) == 3
    summed.train_step([parts], half_of_the_sum)
    assert counted.ds_engine.global_steps == summed.ds_engine.global_steps == 1
    after = full_params(summed)
    assert max((after[n] - before[n]).abs().max().item() for n in after) > 1e-3
    _close_within(full_params(counted), after, atol)
    counted.train_step(parts[:1], lm_loss)
    summed.train_step([parts[:1]], half_of_the_sum)
    assert counted.ds_engine.global_steps == summed.ds_engine.global_steps == 2
    _close_within(full_params(counted), full_params(summed), atol)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        counted.train_step([], lm_loss)
    assert counted.ds_engine.global_steps == 2


def _close_within(got: dict, want: dict, atol: float | None) -> None:
    """``assert_params_close`` at ``atol``; None: bf16's rounding, 1/128 of each weight's
    largest."""
    if atol is not None:
        assert_params_close(got, want, atol=atol)
        return
    for name, value in want.items():
        scale = value.float().abs().max().item()
        assert (got[name].float() - value.float()).abs().max().item() <= scale / 128 + 1e-6, name


@pytest.mark.parametrize("stage", [0, 3])
def test_a_forward_after_training_synchronizes_nothing(stage, monkeypatch):
    """DeepSpeed's throughput timer, on by default, synchronizes the device in a hook before
    every forward from the third optimizer step on (our engines get no dataloader): once a
    token in a decode, and a CUDA-graph capture fails on it. Our configs turn it off. The
    device synchronizations are counted on the real accelerator (a CPU one here, where they
    are no-ops but still called); with DeepSpeed's default timer the same forwards are seen
    to synchronize, so the count can see them."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    calls = []
    synchronize = accelerator.synchronize
    monkeypatch.setattr(accelerator, "synchronize",
                        lambda *a, **k: (calls.append(1), synchronize(*a, **k))[1])
    default_timer = {"timers": {"throughput": {"enabled": True}}}
    for overrides, want in ((None, 0), (default_timer, 3)):
        engine = make_engine(zero_stage=stage, ds_config_overrides=overrides)
        for _ in range(3):
            engine.train_step([fixed_batch()], lm_loss)
        assert engine.ds_engine.global_steps == 3
        calls.clear()
        with engine.generation_context() as model:
            for _ in range(3):
                model(**fixed_batch(2, 8))
        assert len(calls) == want, (overrides, len(calls))


def test_lr_follows_schedule_per_update():
    engine = make_engine(lr=1e-3, warmup_steps=2, total_steps=6, scheduler="linear")
    seen = []
    for _ in range(7):
        seen.append(engine.lr())
        engine.train_step([fixed_batch()], lm_loss)
    expected = [1e-3 * lr_multiplier(s, warmup_steps=2, total_steps=6, scheduler="linear")
                for s in range(7)]
    assert seen == pytest.approx(expected)


@pytest.mark.parametrize("stage, dtype", [(0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "fp32")],
                         ids=["zero0", "zero1-bf16-optimizer", "zero2", "zero3"])
def test_save_then_load_restores_weights_optimizer_and_lr(stage, dtype, tmp_path):
    """Exact for every optimizer DeepSpeed wraps ours in: (1, bf16) is its BF16 optimizer
    (gradients accumulated in fp32, flat buffers), which ``grad_accum_dtype`` auto picks."""
    schedule = dict(lr=1e-2, warmup_steps=3, total_steps=10, scheduler="cosine", zero_stage=stage,
                    dtype=dtype)
    batch = fixed_batch()
    original = make_engine(**schedule)
    for _ in range(2):
        original.train_step([batch], lm_loss)
    original.save(str(tmp_path), tag="step2", client_state={"data_cursor": 7})
    saved_params = full_params(original)
    saved_optim = tensors_of(original.ds_engine.optimizer.state_dict())
    saved_lr = original.lr()
    assert len(saved_optim) > 0
    # Keep going so that every saved quantity moves on.
    for _ in range(2):
        original.train_step([batch], lm_loss)
    uninterrupted = full_params(original)
    assert original.lr() != saved_lr

    resumed = make_engine(model=tiny_model("gpt2", seed=1), **schedule)  # other weights
    assert resumed.lr() != saved_lr
    client_state = resumed.load(str(tmp_path))  # tag None: the latest
    assert client_state["data_cursor"] == 7
    assert resumed.lr() == pytest.approx(saved_lr)
    assert_params_close(full_params(resumed), saved_params, atol=0)
    loaded_optim = tensors_of(resumed.ds_engine.optimizer.state_dict())
    assert loaded_optim.keys() == saved_optim.keys()
    for key in saved_optim:
        torch.testing.assert_close(loaded_optim[key], saved_optim[key], atol=0, rtol=0, msg=key)
    # Resumed run equals uninterrupted run (optimizer moments and schedule included).
    for _ in range(2):
        resumed.train_step([batch], lm_loss)
    assert_params_close(full_params(resumed), uninterrupted, atol=1e-6)
    assert resumed.lr() == pytest.approx(original.lr())


@pytest.mark.parametrize("stage", [0, 3])
def test_a_resume_takes_the_configured_learning_rate_and_weight_decay(stage, tmp_path):
    """The optimizer's and scheduler's saved state carry the peak learning rate and weight
    decay a checkpoint was written with (and Adam's betas and epsilon); they replaced the
    configured ones, so a run resumed with a lower learning rate (what the NaN stop advises)
    trained on with the old one. Now the configuration wins and the schedule goes on from the
    loaded update; the same settings change nothing (resumed_changes empty)."""
    schedule = dict(warmup_steps=1, total_steps=10, scheduler="linear", zero_stage=stage)
    batch = fixed_batch()
    original = make_engine(lr=1e-2, **schedule)
    for _ in range(3):
        original.train_step([batch], lm_loss)
    original.save(str(tmp_path), tag="step3")
    same = make_engine(lr=1e-2, **schedule)
    same.load(str(tmp_path))
    assert same.resumed_changes == {} and same.lr() == original.lr()

    lower = make_engine(lr=1e-4, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6, **schedule)
    lower.load(str(tmp_path))
    assert lower.resumed_changes == {"lr": (1e-2, 1e-4), "weight_decay": (0.0, 0.1),
                                     "betas": ((0.9, 0.95), (0.8, 0.99)), "eps": (1e-8, 1e-6)}
    factor = 1 - (3 - 1) / (10 - 1)  # linear decay after one warm-up update, at update 3
    assert lower.lr() == pytest.approx(1e-4 * factor)
    groups = lower.ds_engine.optimizer.param_groups
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.1]  # norms and biases: none
    assert all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6 for g in groups)
    lower.train_step([batch], lm_loss)
    assert lower.lr() == pytest.approx(1e-4 * (1 - (4 - 1) / (10 - 1)))


@pytest.mark.parametrize("stage, dtype", [(0, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16"),
                                          (3, "fp32")])
def test_a_weights_only_load_takes_the_weights_alone(stage, dtype, tmp_path):
    """``load(weights_only=True)``, what ``oppo-train --evaluate`` asks: the saved weights
    exactly (bf16: the module's own), the schedule as built. Under ZeRO-1/2 the optimizer's
    files are not read (removed here first; bf16 ZeRO-1 is DeepSpeed's BF16_Optimizer);
    under ZeRO-3 DeepSpeed's weights-only path would
    assemble the whole fp32 model on every rank from every rank's optimizer files, so the
    engine loads in full there (the saved schedule with it)."""
    schedule = dict(lr=1e-2, warmup_steps=3, total_steps=10, scheduler="cosine",
                    zero_stage=stage, dtype=dtype)
    original = make_engine(**schedule)
    for _ in range(2):
        original.train_step([fixed_batch()], lm_loss)
    original.save(str(tmp_path), tag="step2")
    saved, saved_lr = full_params(original), original.lr()
    optimizer_files = sorted((tmp_path / "step2").glob("*optim_states.pt"))
    assert bool(optimizer_files) == (stage > 0)  # ZeRO keeps them apart from the weights
    if stage in (1, 2):
        for path in optimizer_files:
            path.unlink()
    loaded = make_engine(model=tiny_model("gpt2", seed=1), **schedule)  # other weights
    built_lr = loaded.lr()
    assert built_lr != saved_lr
    loaded.load(str(tmp_path), "step2", weights_only=True)
    assert_params_close(full_params(loaded), saved, atol=0)
    assert loaded.lr() == (saved_lr if stage == 3 else built_lr)


def _logits(engine, batch: dict) -> torch.Tensor:
    with engine.generation_context() as module:
        return module(input_ids=batch["input_ids"]).logits.float()


@pytest.mark.parametrize("stage, dtype, hybrid, arch", [
    (0, "bf16", False, "llama"), (1, "bf16", True, "llama"), (2, "fp32", False, "llama"),
    (3, "fp32", False, "gpt2"), (3, "bf16", True, "llama")])
def test_an_engine_of_the_weights_alone_decodes_as_the_trained_one(stage, dtype, hybrid, arch,
                                                                  tmp_path):
    """``weights_only=True`` builds the actor of ``oppo-train --evaluate``: no optimizer and
    no schedule (ZeRO-1/2 as ZeRO-0: no fp32 master partition or Adam moments are
    allocated; ZeRO-3 partitioned as in training). From the trained engine's checkpoint
    (tag ``None``: the latest) it takes exactly the saved weights and gives the same logits;
    the optimizer files of ZeRO-1/2 are not read (removed first); under ZeRO-3 the rank's
    partitions come from its own optimizer file. It cannot train, save or give a learning
    rate; a tag that is not there raises ``FileNotFoundError``, another model's checkpoint
    ``CheckpointMismatch``. GPT-2 ties its output layer to its embeddings: one parameter, one
    partition. Forwards before the load leave ZeRO-3's persistent parameters gathered: the
    load releases them first. A bf16 engine of another stage (ZeRO-3 for the others, ZeRO-0
    for ZeRO-3) loads the same weights, rounded to bf16."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    trained = make_engine(arch, zero_stage=stage, dtype=dtype, hybrid_engine=hybrid)
    trained.train_step([fixed_batch()], lm_loss)
    trained.save(str(tmp_path), tag="step1")
    saved, logits = full_params(trained), _logits(trained, fixed_batch(seed=1))
    trained.close()
    if stage in (1, 2):
        for path in (tmp_path / "step1").glob("*optim_states.pt"):
            path.unlink()
    engine = make_engine(model=tiny_model(arch, seed=1), zero_stage=stage, dtype=dtype,
                         hybrid_engine=hybrid, weights_only=True)
    assert engine.config["zero_optimization"]["stage"] == (3 if stage == 3 else 0)
    assert engine.optimizer_name == "none (weights only)"
    if stage == 3:  # the object behind ZeRO-3's hooks, not an optimizer
        assert isinstance(engine.ds_engine.optimizer, DeepSpeedZeRoOffload)
    elif dtype == "bf16":  # DeepSpeed's bf16 wrapper around a dummy: no fp32 copies
        optimizer = engine.ds_engine.optimizer
        assert not optimizer.using_real_optimizer and optimizer.fp32_groups_flat_partition == []
    else:
        assert engine.ds_engine.optimizer is None
    assert engine.ds_engine.lr_scheduler is None
    assert engine.hybrid_engine_path == (HYBRID_NO_KERNELS_CPU if hybrid else HYBRID_OFF)
    for _ in range(3):  # forwards first: ZeRO-3 keeps small parameters gathered after them
        engine.forward_no_grad(lambda model: model(input_ids=fixed_batch()["input_ids"]))
    assert engine.load(str(tmp_path)) == {}
    assert_params_close(full_params(engine), saved, atol=0)
    assert torch.equal(_logits(engine, fixed_batch(seed=1)), logits)
    for refused in (lambda: engine.train_step([fixed_batch()], lm_loss), engine.lr,
                    lambda: engine.save(str(tmp_path), tag="step2")):
        with pytest.raises(RuntimeError, match="built with weights_only=True .*no optimizer"):
            refused()
    assert not (tmp_path / "step2").exists()
    with pytest.raises(FileNotFoundError, match="tag='step9'"):
        engine.load(str(tmp_path), "step9")
    engine.close()
    # an evaluation under another stage and in bf16 reads the same files, cast
    elsewhere = make_engine(model=tiny_model(arch, seed=1), zero_stage=0 if stage == 3 else 3,
                            dtype="bf16", weights_only=True)
    elsewhere.load(str(tmp_path), "step1")
    assert_params_close(full_params(elsewhere),
                        {n: w.bfloat16().float() for n, w in saved.items()}, atol=0)
    elsewhere.close()
    other = make_engine("qwen2" if arch == "llama" else "llama", zero_stage=stage, dtype=dtype,
                        weights_only=True)
    with pytest.raises(CheckpointMismatch, match="holds the weights of another model: "):
        other.load(str(tmp_path), "step1")
    other.close()


def _odd_llama(seed: int) -> torch.nn.Module:
    """A tiny Llama with a trained 1-element parameter besides (unused by the forward): over
    three ranks two of its partitions are padding alone."""
    model = tiny_model("llama", seed=seed)
    model.odd = torch.nn.Parameter(torch.full((1,), 0.5 + seed))
    return model


def _zero3_weights_alone_rank(rank, world, out, root, dtype):
    model = _odd_llama(0)
    model.model.embed_tokens.weight.requires_grad_(False)  # its partitions: in the model file
    # every parameter partitioned, in many sub-groups (a flat fp32 tensor each in the file)
    trained = make_engine(model=model, zero_stage=3, dtype=dtype, ds_config_overrides={
        "zero_optimization": {"stage3_param_persistence_threshold": 0,
                              "sub_group_size": 5000}})
    trained.train_step([fixed_batch(seed=rank)], lm_loss)
    trained.save(root, tag="step1")
    saved, logits = full_params(trained), _logits(trained, fixed_batch(seed=2))
    if rank == 0:  # for the other layouts' loads (the next test)
        torch.save({"weights": saved, "logits": logits}, os.path.join(root, "saved.pt"))
    groups = len(torch.load(os.path.join(root, "step1", [
        f for f in os.listdir(os.path.join(root, "step1"))
        if f.endswith(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")][0]),
        weights_only=False)["optimizer_state_dict"]["fp32_flat_groups"])
    trained.close()
    engine = make_engine(model=_odd_llama(1), zero_stage=3, dtype=dtype, weights_only=True)
    sizes = sorted({p.ds_tensor.numel() * world - p.ds_numel
                    for p in engine.module.parameters()})  # each partition's padding
    engine.load(root, "step1")
    got = full_params(engine)
    out.put(("ok", rank, all(torch.equal(got[n], saved[n]) for n in saved),
             torch.equal(_logits(engine, fixed_batch(seed=2)), logits), groups, sizes))
    engine.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_zero3_engine_of_the_weights_alone_reads_each_ranks_own_partitions(dtype, tmp_path):
    """Three gloo ranks, ZeRO-3: each rank of a ``weights_only`` engine fills its partitions
    from its own files (DeepSpeed's weights-only load would assemble the whole fp32 model on
    every rank) and the gathered weights and logits equal the trained engine's exactly: with
    a frozen parameter (kept in the model file), partitions padded to the ranks (a 1-element
    parameter's on two of the three ranks padding alone), the trained
    engine's fp32 master split in many sub-groups, and another persistence threshold than
    the trained engine's (it decides when a parameter is gathered, not how it is split). Two
    ranks then load it under ZeRO-3 (partitions cut anew from the three ranks' files) and
    under ZeRO-0 (whole parameters), to the same weights and logits."""
    from _builders import spawn_gloo

    # three: a tiny model's sizes are even, so two ranks would pad no partition
    found = sorted(m for m in spawn_gloo(_zero3_weights_alone_rank, 3, str(tmp_path), dtype,
                                         join_s=240, group_timeout_s=60) if m[0] == "ok")
    assert [m[1] for m in found] == [0, 1, 2]
    for _, rank, same_weights, same_logits, groups, paddings in found:
        assert same_weights and same_logits, rank
        assert groups > 2 and paddings[-1] > 0  # the layouts the test is meant to cover
    # an evaluation on another number of ranks or another stage reads the same checkpoint
    found = sorted(m for m in spawn_gloo(_elsewhere_rank, 2, str(tmp_path), dtype, join_s=240,
                                         group_timeout_s=60) if m[0] == "ok")
    assert [m[1:] for m in found] == [(0, [(3, True, True), (0, True, True)]),
                                      (1, [(3, True, True), (0, True, True)])]


def _elsewhere_rank(rank, world, out, root, dtype):
    saved = torch.load(os.path.join(root, "saved.pt"))
    found = []
    for stage in (3, 0):
        engine = make_engine(model=_odd_llama(1), zero_stage=stage, dtype=dtype,
                             weights_only=True)
        engine.load(root, "step1")
        got = full_params(engine)
        found.append((stage, all(torch.equal(got[n], w) for n, w in saved["weights"].items()),
                      torch.equal(_logits(engine, fixed_batch(seed=2)), saved["logits"])))
        engine.close()
    out.put(("ok", rank, found))


def test_load_missing_checkpoint_raises(tmp_path):
    engine = make_engine()
    with pytest.raises(FileNotFoundError):
        engine.load(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("hybrid", [False, True])
def test_forward_no_grad_and_generation_under_zero3(hybrid):
    # Persistence threshold 0: every tiny parameter is really partitioned.
    engine = make_engine("qwen2", zero_stage=3, hybrid_engine=hybrid,
                         ds_config_overrides={"zero_optimization": {
                             "stage3_param_persistence_threshold": 0}})
    assert all(p.numel() == 0 for p in engine.module.parameters())  # partitioned
    batch = fixed_batch()
    engine.train_step([batch], lm_loss)

    logits = engine.forward_no_grad(lambda model: model(input_ids=batch["input_ids"]).logits)
    assert not logits.requires_grad and logits.shape == (4, 16, VOCAB)
    assert engine.module.training  # restored

    with engine.generation_context() as module:
        assert not module.training and not torch.is_grad_enabled()
        assert all(p.numel() > 0 for p in module.parameters())  # gathered once
        sequence = greedy_decode(module, batch["input_ids"][:, :5], new_tokens=4)
        full_logits = module(input_ids=sequence).logits
    assert torch.equal(full_logits[:, 4:-1].argmax(-1), sequence[:, 5:])
    # Same weights inside the context as in the training forward (shared 5-token prefix).
    torch.testing.assert_close(full_logits[:, :5], logits[:, :5], atol=1e-5, rtol=1e-5)
    assert engine.module.training and torch.is_grad_enabled()
    assert all(p.numel() == 0 for p in engine.module.parameters())  # released again
    engine.train_step([batch], lm_loss)  # training still works after decoding


def _uneven_decode_rank(rank, world, out, hybrid):
    # persistence threshold and reuse distance 0: as for a big model, ZeRO-3's hooks would
    # release every layer after its forward and all-gather it again on the next
    engine = make_engine("qwen2", zero_stage=3, hybrid_engine=hybrid, ds_config_overrides={
        "zero_optimization": {"stage3_param_persistence_threshold": 0,
                              "stage3_max_reuse_distance": 0}})
    batch = fixed_batch()
    with engine.generation_context() as module:
        for _ in range(1 + 4 * rank):  # rank 1 decodes five times as many steps
            logits = module(input_ids=batch["input_ids"][:, :6]).logits
    loss = engine.train_step([batch], lm_loss)[0]["loss"]  # the hooks are back for training
    out.put(("ok", rank, float(logits.sum()), float(loss)))


@pytest.mark.parametrize("hybrid", [False, True])
def test_generation_context_under_zero3_lets_ranks_decode_different_numbers_of_steps(hybrid):
    """oppo-train's pool stops decoding on a rank whose rows all ended while the others go
    on: inside ``generation_context`` a ZeRO-3 module's forwards must not be collective. Two
    gloo ranks make 1 and 5 forwards, then train together; the first forward's logits agree
    (same weights on both ranks) and both losses are finite."""
    from _builders import spawn_gloo

    messages = spawn_gloo(_uneven_decode_rank, 2, hybrid, join_s=240, group_timeout_s=60)
    ok = sorted(m for m in messages if m[0] == "ok")
    assert [m[1] for m in ok] == [0, 1]
    assert ok[0][2] == pytest.approx(ok[1][2], rel=1e-5)
    assert all(torch.isfinite(torch.tensor(m[3])) for m in ok)


# --- hybrid engine on CPU ---------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_hybrid_engine_cpu_trains_and_decodes_without_kernels(arch):
    engine = make_engine(arch, hybrid_engine=True)
    assert isinstance(engine.ds_engine, DeepSpeedHybridEngine)
    assert engine.hybrid_engine_path == HYBRID_NO_KERNELS_CPU
    assert engine.ds_engine._inference_containers == []
    batch = fixed_batch()
    before = full_params(engine)
    loss = engine.train_step([batch], lm_loss)[0]["loss"]
    assert torch.isfinite(loss)
    assert any(not torch.equal(before[n], p) for n, p in full_params(engine).items())

    with engine.generation_context() as module:
        assert module is engine.module and not module.training
        sequence = greedy_decode(module, batch["input_ids"][:, :6], new_tokens=5)
    assert engine.module.training
    # The cached step-by-step decode picks the argmax of the same model's full forward.
    with torch.no_grad():
        reference = engine.module.eval()(input_ids=sequence).logits.argmax(-1)
    engine.module.train()
    assert torch.equal(reference[:, 5:-1], sequence[:, 6:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSpeed's inference kernels need a GPU")
def test_hybrid_engine_kernels_on_gpu(tmp_path):
    """The kernels decode what the model's own forward picks; an engine of the weights alone
    (the evaluation's actor) gets the kernels too and decodes the same from the checkpoint."""
    engine = make_engine("gpt2", hybrid_engine=True)
    assert engine.hybrid_engine_path == HYBRID_KERNELS
    batch = {k: v.to(engine.device) for k, v in fixed_batch().items()}
    engine.train_step([batch], lm_loss)
    with engine.generation_context() as module:
        sequence = greedy_decode(module, batch["input_ids"][:, :6], new_tokens=5)
    with torch.no_grad():
        reference = engine.module.eval()(input_ids=sequence).logits.argmax(-1)
    engine.module.train()
    assert torch.equal(reference[:, 5:-1], sequence[:, 6:])
    engine.save(str(tmp_path), tag="step1")
    alone = make_engine(model=tiny_model("gpt2", seed=1), hybrid_engine=True, weights_only=True)
    assert alone.hybrid_engine_path == HYBRID_KERNELS
    alone.load(str(tmp_path), "step1")
    with alone.generation_context() as module:
        assert torch.equal(greedy_decode(module, batch["input_ids"][:, :6], new_tokens=5),
                           sequence)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="DeepSpeed's inference kernels need a GPU")
def test_a_lora_actor_decodes_with_its_own_forward_on_gpu():
    """With LoRA the hybrid engine injects no kernels (they would decode with the base
    weights): the decode picks what the LoRA model's own forward picks."""
    from oppo_ds.engines import HYBRID_NO_KERNELS_LORA
    from oppo_ds.lora import add_lora

    model = tiny_model("llama")
    add_lora(model, 4, "layers.", seed=1)
    for layer in model.modules():
        if hasattr(layer, "lora_left_weight"):
            torch.nn.init.normal_(layer.lora_left_weight, std=0.5)
    engine = make_engine(model=model, hybrid_engine=True)
    assert engine.hybrid_engine_path == HYBRID_NO_KERNELS_LORA
    assert engine.ds_engine._inference_containers == []
    prompt = fixed_batch()["input_ids"][:, :6].to(engine.device)
    with engine.generation_context() as module:
        sequence = greedy_decode(module, prompt, new_tokens=5)
    with torch.no_grad():
        reference = engine.module.eval()(input_ids=sequence).logits.argmax(-1)
    assert torch.equal(reference[:, 5:-1], sequence[:, 6:])


def test_no_kernel_patch_does_not_leak_into_other_engines():
    make_engine("gpt2", hybrid_engine=True)
    # DeepSpeed's own class and name are untouched: a hybrid engine built directly by
    # deepspeed.initialize still injects GPT-2's kernels, which fail on CPU as usual.
    assert deepspeed.DeepSpeedHybridEngine is DeepSpeedHybridEngine
    assert "populate_all_inference_policies" in DeepSpeedHybridEngine.__dict__
    model = tiny_model("gpt2")
    config = build_ds_config(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1,
                             world_size=1, zero_stage=0, offload=False, dtype="fp32",
                             grad_clip=None, hybrid_engine=True)
    with pytest.raises(ValueError, match="not been implemented on CPU"):
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                             config=config)


def test_inject_kernels_true_on_cpu_is_refused():
    with pytest.raises(ValueError, match="inject_kernels=True needs a GPU"):
        make_engine(hybrid_engine=True, inject_kernels=True)


# --- precision and offload ----------------------------------------------------------------

@pytest.mark.parametrize("stage, grad_accum_dtype, wrapper, accumulate", [
    (0, "auto", "FP16_UnfusedOptimizer", "bf16"),
    (1, "auto", "BF16_Optimizer", "fp32"),
    (1, "bf16", "DeepSpeedZeroOptimizer", "bf16"),
    (2, "auto", "DeepSpeedZeroOptimizer", "bf16"),
])
def test_bf16_one_step(stage, grad_accum_dtype, wrapper, accumulate):
    """A bf16 update under each stage, and the optimizer DeepSpeed wraps AdamW in: under
    ZeRO-1 ``grad_accum_dtype`` auto accumulates in fp32, which gets DeepSpeed's flat BF16
    optimizer (a few ops an update, not several per parameter); bf16 keeps its ZeRO one."""
    engine = make_engine(dtype="bf16", zero_stage=stage, grad_accum_dtype=grad_accum_dtype)
    assert (engine.optimizer_name, engine.optimizer_wrapper) == ("AdamW", wrapper)
    assert engine.grad_accum_dtype == accumulate
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    before = full_params(engine)
    loss = engine.train_step([fixed_batch()], lm_loss)[0]["loss"]
    assert torch.isfinite(loss)
    assert engine.grad_norm() is not None and engine.grad_norm() > 0
    assert any(not torch.equal(before[n], p) for n, p in full_params(engine).items())


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    """DeepSpeed's fp16 optimizers on the CPU: its sanity check refuses fp16 there (oppo-train
    does too, ``test_fp16_on_a_cpu_is_one_line_exit_2``), though their arithmetic runs; the
    GPU's path is the same code."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)


def _one_update(engine, loss_fn=lm_loss) -> dict[str, torch.Tensor]:
    before = full_params(engine)
    engine.train_step([fixed_batch()], loss_fn)
    return {n: p - before[n] for n, p in full_params(engine).items()}


@pytest.mark.parametrize("grad_clip", [None, 0.5])
def test_an_fp16_update_under_zero0_is_the_fp32_update(grad_clip, fp16_on_cpu):
    """fp16 under ZeRO-0 (DeepSpeed-Chat's defaults): DeepSpeed's FP16_UnfusedOptimizer divides
    the gradients by its loss scale (2**16), so the loss must carry it; DeepSpeed 0.19's
    engine.backward does not multiply it in, oppo-ds does. The update is then fp32's (and
    ZeRO-1's fp16 one) within fp16's rounding of the updated weights, 1e-3 (their spacing is
    2**-10 next to 1, the norms' scales), where without the scale it was 1e-6 against fp32's
    0.2. Adam with eps 1 and betas 0 updates by lr * g / (|g| + 1) at any step count: a
    smooth function of the gradient, and blind to the step of zero gradients the unfused
    optimizer takes when it is built (``initialize_optimizer_states``), which shifts Adam's
    bias correction by a step. With grad_clip 0.5 (the norm is about 2.4) the clipped update
    is fp32's too, and the norm logged is the unscaled one."""
    model = tiny_model("gpt2")
    optim = dict(lr=1.0, eps=1.0, betas=(0.0, 0.0), grad_clip=grad_clip)
    engines = {(stage, dtype): make_engine(model=copy.deepcopy(model), zero_stage=stage,
                                           dtype=dtype, **optim)
               for stage, dtype in ((0, "fp32"), (0, "fp16"), (1, "fp16"))}
    assert engines[0, "fp16"].optimizer_wrapper == "FP16_UnfusedOptimizer"
    assert engines[0, "fp16"].ds_engine.optimizer.loss_scale == 2**16
    updates = {key: _one_update(engine) for key, engine in engines.items()}
    want = updates[0, "fp32"]
    assert max(d.abs().max().item() for d in want.values()) > 0.04
    for key in ((0, "fp16"), (1, "fp16")):
        assert_params_close(updates[key], want, atol=1e-3)
        assert engines[key].grad_norm() == pytest.approx(engines[0, "fp32"].grad_norm(),
                                                         rel=1e-2)
    assert engines[0, "fp32"].grad_norm() > 1.0


def test_an_fp16_overflow_under_zero0_skips_the_update_and_halves_the_scale(fp16_on_cpu):
    """Gradients beyond fp16's range (the loss times 1e6, times the scale): DeepSpeed skips
    the update, halves the loss scale and counts a skipped step; the norm logged is inf
    (``finite.check_update`` lets that pass in fp16). The next finite step updates."""
    engine = make_engine(dtype="fp16", zero_stage=0)
    optimizer = engine.ds_engine.optimizer

    def huge(module, batch):
        loss, stats = lm_loss(module, batch)
        return loss * 1e6, stats

    update = _one_update(engine, huge)
    assert all(torch.equal(d, torch.zeros_like(d)) for d in update.values())
    assert optimizer.loss_scale == 2**15 and engine.ds_engine.skipped_steps == 1
    assert engine.grad_norm() == float("inf")
    update = _one_update(engine)
    assert max(d.abs().max().item() for d in update.values()) > 1e-3
    assert engine.ds_engine.skipped_steps == 1
    assert 0 < engine.grad_norm() < float("inf")


def test_the_fp16_optimizers_own_backward_does_not_scale_a_second_time(fp16_on_cpu):
    """A DeepSpeed whose engine.backward calls the fp16 optimizer's backward (before
    deepspeedai/DeepSpeed#7665): inside ``_optimizer_backward_unscaled`` that backward leaves
    the loss (already scaled by oppo-ds) as it is; the class's own, which multiplies by the
    scale, is back after."""
    from oppo_ds.engines.deepspeed_engine import _optimizer_backward_unscaled

    engine = make_engine(dtype="fp16", zero_stage=0)
    optimizer = engine.ds_engine.optimizer
    weight = torch.ones(3, requires_grad=True)
    with _optimizer_backward_unscaled(optimizer):
        optimizer.backward(weight.sum())
    assert torch.equal(weight.grad, torch.ones(3))
    weight.grad = None
    optimizer.backward(weight.sum())
    assert torch.equal(weight.grad, torch.full((3,), 2.0**16))


def test_fp32_gradients_of_a_bf16_model_under_zero2_and_3_and_refused_under_zero0():
    """fp32 gradients for a bf16 model: DeepSpeed raises NotImplementedError under ZeRO-0,
    refused before it with what is allowed; under ZeRO-2 and 3 their optimizers accumulate in
    fp32 partitions (no flat BF16 optimizer, so ``auto`` does not pick it there)."""
    with pytest.raises(ValueError, match=r"^grad_accum_dtype fp32 with dtype bf16 and "
                                         r"zero_stage 0: .*allowed here: auto, bf16$"):
        make_engine(dtype="bf16", zero_stage=0, grad_accum_dtype="fp32")
    for stage, wrapper in ((2, "DeepSpeedZeroOptimizer"), (3, "DeepSpeedZeroOptimizer_Stage3")):
        engine = make_engine(dtype="bf16", zero_stage=stage, grad_accum_dtype="fp32")
        assert engine.optimizer_wrapper == wrapper
        assert engine.ds_engine.optimizer.gradient_accumulation_dtype == torch.float32
        batch = fixed_batch()
        losses = [engine.train_step([batch], lm_loss)[0]["loss"].item() for _ in range(4)]
        assert losses[-1] < losses[0], (stage, losses)


def test_offload_with_deepspeed_cpu_adam():
    engine = make_engine(zero_stage=2, offload=True)  # cpu_adam=None -> DeepSpeedCPUAdam
    assert engine.optimizer_name == "DeepSpeedCPUAdam"
    batch = fixed_batch()
    losses = [engine.train_step([batch], lm_loss)[0]["loss"].item() for _ in range(6)]
    assert losses[-1] < 0.8 * losses[0], losses


def test_offload_params_zero3_with_torch_adamw():
    engine = make_engine(zero_stage=3, offload=True, cpu_adam=False)
    assert engine.optimizer_name == "AdamW"
    assert engine.config["zero_force_ds_cpu_optimizer"] is False
    batch = fixed_batch()
    losses = [engine.train_step([batch], lm_loss)[0]["loss"].item() for _ in range(6)]
    assert losses[-1] < 0.8 * losses[0], losses


# --- closing ---------------------------------------------------------------------------------

def _private_virtual_mb() -> int:
    """The process's private data (VmData): what a fork must be able to account for."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmData"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_close_gives_back_what_deepspeed_keeps_after_the_last_reference():
    """DeepSpeed keeps an engine alive after the last reference to it is gone; close()
    destroys it. Measured in the process's private virtual memory: a ZeRO-3 engine takes its
    reduce bucket (5e8 elements: 1.9 GB, mostly never touched) and still holds it after ``del``
    and ``gc.collect()``; after close() at most 10% of what it took (and 64 MB) is left."""
    import gc

    from oppo_ds.engines import close_engines, open_engines

    model = tiny_model("gpt2")
    before = _private_virtual_mb()
    engine = make_engine(model=model, zero_stage=3)
    engine.train_step([fixed_batch()], lm_loss)
    ds_engine = engine.ds_engine
    built = _private_virtual_mb()
    assert built - before > 256, (before, built)  # the measurement has something to measure
    assert ds_engine in open_engines()
    engine.close()
    engine.close()  # idempotent
    assert ds_engine not in open_engines()
    assert close_engines([ds_engine]) == 0
    del engine, ds_engine, model
    gc.collect()
    after = _private_virtual_mb()
    assert after - before <= 0.1 * (built - before) + 64, (before, built, after)


def test_close_engines_closes_every_open_one_and_release_frozen_a_partitioned_model():
    from oppo_ds.engines import close_engines, open_engines, prepare_partitioned, release_frozen

    engines = [make_engine(zero_stage=stage).ds_engine for stage in (0, 3)]
    scorer = prepare_partitioned(tiny_model("gpt2"), "fp32")
    partitioned = scorer._oppo_zero3_engine
    assert {*engines, partitioned} <= set(open_engines())
    release_frozen(scorer)
    release_frozen(scorer)  # idempotent, and a no-op for a model we did not partition
    release_frozen(tiny_model("gpt2"))
    release_frozen(None)
    assert partitioned not in open_engines()
    assert close_engines() >= 2
    assert open_engines() == []


def test_prepare_frozen():
    model = prepare_frozen(tiny_model("gpt2"), "bf16")
    assert not model.training
    assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in model.parameters())
    with pytest.raises(ValueError, match="dtype must be one of"):
        prepare_frozen(tiny_model("gpt2"), "int4")


@pytest.mark.parametrize("buffer_dtype", [None, "bf16"])
def test_a_frozen_copy_of_a_saved_model_scores_as_the_trained_one_to_the_bit(buffer_dtype,
                                                                              tmp_path):
    """A reference loaded from the actor's HF folder, in bf16: its log-probs are the actor
    engine's to the bit (the KL of step 1 is 0). transformers loads the rotary ``inv_freq``
    in fp32 and DeepSpeed's engine keeps it so (it casts the parameters alone); the frozen
    copy too. It cast its buffers before: 2e-3 apart in a token's log-prob within 64
    positions. With DeepSpeed's ``data_types.buffer_dtype`` both cast them."""
    from oppo_ds.models import build_causal_lm

    build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0).save_pretrained(tmp_path)
    overrides = {"data_types": {"buffer_dtype": buffer_dtype}} if buffer_dtype else None
    actor = make_engine(model=build_causal_lm(str(tmp_path), dtype="bf16"), dtype="bf16",
                        zero_stage=1, ds_config_overrides=overrides)
    reference = prepare_frozen(build_causal_lm(str(tmp_path), dtype="bf16"), "bf16", "cpu",
                               **({"overrides": overrides} if overrides else {}))
    want = torch.bfloat16 if buffer_dtype else torch.float32
    for model in (actor.module, reference):
        assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {want}
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))

    def logprobs(logits):
        return torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])

    with torch.no_grad():
        got = logprobs(reference(input_ids=ids).logits)
    assert torch.equal(got, logprobs(actor.forward_no_grad(lambda m: m(input_ids=ids).logits)))


@pytest.mark.parametrize("offload", [False, True])
def test_partitioned_reference_scores_like_a_full_copy(offload):
    """system.partition_reference: the frozen model's weights live as ZeRO-3 partitions (in
    CPU memory with offload) and its forward, gathering layer by layer, gives the full
    model's logits exactly (fp32: gathering moves the same numbers)."""
    from oppo_ds.engines import prepare_partitioned

    full = prepare_frozen(tiny_model("llama"), "fp32", "cpu")
    part = prepare_partitioned(tiny_model("llama"), "fp32", offload=offload)
    for p in part.parameters():
        assert p.numel() == 0 and p.ds_numel > 0  # nothing gathered outside a forward
        assert not p.requires_grad
        if offload:
            assert p.ds_tensor.device.type == "cpu"
    batch = fixed_batch()
    with torch.no_grad():
        want = full(**batch).logits
        got = part(**batch).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert all(p.numel() == 0 for p in part.parameters())  # released after the forward


@pytest.mark.parametrize("preset, want", [(None, "cpu"), ("cuda", "cuda")])
def test_deepspeed_is_told_to_use_the_cpu_without_cuda(preset, want):
    """Without CUDA, DeepSpeed would pick Apple's MPS backend on a Mac (it cannot exist here,
    so the choice is what is checked): importing our engine asks for its CPU accelerator,
    unless DS_ACCELERATOR was set, which is left as it was (cuda: DeepSpeed names the
    device without needing one)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    if preset:
        env["DS_ACCELERATOR"] = preset
    code = ("import os, torch; assert not torch.cuda.is_available(); "
            "import oppo_ds.engines.deepspeed_engine as e; "
            "print(os.environ['DS_ACCELERATOR'], e.get_accelerator().device_name())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == [want, want]


def test_a_left_over_cpu_adam_build_lock_is_named_too(tmp_path):
    """The offload optimizer builds DeepSpeed's cpu_adam op on first use, and a build stopped
    part-way leaves its lock, on which the next start waits for good (measured: a CI test
    here waited 17 minutes). A real DeepSpeedCPUAdam is made in a process of its own (this
    one may have the op loaded already) with the lock in place; the lock is named, and once
    it is removed the process goes on."""
    import select
    import shutil
    import subprocess
    import sys
    import time

    from torch.utils.cpp_extension import _get_build_directory

    lock = tmp_path / "cpu_adam" / "lock"
    built = _get_build_directory("cpu_adam", verbose=False)  # where this environment builds it
    if os.path.exists(os.path.join(built, "cpu_adam.so")):
        # the op test_offload_with_deepspeed_cpu_adam built: whether the process is still
        # waiting when the lock goes or takes the lock then, it loads this build (ninja finds
        # nothing to do) instead of compiling its own (measured: a minute of this test's 70 s)
        shutil.copytree(built, lock.parent, ignore=shutil.ignore_patterns("lock"))
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("")
    code = ("import torch\n"
            "from oppo_ds.engines import deepspeed_engine as dse\n"
            "dse.BUILD_LOCK_WARN_S = 0.5\n"
            "try:\n"
            "    dse._build_optimizer(torch.nn.Linear(2, 2), use_cpu_adam=True, lr=1e-3,\n"
            "                         weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)\n"
            "except Exception as err:  # no op was built: the lock was all there was\n"
            "    print('went on:', type(err).__name__)\n")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline, err = time.time() + 120, ""
        while "still waiting" not in err and time.time() < deadline:
            # a line at a time, but never blocked past the deadline on a silent process
            if select.select([proc.stderr], [], [], max(0.0, deadline - time.time()))[0]:
                line = proc.stderr.readline()
                assert line or proc.poll() is None, err[-2000:]
                err += line
        assert f"still waiting after 0 s while {lock} exist(s)" in err
        lock.unlink()
        out, rest = proc.communicate(timeout=300)
        assert proc.returncode == 0, (err + rest)[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_left_over_build_lock_is_named_after_the_wait(tmp_path, monkeypatch, capsys):
    """torch waits forever on the lock file of an op build that Ctrl-C interrupted (measured:
    every later start of the CI hung in DeepSpeed's init_distributed, FileBaton.wait); past
    the delay, the lock is named. Nothing is said when the call ends first, or without a lock."""
    import time

    from oppo_ds.engines import deepspeed_engine as dse

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with dse._warn_if_a_build_lock_holds(delay=0.1):
        time.sleep(0.4)
    assert capsys.readouterr().err == ""  # no lock
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("")
    with dse._warn_if_a_build_lock_holds(delay=5.0):
        time.sleep(0.1)
    assert capsys.readouterr().err == ""  # done before the delay
    with dse._warn_if_a_build_lock_holds(delay=0.1):
        time.sleep(0.5)
    err = capsys.readouterr().err
    assert f"still waiting after 0 s while {lock} exist(s)" in err
    assert "remove the file and start again" in err
