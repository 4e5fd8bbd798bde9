"""LoRA (oppo_ds/lora.py) on tiny HF models and in real DeepSpeed engines, and gradient
checkpointing: what a user of DeepSpeed-Chat's --actor_lora_dim / --only_optimize_lora and
--actor_gradient_checkpointing expects."""
import os

import pytest
import torch

from _builders import tiny_run_overrides
from oppo_ds.config import ConfigError, load_config
from oppo_ds.engines.factory import prepare_trained
from oppo_ds.lora import (LORA_KEYS, LoRALayer, add_lora, has_lora, merged_state_dict,
                          only_optimize_lora)
from oppo_ds.models import build_causal_lm, build_value_model

VOCAB = 64


def _ids(batch=3, length=9, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch,modules", [("tiny-llama", "layers."), ("tiny-qwen2", "layers."),
                                          ("tiny-gpt2", "h.")])
def test_fresh_lora_computes_the_base_model(arch, modules):
    base = build_causal_lm(arch, vocab_size=VOCAB, seed=0).eval()  # GPT-2 has dropout
    lora = build_causal_lm(arch, vocab_size=VOCAB, seed=0).eval()
    changed = add_lora(lora, 4, modules, seed=1)
    assert changed and all(modules in n for n in changed)
    x = _ids()
    # L starts at zero: exactly the base model's logits
    assert torch.equal(base(input_ids=x).logits, lora(input_ids=x).logits)
    # parameter names of the base weights are unchanged; the new ones are LoRA matrices
    names = dict(lora.named_parameters())
    assert set(dict(base.named_parameters())) <= set(names)
    assert {n.rsplit(".", 1)[-1] for n in set(names) - set(dict(base.named_parameters()))} == \
        {"lora_right_weight", "lora_left_weight"}
    # as DeepSpeed-Chat's LinearLayer_LoRA: a LoRA layer's weight is frozen, its bias and
    # the layers without LoRA still train
    lora_layers = [m for m in lora.modules() if isinstance(m, LoRALayer)]
    assert lora_layers and not any(m.weight.requires_grad for m in lora_layers)
    assert all(m.bias.requires_grad for m in lora_layers if m.bias is not None)
    frozen = {f"{n}.weight" for n in changed}
    assert all(p.requires_grad for n, p in lora.named_parameters() if n not in frozen)


def test_lora_update_and_merged_export_agree(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0)
    add_lora(model, 4, "layers.", alpha=8.0, seed=1)
    layer = next(m for m in model.modules() if isinstance(m, LoRALayer))
    assert layer.lora_scaling == 2.0
    for m in model.modules():  # a trained update: L no longer zero
        if isinstance(m, LoRALayer):
            torch.nn.init.normal_(m.lora_left_weight, std=0.02)
    x = _ids()
    want = model(input_ids=x).logits
    state = merged_state_dict(model)
    assert not any("lora" in k for k in state)
    model.save_pretrained(tmp_path, state_dict=state)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not has_lora(plain)
    # fp32: (W + sBA) x and W x + s B (A x) differ by summation order only
    torch.testing.assert_close(plain(input_ids=x).logits, want, atol=1e-5, rtol=0)


def test_value_model_export_with_lora(tmp_path):
    critic = build_value_model("tiny-qwen2", vocab_size=VOCAB, seed=0)
    add_lora(critic, 2, "layers.", seed=1)
    torch.nn.init.normal_(critic.value_head.weight)
    for m in critic.modules():
        if isinstance(m, LoRALayer):
            torch.nn.init.normal_(m.lora_left_weight, std=0.05)
    x = _ids()
    want = critic(input_ids=x).values
    critic.save_pretrained(str(tmp_path), state_dict=merged_state_dict(critic))
    loaded = build_value_model(str(tmp_path), require_head=True)
    torch.testing.assert_close(loaded(input_ids=x).values, want, atol=1e-5, rtol=0)


def test_only_optimize_lora_freezes_the_rest():
    critic = build_value_model("tiny-llama", vocab_size=VOCAB, seed=0)
    add_lora(critic, 2, "layers.")
    n = only_optimize_lora(critic, keep=("value_head",))
    trainable = {k for k, p in critic.named_parameters() if p.requires_grad}
    assert trainable and all(k.endswith(("lora_right_weight", "lora_left_weight")) or k.startswith("value_head")
                             for k in trainable)
    assert n == sum(p.numel() for p in critic.parameters() if p.requires_grad)


def test_no_matching_layer_is_an_error_naming_the_key():
    model = build_causal_lm("tiny-gpt2", vocab_size=VOCAB, seed=0)
    with pytest.raises(ValueError, match="lora_module_name 'layers.' matches no linear layer"):
        add_lora(model, 4, "layers.")


def test_config_checks():
    with pytest.raises(ConfigError, match="model.only_optimize_lora: needs actor_lora_dim"):
        load_config(None, ["model.only_optimize_lora=true"])
    with pytest.raises(ConfigError, match="model.actor_lora_dim: must be >= 0"):
        load_config(None, ["model.actor_lora_dim=-1"])


def test_gradient_checkpointing_gives_the_same_gradients():
    cfg = load_config(None, ["system.gradient_checkpointing=true", "model.actor_lora_dim=2",
                             "model.only_optimize_lora=true"])
    plain_cfg = load_config(None, ["model.actor_lora_dim=2", "model.only_optimize_lora=true"])
    x = _ids()
    grads = []
    for c in (plain_cfg, cfg):
        model = prepare_trained(build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0), c, "actor")
        # transformers 5.24 renamed it (the old name warns, and goes in v6)
        checkpointing = getattr(type(model), "is_activation_checkpointing", None)
        on = model.is_activation_checkpointing if checkpointing else model.is_gradient_checkpointing
        assert on == c.system.gradient_checkpointing
        model.train()
        for m in model.modules():
            if isinstance(m, LoRALayer):
                torch.nn.init.normal_(m.lora_left_weight, std=0.05, generator=torch.Generator().manual_seed(3))
        model(input_ids=x).logits.float().pow(2).mean().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-6, rtol=1e-5)


def _run(tmp_path, *extra, steps=2):
    from oppo_ds.trainer import PPOTrainer

    cfg = load_config(None, [*tiny_run_overrides(tmp_path, steps), "logging.tensorboard=false", *extra])
    trainer = PPOTrainer(cfg)
    return trainer, trainer.train()


@pytest.mark.filterwarnings("ignore")
def test_ppo_with_lora_only_trains_lora_and_exports_a_plain_model(tmp_path):
    from transformers import AutoModelForCausalLM

    trainer, summary = _run(tmp_path, "model.actor_lora_dim=4", "model.critic_lora_dim=2",
                            "model.only_optimize_lora=true", "system.gradient_checkpointing=true")
    actor = trainer.actor.module
    base = build_causal_lm("tiny-llama", vocab_size=len(trainer.tokenizer), seed=0)
    # the base weights did not move; the LoRA matrices did
    for name, p in base.named_parameters():
        torch.testing.assert_close(dict(actor.named_parameters())[name].detach(), p, atol=0, rtol=0)
    assert any(m.lora_left_weight.abs().sum() > 0 for m in actor.modules() if isinstance(m, LoRALayer))
    # the optimizer holds the LoRA matrices only
    opt_params = {id(p) for g in trainer.actor.ds_engine.optimizer.param_groups for p in g["params"]}
    lora_params = {id(p) for n, p in actor.named_parameters() if "lora_" in n}
    assert lora_params
    assert opt_params == lora_params
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(tmp_path, "run", "actor"))
    x = _ids(seed=5) % len(trainer.tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=x).logits, actor(input_ids=x).logits,
                                   atol=1e-5, rtol=0)
    assert summary is not None


def test_lora_keeps_the_hybrid_engine_off_its_inference_kernels():
    """DeepSpeed's containers find LoRA by attribute names (module_inject/policy.py
    maybe_get_lora) and fold W += s * L^T R^T (containers/features/hybrid_engine.py), our
    merged weight; but only inside DeepSpeedHybridEngine.generate(), which oppo-ds does not
    call, and Llama's looks on the layer's weight, where ours are not. With LoRA the engine
    therefore decodes with the model's own forward on a GPU too (the kernels would decode with
    the base weights, off the policy the log-probs are of); inject_kernels=True is refused.
    The choice is a function of the device's type: checked here for "cuda" without one."""
    from deepspeed.module_inject.policy import maybe_get_lora

    from oppo_ds.engines.deepspeed_engine import (HYBRID_KERNELS, HYBRID_NO_KERNELS_CPU,
                                                  HYBRID_NO_KERNELS_LORA,
                                                  HYBRID_NO_KERNELS_REQUESTED, _kernel_choice)

    model = build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0)
    assert _kernel_choice(model, "cuda", None) == HYBRID_KERNELS
    add_lora(model, 4, "layers.", alpha=2.0)
    layer = model.model.layers[0].self_attn.q_proj
    torch.nn.init.normal_(layer.lora_left_weight)
    assert maybe_get_lora(layer.weight) == []  # where Llama's container looks
    right, left, scaling = maybe_get_lora(layer)  # where OPT's, BLOOM's, GPT-NeoX's look
    assert right is layer.lora_right_weight and left is layer.lora_left_weight
    fused_by_deepspeed = layer.weight + scaling * torch.matmul(left.t(), right.t())
    torch.testing.assert_close(fused_by_deepspeed, layer.weight + layer.delta_weight())
    assert _kernel_choice(model, "cuda", None) == HYBRID_NO_KERNELS_LORA
    assert _kernel_choice(model, "cuda", False) == HYBRID_NO_KERNELS_REQUESTED
    assert _kernel_choice(model, "cpu", None) == HYBRID_NO_KERNELS_CPU
    with pytest.raises(ValueError, match="inject_kernels=True with LoRA layers"):
        _kernel_choice(model, "cuda", True)


def test_lora_matrices_train_at_their_own_learning_rate(tmp_path):
    """model.lora_learning_rate (DeepSpeed-Chat's --actor_lora_learning_rate: its LoRA scripts
    train LoRA at 5e-4 beside a base rate near 1e-5, in an optimizer group of its own): the
    LoRA matrices are one parameter group at that rate, decayed, under the same schedule; a
    resume puts this run's rates back. Null keeps them in the model's groups at its rate."""
    from oppo_ds.engines.deepspeed_engine import DeepSpeedTrainEngine

    def engine(lora_lr):
        model = build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0)
        add_lora(model, 4, "layers.", alpha=1.0, seed=1)
        lora = {id(p) for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in LORA_KEYS}
        built = DeepSpeedTrainEngine(model, lr=1e-5, lora_lr=lora_lr, weight_decay=0.1,
                                     warmup_steps=2, total_steps=4, scheduler="linear",
                                     micro_batch_size=3)
        return built, lora

    def lrs(built, lora):  # ({(peak, lr)} of the LoRA matrices' groups, of the others)
        groups = built.ds_engine.optimizer.param_groups
        mine = [g for g in groups if {id(p) for p in g["params"]} & lora]
        rest = [g for g in groups if g not in mine]
        return ({(g["initial_lr"], g["lr"]) for g in mine},
                {(g["initial_lr"], g["lr"]) for g in rest})

    def loss(model, batch):
        out = model(input_ids=batch["input_ids"], labels=batch["input_ids"])
        return out.loss, {}

    built, lora = engine(5e-4)
    assert lrs(built, lora) == ({(5e-4, 5e-4 / 2)}, {(1e-5, 1e-5 / 2)})  # warm-up 1 of 2
    mine = [g for g in built.ds_engine.optimizer.param_groups
            if {id(p) for p in g["params"]} & lora]
    assert len(mine) == 1 and {id(p) for p in mine[0]["params"]} == lora
    assert mine[0]["weight_decay"] == 0.1
    built.train_step([{"input_ids": _ids()}], loss)
    assert lrs(built, lora) == ({(5e-4, 5e-4)}, {(1e-5, 1e-5)})
    built.save(str(tmp_path), tag="step1")
    resumed, lora = engine(2e-4)
    resumed.load(str(tmp_path))
    assert lrs(resumed, lora) == ({(2e-4, 2e-4)}, {(1e-5, 1e-5)})
    built, lora = engine(None)  # the LoRA matrices in the model's decayed group
    assert lrs(built, lora) == ({(1e-5, 1e-5 / 2)}, {(1e-5, 1e-5 / 2)})
    assert len(built.ds_engine.optimizer.param_groups) == 2


@pytest.mark.filterwarnings("ignore")
def test_a_lora_checkpoint_that_trained_its_layers_weights_is_refused_by_name(tmp_path):
    """A LoRA checkpoint written while the weights of its LoRA layers trained (before they
    were frozen) holds optimizer states for them: a resume is refused in one line saying so,
    before any engine loads, not with DeepSpeed's mismatch of parameter groups. An evaluation
    (the actor's weights alone) takes it."""
    from oppo_ds.trainer import PPOTrainer

    lora = ("model.actor_lora_dim=4", "checkpoint.every=1")
    trainer, _ = _run(tmp_path, *lora, steps=1)
    trainer.close()
    state_file = tmp_path / "run" / "checkpoints" / "trainer" / "step1" / "rank0.pt"
    state = torch.load(state_file, weights_only=False)
    assert state["settings"]["model.lora_layer_weights_frozen"] is True
    del state["settings"]["model.lora_layer_weights_frozen"]  # as written before the key
    torch.save(state, state_file)
    cfg = load_config(None, [*tiny_run_overrides(tmp_path, 2), "logging.tensorboard=false",
                             *lora])
    with pytest.raises(ConfigError, match=r"^model\.lora_layer_weights_frozen: True, but "
                                          r"checkpoint step1 was written with False: .*it "
                                          r"trained the weights of its LoRA layers"):
        PPOTrainer(cfg)
    # an evaluation built in Python needs its prompts, as `oppo-train --evaluate` does
    with pytest.raises(ConfigError, match=r"^eval\.prompts: null, and --evaluate evaluates"):
        PPOTrainer(cfg, evaluate_only=True)
    cfg = load_config(None, [*tiny_run_overrides(tmp_path, 2), "logging.tensorboard=false",
                             *lora, "eval.prompts=builtin", "eval.num_prompts=4"])
    evaluation = PPOTrainer(cfg, evaluate_only=True)
    assert evaluation.evaluate_only()["step"] == 1
    evaluation.close()


@pytest.mark.filterwarnings("ignore")
def test_a_lora_learning_rate_set_or_null_must_be_the_checkpoints(tmp_path):
    """model.lora_learning_rate set puts the LoRA matrices in an optimizer group of their own:
    a resume that sets it where the checkpoint had none (or the reverse) is refused by name,
    not left to DeepSpeed's mismatch of parameter groups; another rate resumes."""
    from oppo_ds.trainer import PPOTrainer

    lora = ("model.actor_lora_dim=4", "checkpoint.every=1")
    trainer, _ = _run(tmp_path, *lora, "model.lora_learning_rate=1e-3", steps=1)
    trainer.close()

    def config(*extra):
        return load_config(None, [*tiny_run_overrides(tmp_path, 2), "logging.tensorboard=false",
                                  *lora, *extra])
    with pytest.raises(ConfigError, match=r"^model\.lora_learning_rate: null, but checkpoint "
                                          r"step1 was written with set"):
        PPOTrainer(config())
    resumed = PPOTrainer(config("model.lora_learning_rate=5e-4"))
    groups = resumed.actor.ds_engine.optimizer.param_groups
    assert groups[-1]["initial_lr"] == 5e-4 and len(groups) == 3
    assert resumed.actor.resumed_changes["lora_lr"] == (1e-3, 5e-4)  # logged at the resume
    resumed.close()
