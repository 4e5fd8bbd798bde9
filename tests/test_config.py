"""Tier 0: the config dataclasses, YAML loading, dotted overrides, error messages, the
generated docs page and the oppo-train command line (torchtune tests/recipes/test_configs.py)."""

import dataclasses
import glob
import os
import subprocess
import sys

import pytest
import torch
import yaml

from oppo_ds.cli.train import main as train_main
from oppo_ds.config import (
    Config,
    ConfigError,
    ModelConfig,
    PPOConfig,
    load_config,
)
from oppo_ds.config_docs import config_markdown, iter_keys
from oppo_ds.config_paths import check_export_targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "examples", "configs", "*.yaml")))


def _leaves(data: dict, prefix: str = ""):
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _get(cfg: Config, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- shipped YAML files

def test_example_configs_exist():
    names = {os.path.basename(p) for p in EXAMPLE_CONFIGS}
    assert {"tiny.yaml", "own_models.yaml", "llama3_8b_zero3.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=os.path.basename)
def test_example_config_loads_with_its_values(path):
    cfg = load_config(path)
    with open(path) as f:
        raw = yaml.safe_load(f)
    leaves = dict(_leaves(raw))
    assert len(leaves) >= 5
    # every key written in the file is what the loaded config holds (not just "no error")
    for key, value in leaves.items():
        assert _get(cfg, key) == value, key
    # keys the file leaves out keep the dataclass defaults
    if "ppo.gamma" not in leaves:
        assert cfg.ppo.gamma == PPOConfig().gamma


def test_tiny_example_spot_values():
    cfg = load_config(os.path.join(ROOT, "examples", "configs", "tiny.yaml"))
    assert cfg.model.actor == "builtin" and cfg.model.builtin_arch == "tiny-llama"
    assert (cfg.ppo.batch_size, cfg.ppo.mini_batch_size, cfg.ppo.micro_batch_size) == (16, 8, 8)
    assert cfg.ppo.kl_coef == 0.2 and isinstance(cfg.ppo.kl_coef, float)
    assert cfg.system.zero_stage == 0 and cfg.checkpoint.every == 100


def test_llama3_example_spot_values():
    cfg = load_config(os.path.join(ROOT, "examples", "configs", "llama3_8b_zero3.yaml"))
    assert cfg.system.zero_stage == 3 and cfg.system.offload is True
    assert cfg.system.dtype == "bf16" and cfg.data.overlong == "truncate"
    assert cfg.ppo.actor_lr == pytest.approx(9.65e-6)


# ---------------------------------------------------------------- generated docs page

def test_docs_page_matches_dataclasses():
    """docs/config.md is generated (`python -m oppo_ds.config_docs`); it must not drift."""
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        assert f.read() == config_markdown()


def test_every_key_documented():
    keys = list(iter_keys())
    assert len(keys) > 40
    for key, tp, _default, doc in keys:
        assert doc.strip(), f"{key} has no docstring"
        assert tp.strip(), key
    markdown = config_markdown()
    for key, *_ in keys:
        assert f"| `{key}` |" in markdown


def test_the_pages_naming_keys_name_real_ones():
    """Every `section.key` the README and the docs pages written by hand name (in backticks,
    with an optional `: value` or `=value`) is a key of the config: a renamed key cannot leave
    a page behind. File names (`eval.jsonl`) are not keys."""
    import re

    keys = {key for key, *_ in iter_keys()}
    sections = {key.split(".")[0] for key in keys if "." in key}
    files = {"jsonl", "json", "safetensors", "md", "py", "yaml", "txt", "pt", "png", "sh", "log"}
    pages = [p for p in glob.glob(os.path.join(ROOT, "docs", "*.md")) if not p.endswith("config.md")]
    for page in pages + [os.path.join(ROOT, "README.md")]:
        text = open(page).read()
        named = {m.group(1) for m in re.finditer(r"`([a-z_]+\.[a-z_]+)(?:[:=][^`]*)?`", text)
                 if m.group(1).split(".")[0] in sections and m.group(1).split(".")[1] not in files}
        assert not named - keys, (page, sorted(named - keys))
    assert len(pages) >= 9  # every page but the generated one


def test_iter_keys_defaults_match_dataclass():
    default = Config()
    for key, _tp, value, _doc in iter_keys():
        assert _get(default, key) == value, key


# ---------------------------------------------------------------- dotted overrides

def test_override_types_parsed():
    cfg = load_config(None, ["ppo.kl_coef=0.1", "steps=7", "ppo.whiten_advantages=false",
                             "model.reference=null", "ppo.grad_clip=null",
                             "model.critic=/some/dir", "logging.output_dir=runs/x"])
    assert cfg.ppo.kl_coef == 0.1 and isinstance(cfg.ppo.kl_coef, float)
    assert cfg.steps == 7 and isinstance(cfg.steps, int)
    assert cfg.ppo.whiten_advantages is False
    assert cfg.model.reference is None and cfg.ppo.grad_clip is None
    assert cfg.model.critic == "/some/dir" and cfg.logging.output_dir == "runs/x"


def test_override_int_for_float_key_becomes_float():
    cfg = load_config(None, ["ppo.gamma=1", "ppo.grad_clip=2"])
    assert cfg.ppo.gamma == 1.0 and type(cfg.ppo.gamma) is float
    assert cfg.ppo.grad_clip == 2.0 and type(cfg.ppo.grad_clip) is float


def test_override_exponent_without_dot_is_a_float(tmp_path):
    """PyYAML (YAML 1.1) reads `1e-5` as a string; a float key must still take it."""
    cfg = load_config(None, ["ppo.actor_lr=1e-5", "ppo.critic_lr=3E-6"])
    assert cfg.ppo.actor_lr == 1e-5 and cfg.ppo.critic_lr == 3e-6
    cfg = load_config(_write(tmp_path, "ppo:\n  actor_lr: 2e-4\n"))
    assert cfg.ppo.actor_lr == 2e-4
    with pytest.raises(ConfigError, match="ppo.actor_lr"):
        load_config(None, ["ppo.actor_lr=fast"])
    with pytest.raises(ConfigError, match="steps"):  # only float keys take it
        load_config(None, ["steps=1e3"])


def test_override_beats_yaml_and_keeps_other_keys(tmp_path):
    path = _write(tmp_path, "ppo:\n  kl_coef: 0.2\n  batch_size: 32\nsteps: 5\n")
    cfg = load_config(path, ["ppo.kl_coef=0.01"])
    assert cfg.ppo.kl_coef == 0.01
    assert cfg.ppo.batch_size == 32 and cfg.steps == 5
    assert cfg.ppo.mini_batch_size == PPOConfig().mini_batch_size


def test_override_creates_nested_section():
    cfg = load_config(None, ["system.zero_stage=2", "generation.top_p=0.9"])
    assert cfg.system.zero_stage == 2 and cfg.generation.top_p == 0.9
    assert cfg.system.dtype == "fp32"


def test_later_override_wins():
    assert load_config(None, ["seed=1", "seed=2"]).seed == 2


def test_override_without_equals_rejected():
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["ppo.kl_coef"])


# ---------------------------------------------------------------- error messages

def test_unknown_key_suggests_close_match():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["ppo.kl_cof=0.1"])
    msg = str(err.value)
    assert err.value.key == "ppo.kl_cof"
    assert msg.startswith("ppo.kl_cof:") and "did you mean 'kl_coef'" in msg
    assert "batch_size" in msg  # lists the allowed keys of the section


@pytest.mark.parametrize("text, hint", [
    ("kl_coef: 0.1\n", "did you mean ppo.kl_coef?"),
    ("prompts: p.jsonl\n", "did you mean data.prompts or eval.prompts?"),
])
def test_top_level_key_of_a_section_names_the_section(tmp_path, text, hint):
    """`kl_coef: 0.1` at the top of a file listed the top-level keys only."""
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, text))
    key = text.split(":")[0]
    assert str(err.value).startswith(f"{key}: unknown key; allowed keys: steps, seed, model,")
    assert str(err.value).endswith(f"; {hint}")


@pytest.mark.parametrize("override, hint", [
    ("ppo.max_new_tokens=64", "did you mean generation.max_new_tokens?"),
    ("generation.kl_coef=0.1", "did you mean ppo.kl_coef?"),
    ("model.prompts=p.jsonl", "did you mean data.prompts or eval.prompts?"),
])
def test_key_in_another_section_names_its_section(override, hint):
    """`ppo.max_new_tokens` named only a close key of ppo, or nothing, not the section where
    the key lives."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    key, section = override.split("=")[0], override.split(".")[0]
    assert str(err.value).startswith(f"{key}: unknown key; allowed keys in {section}: ")
    assert str(err.value).endswith(f"; {hint}")


def test_unknown_key_in_yaml(tmp_path):
    path = _write(tmp_path, "generation:\n  max_new_token: 10\n")
    with pytest.raises(ConfigError, match=r"generation\.max_new_token.*did you mean 'max_new_tokens'"):
        load_config(path)


def test_unknown_section():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["optim.lr=0.1"])
    assert err.value.key == "optim"
    assert "unknown key" in str(err.value) and "ppo" in str(err.value)


def test_section_given_a_scalar():
    with pytest.raises(ConfigError, match="ppo: expected a mapping"):
        load_config(None, ["ppo=3"])


@pytest.mark.parametrize("override, key, expected", [
    ("steps=many", "steps", "an integer"),
    ("steps=1.5", "steps", "an integer"),
    ("ppo.kl_coef=high", "ppo.kl_coef", "a number"),
    ("ppo.grad_clip=off", "ppo.grad_clip", "a number or null"),
    ("model.reward=3", "model.reward", "a string"),
    ("model.reference=[a, b]", "model.reference", "a string or null"),
    ("ppo.whiten_advantages=1", "ppo.whiten_advantages", "true/false"),
])
def test_wrong_type(override, key, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.key == key
    assert expected in str(err.value)


@pytest.mark.parametrize("override", ["steps=true", "ppo.batch_size=false", "ppo.kl_coef=true",
                                      "system.zero_stage=true"])
def test_bool_rejected_for_numbers(override):
    """`True == 1` in Python; a YAML boolean must still not pass as a number or a stage."""
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(None, [override])


@pytest.mark.parametrize("text, expected", [("off", "off"), ("on", "on"), ("'off'", "off"),
                                            ("no", "off"), ("yes", "on"), ("auto", "auto")])
def test_on_off_values_survive_yaml_reading_them_as_booleans(tmp_path, text, expected):
    """YAML 1.1 reads an unquoted on / off as true / false: `data.chat_template: off`, the
    documented value, was refused ("got False, allowed: one of 'auto', 'on', 'off'") in a
    config file and on the command line alike."""
    path = tmp_path / "c.yaml"
    path.write_text(f"data:\n  chat_template: {text}\n")
    assert load_config(str(path), []).data.chat_template == expected
    assert load_config(None, [f"data.chat_template={text}"]).data.chat_template == expected


@pytest.mark.parametrize("override, allowed", [
    ("system.zero_stage=7", ["0", "1", "2", "3"]),
    ("system.zero_stage=2.0", ["0", "1", "2", "3"]),
    ("system.zero_stage='2'", ["0", "1", "2", "3"]),
    ("system.dtype=fp8", ["'fp32'", "'bf16'", "'fp16'"]),
    ("ppo.kl_estimator=k2", ["'k1'", "'k3'", "'abs'", "'mse'"]),
    ("model.builtin_arch=tiny-mistral", ["'tiny-llama'", "'tiny-qwen2'", "'tiny-gpt2'"]),
])
def test_value_outside_literal_lists_allowed(override, allowed):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    msg = str(err.value)
    assert err.value.key == key and msg.startswith(key + ":")
    assert "allowed" in msg
    for value in allowed:
        assert value in msg


@pytest.mark.parametrize("overrides, key, words", [
    (["ppo.batch_size=16", "ppo.mini_batch_size=5"], "ppo.mini_batch_size", "must divide batch_size (16)"),
    (["ppo.mini_batch_size=8", "ppo.micro_batch_size=3"], "ppo.micro_batch_size", "must divide mini_batch_size (8)"),
    (["ppo.batch_size=0"], "ppo.batch_size", ">= 1"),
    (["ppo.gamma=1.5"], "ppo.gamma", "[0, 1]"),
    (["generation.top_p=0"], "generation.top_p", "(0, 1]"),
    (["generation.temperature=-1"], "generation.temperature", ">= 0"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last", ">= 1"),
    (["steps=0"], "steps", ">= 1"),
    (["oppo.overcommit=-1"], "oppo.overcommit", ">= 0 or auto"),
    (["oppo.delta_min=5", "oppo.delta_max=2"], "oppo.delta_min", "delta_min <= delta_max"),
    (["oppo.max_defer_steps=0"], "oppo.max_defer_steps", ">= 1"),
    # B rows taken, Delta carried: above B, more rows could be due than a step takes
    (["oppo.overcommit=17"], "oppo.overcommit", "must be at most ppo.batch_size (16)"),
    (["ppo.batch_size=4", "ppo.mini_batch_size=4", "ppo.micro_batch_size=4",
      "oppo.overcommit=auto"], "oppo.delta_max",
     "max_defer_steps (2) together and the bound would not hold; got 8; delta_max is 8 unless"),
    (["oppo.is_clip=0.5"], "oppo.is_clip", ">= 1"),
    (["generation.eos_token_ids=[]"], "generation.eos_token_ids", "non-empty list"),
    # was a ValueError traceback from the engine, after the models were loaded
    (["system.offload=true"], "system.offload", "needs zero_stage 1, 2 or 3"),
    # DeepSpeed raised NotImplementedError for this one
    (["system.dtype=bf16", "system.grad_accum_dtype=fp32"], "system.grad_accum_dtype",
     "fp32 with dtype bf16 and zero_stage 0: the gradients accumulate in the model's dtype, or "
     "a bf16 model's in fp32 under zero_stage 1, 2 or 3 without offload (DeepSpeed refuses that "
     "mix under ZeRO-0; with offload it is untested here); allowed here: auto, bf16"),
    (["system.dtype=bf16", "system.zero_stage=2", "system.offload=true",
      "system.grad_accum_dtype=fp32"], "system.grad_accum_dtype",
     "fp32 with dtype bf16 and zero_stage 2 with offload: "),
    (["system.dtype=bf16", "system.zero_stage=1", "system.grad_accum_dtype=fp16"],
     "system.grad_accum_dtype", "allowed here: auto, bf16, fp32"),
    (["system.backend=megatron", "system.grad_accum_dtype=fp32"], "system.grad_accum_dtype",
     "needs backend: deepspeed"),
    # DeepSpeed's settings, LoRA and fp16 under megatron: refused by the engine's build (after
    # the launch and the workload) until the 42nd session, and planned by oppo-plan
    (["system.backend=megatron", "system.zero_stage=3"], "system.zero_stage",
     "needs backend: deepspeed (megatron shards the models by tensor_parallel and "
     "pipeline_parallel; leave it at 0), got 3 with backend: megatron"),
    (["system.backend=megatron", "system.offload=true"], "system.offload", "leave it at false"),
    (["system.backend=megatron", "system.hybrid_engine=true"], "system.hybrid_engine",
     "leave it at false), got true"),
    (["system.backend=megatron", "system.dtype=fp16"], "system.dtype",
     "backend megatron supports fp32 and bf16"),
    (["system.backend=megatron", "model.critic_lora_dim=8"], "model.critic_lora_dim",
     "needs system.backend: deepspeed (LoRA is implemented for it only"),
    (["system.grad_accum_dtype=int8"], "system.grad_accum_dtype", "'auto', 'fp32', 'bf16'"),
    (["generation.eos_token_ids=[2, -1]"], "generation.eos_token_ids", ">= 0"),
    (["generation.eos_token_ids=eos"], "generation.eos_token_ids", "'auto' or a list of integers"),
    (["logging.samples=-1"], "logging.samples", ">= 0"),
    (["logging.log_every=-5"], "logging.log_every", ">= 0"),
    (["data.prompts=[]"], "data.prompts", "an empty list"),
    (["data.prompts=[builtin, a.jsonl]"], "data.prompts", "cannot be listed with files"),
    (["data.prompts=[a.jsonl, ' ']"], "data.prompts", "an empty path"),
    (["data.prompts=[a.jsonl, 3]"], "data.prompts", "a string or a list of strings"),
    (["data.phase_split=[2, 4]"], "data.phase_split", "three weights >= 0"),
    (["data.phase_split=[2, -4, 4]"], "data.phase_split", "three weights >= 0"),
    (["data.phase_split=[5, 5, 0]"], "data.phase_split", "the PPO part's share and must be > 0"),
    (["ppo.missing_eos_penalty=-1"], "ppo.missing_eos_penalty", ">= 0 or null"),
    (["ppo.overlong_buffer_len=-4"], "ppo.overlong_buffer_len", ">= 0 (0 = off)"),
    (["data.max_samples=-1"], "data.max_samples", "must be >= 0 (0 = all)"),
    (["model.reward_function=m:f", "model.reward_normalize=true"], "model.reward_normalize",
     "must be false: it normalises a reward model's scores, and with model.reward_function no "
     "reward model is built"),
    (["model.reward_function=m:f", "workload.kind=length_oracle"], "model.reward_function",
     "there is no text to score"),
    (["model.reward_function=m:f", "oppo.streaming=true", "oppo.placement=stage",
      "oppo.stream_to=[actor]"], "oppo.stream_to", "leaves the stage's scorer rank nothing to score"),
    (["model.reward_function=m:f", "oppo.streaming=true", "oppo.stream_to=[]"], "oppo.stream_to",
     "nothing would stream"),
    (["model.reward_function=m:f", "data.prompts=p.jsonl"], "model.critic",
     "the critic starts from model.reward, here the built-in task's reward model"),
    (["data.max_samples=100"], "data.max_samples", "set that instead"),
    (["ppo.kl_coef=0", "model.reference=/ckpt/ref"], "model.reference",
     "must be null: ppo.kl_coef is 0, so no reference model is built"),
    (["ppo.kl_coef=0", "system.zero_stage=3", "system.partition_reference=true"],
     "system.partition_reference", "must be false: ppo.kl_coef is 0"),
    (["ppo.overlong_penalty_factor=-1"], "ppo.overlong_penalty_factor", "must be >= 0"),
    (["ppo.overlong_buffer_len=200", "generation.max_new_tokens=128"], "ppo.overlong_buffer_len",
     "at most generation.max_new_tokens (128), got 200"),
    (["ppo.micro_batch_tokens=0"], "ppo.micro_batch_tokens", "must be >= 1 or null, got 0"),
    (["ppo.score_batch_tokens=-3"], "ppo.score_batch_tokens", "must be >= 1 or null, got -3"),
    (["ppo.score_batch_tokens=50", "generation.max_new_tokens=24"], "ppo.score_batch_tokens",
     "must hold one sequence of the longest, generation.max_prompt_len + max_new_tokens: 56, "
     "got 50"),
    (["ppo.micro_batch_tokens=100", "generation.max_prompt_len=32", "generation.max_new_tokens=96"],
     "ppo.micro_batch_tokens", "must hold one sequence of the longest, generation.max_prompt_len "
     "+ max_new_tokens = 128: 128, got 100"),
    (["ppo.micro_batch_tokens=200", "generation.max_prompt_len=32", "generation.max_new_tokens=96",
      "ppo.ptx_coef=0.5", "data.ptx=/data/text.jsonl", "data.ptx_block_len=80"],
     "ppo.micro_batch_tokens", "plus a PPO-ptx block of 80 (data.ptx_block_len): 208, got 200"),
    (["ppo.kl_penalty=loss"], "ppo.kl_estimator", "k1 with kl_penalty: loss"),
    (["ppo.kl_penalty=loss", "ppo.kl_estimator=abs"], "ppo.kl_estimator", "use mse or k3"),
    (["ppo.dual_clip=1"], "ppo.dual_clip", "must be > 1 or null"),
    (["ppo.clip_eps_high=0"], "ppo.clip_eps_high", "must be > 0 or null"),
    (["ppo.freeze_actor_steps=-1"], "ppo.freeze_actor_steps", ">= 0"),
    (["ppo.batch_size=8", "data.samples_per_prompt=3"], "data.samples_per_prompt",
     "must divide ppo.batch_size (8)"),
    (["data.samples_per_prompt=0"], "data.samples_per_prompt", ">= 1"),
    (["ppo.advantage_estimator=grpo"], "ppo.advantage_estimator", "'group_norm'"),
    (["ppo.advantage_estimator=rloo"], "data.samples_per_prompt",
     "must be >= 2 with ppo.advantage_estimator rloo"),
    (["ppo.advantage_estimator=group_norm", "data.samples_per_prompt=2", "model.critic=/ckpt/rm"],
     "model.critic", "must be null: ppo.advantage_estimator group_norm has no critic"),
    (["ppo.advantage_estimator=reinforce", "model.critic_lora_dim=8"], "model.critic_lora_dim",
     "must be 0"),
    (["ppo.advantage_estimator=reinforce", "ppo.freeze_actor_steps=3"], "ppo.freeze_actor_steps",
     "this estimator has none"),
    # the pool draws whole prompts under a group baseline: Delta is a whole number of them
    (["ppo.advantage_estimator=rloo", "data.samples_per_prompt=4", "oppo.overcommit=6"],
     "oppo.overcommit", "multiple of data.samples_per_prompt (4) with ppo.advantage_estimator "
     "rloo: the rollout pool draws whole prompts of 4 responses; got 6 (e.g. 4 or 8)"),
    (["ppo.advantage_estimator=group_norm", "data.samples_per_prompt=16", "oppo.overcommit=auto"],
     "oppo.delta_max", "got 8 (e.g. 0 or 16)"),
    (["ppo.advantage_estimator=group_norm", "data.samples_per_prompt=4", "oppo.overcommit=auto",
      "oppo.delta_min=2"], "oppo.delta_min", "got 2 (e.g. 0 or 4)"),
    (["generation.cuda_graph=true"], "generation.cuda_graph", "needs static_cache: true"),
    (["generation.static_cache=true", "system.hybrid_engine=true"], "generation.static_cache",
     "which system.hybrid_engine: True replaces"),
    (["generation.static_cache=true", "system.backend=megatron"], "generation.static_cache",
     "which system.backend: megatron replaces"),
    # was a ValueError traceback from algo/rewards.py at step 1
    (["ppo.reward_clip=0"], "ppo.reward_clip", "must be > 0 or null (null = off), got 0.0"),
    (["ppo.reward_clip=-2"], "ppo.reward_clip", "must be > 0 or null"),
    (["ppo.weight_decay=-0.1"], "ppo.weight_decay", "must be >= 0, got -0.1"),
    (["ppo.warmup_steps=-1"], "ppo.warmup_steps", "must be >= 0, got -1"),
    (["ppo.adam_betas=[0.9]"], "ppo.adam_betas", "must be two numbers in [0, 1) (beta1, beta2), "
                                                 "got [0.9]"),
    (["ppo.adam_betas=[0.9, 1.0]"], "ppo.adam_betas", "got [0.9, 1.0]"),
    (["ppo.adam_eps=0"], "ppo.adam_eps", "must be > 0, got 0.0"),
    (["ppo.grad_clip=-1"], "ppo.grad_clip", "must be >= 0 or null (null or 0 = off), got -1.0"),
    (["workload.num_prompts=0"], "workload.num_prompts", "must be >= 1, got 0"),
    (["workload.sft_steps=-1"], "workload.sft_steps", "must be >= 0, got -1"),
    (["workload.reward_steps=-3"], "workload.reward_steps", "must be >= 0, got -3"),
    (["workload.median_len=0"], "workload.median_len", "must be >= 1, got 0"),
    (["workload.tail_sigma=-0.5"], "workload.tail_sigma", "must be >= 0, got -0.5"),
    (["logging.output_dir="], "logging.output_dir", "must not be empty"),
    # numpy refused them only when the run started: "Seed must be between 0 and 2**32 - 1"
    (["seed=-1"], "seed", "must be in [0, 2**32 - 1] (a 32-bit seed), got -1"),
    (["seed=4294967296"], "seed", "got 4294967296"),
    (["data.phase_split_seed=4294967296"], "data.phase_split_seed",
     "must be in [0, 2**32 - 1] (a 32-bit seed), got 4294967296"),
    (["data.phase_split_seed=-3"], "data.phase_split_seed", "got -3"),
    (["logging.output_dir=' '"], "logging.output_dir", "must not be empty"),
    # was a ValueError traceback from the engines' schedule, naming neither key nor steps
    (["steps=2", "ppo.batch_size=8", "ppo.mini_batch_size=4", "ppo.micro_batch_size=4",
      "ppo.warmup_steps=10"], "ppo.warmup_steps",
     "must be at most the run's optimizer updates, steps x ppo.ppo_epochs x ppo.batch_size / "
     "ppo.mini_batch_size = 4, got 10"),
])
def test_cross_field_and_range_validation(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key
    assert words in str(err.value)


DS = "system.deepspeed_config"


@pytest.mark.parametrize("value, words", [
    ("{zero_optimization: {stage: 3}}", "zero_optimization.stage is set by system.zero_stage "
                                        "(1 here, 3 as DeepSpeed reads the entries given)"),
    ("{gradient_clipping: 1.0}", "gradient_clipping is set by ppo.grad_clip (0.5 here, 1.0"),
    ("{hybrid_engine: {enabled: true}}", "hybrid_engine.enabled is set by system.hybrid_engine"),
    ("{zero_optimization: {offload_optimizer: {device: cpu}}}",
     "zero_optimization.offload_optimizer.device is set by system.offload (none here, 'cpu'"),
    ("{optimizer: {type: Adam}}", "optimizer is set by ppo.actor_lr, ppo.critic_lr, "
                                  "ppo.weight_decay, ppo.adam_betas and ppo.adam_eps (AdamW, "
                                  "built here) (none here, 'adam'"),
    ("{timers: {throughput: {enabled: true}}}", "timers.throughput.enabled is set by "
                                                "logging.profile_step"),
    ("{checkpoint: {load_universal: true}}", "checkpoint.load_universal is set by "
                                             "checkpoint.resume"),
    # DeepSpeed's older names and forms of owned entries
    ("{bfloat16: {enabled: true}}", "bfloat16 is DeepSpeed's old name of bf16: write bf16"),
    ("{zero_optimization: {cpu_offload: true}}", "zero_optimization.cpu_offload is DeepSpeed's "
                                                 "old name of zero_optimization.offload_optimizer"),
    ("{zero_optimization: true}", "zero_optimization must be a mapping of ZeRO's entries"),
    # DeepSpeed's own check: its pydantic model of the ZeRO section forbids unknown keys
    ("{zero_optimization: {reduce_bucket_sise: 5e7}}",
     "DeepSpeed refuses it: ValidationError: 1 validation error for DeepSpeedZeroConfig "
     "reduce_bucket_sise Extra inputs are not permitted"),
    ("{communication_data_type: fp33}", "DeepSpeed refuses it: ValueError: Invalid "
                                        "communication_data_type"),
    # a top-level key DeepSpeed ignores: an error when it is a typo of one it reads
    ("{comunication_data_type: fp32}", "comunication_data_type: DeepSpeed reads no such key; "
                                       "did you mean 'communication_data_type'?"),
    ("[1]", "got [1], expected a mapping or null"),
])
def test_deepspeed_config_entries_deepspeed_or_other_keys_refuse_name_why(value, words):
    """Compared with the run's own settings (ZeRO-1, grad_clip 0.5 here), as DeepSpeed
    parses them."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["system.zero_stage=1", "ppo.grad_clip=0.5", f"{DS}={value}"])
    assert err.value.key == DS and words in str(err.value)


def test_deepspeed_config_entries_that_restate_a_key_or_tune_its_section_are_taken():
    """An entry equal to what a key sets is no conflict, and an offload section's own
    options (pin_memory) are the user's; entries another key sets are left out of every
    engine's config (the critic has no hybrid engine, the partitioned reference its own
    stage), the rest goes into each."""
    from oppo_ds.engines.ds_config import engine_entries, without_owned

    with pytest.raises(ConfigError, match="needs backend: deepspeed, got backend: megatron"):
        load_config(None, ["system.backend=megatron", f"{DS}={{overlap_comm: true}}"])
    entries = ("{zero_optimization: {stage: 2, offload_optimizer: {device: cpu, pin_memory: "
               "false}}, gradient_clipping: 1.0, hybrid_engine: {enabled: true, "
               "pin_parameters: false}}")
    cfg = load_config(None, ["system.zero_stage=2", "system.offload=true",
                             "system.hybrid_engine=true", f"{DS}={entries}"])
    assert without_owned(cfg.system.deepspeed_config) == {
        "zero_optimization": {"offload_optimizer": {"pin_memory": False}},
        "hybrid_engine": {"pin_parameters": False}}
    # the hybrid engine's tensor parallel over more ranks than the check's one
    load_config(None, ["system.hybrid_engine=true", "system.inference_tp_size=2",
                       f"{DS}={{communication_data_type: fp32}}"])
    # an entry of ZeRO-1/2 alone: the evaluation's stage-0 actor is built without ZeRO's
    cfg = load_config(None, ["system.zero_stage=2", "ppo.grad_clip=0",
                             f"{DS}={{zero_optimization: {{compute_grad_norm: false}}, "
                             "communication_data_type: fp32}"])
    assert engine_entries(cfg.system.deepspeed_config, 0) == {"communication_data_type": "fp32"}
    assert engine_entries(cfg.system.deepspeed_config, 2) == cfg.system.deepspeed_config
    # options of an offload section that offloads nothing change nothing
    load_config(None, ["system.zero_stage=1",
                       f"{DS}={{zero_optimization: {{offload_optimizer: {{pin_memory: false}}}}}}"])
    # but part of the optimizer stepped by DeepSpeed's own AdamW is another optimizer
    with pytest.raises(ConfigError, match="offload_optimizer.ratio is set by system.offload"):
        load_config(None, ["system.zero_stage=3", "system.offload=true",
                           f"{DS}={{zero_optimization: {{offload_optimizer: {{ratio: 0.5}}}}}}"])


def test_deepspeed_config_entries_are_read_as_numbers_and_unknown_keys_warned(caplog):
    """YAML 1.1 reads `5e7` as text; DeepSpeed's integer fields refuse text. A key DeepSpeed's
    config check does not read, and that is like none it reads, is a warning (some of its
    parts read keys of their own)."""
    import logging

    with caplog.at_level(logging.WARNING):
        cfg = load_config(None, [f"{DS}.zero_optimization.reduce_bucket_size=5e7",
                                 f"{DS}.zero_optimization.overlap_comm=true",
                                 f"{DS}.gradient_predivide_factor=2.0", f"{DS}.my_plugin=1"])
    assert cfg.system.deepspeed_config == {
        "zero_optimization": {"reduce_bucket_size": 50000000, "overlap_comm": True},
        "gradient_predivide_factor": 2.0, "my_plugin": 1}
    # text stays text: only YAML 1.1's exponents without a dot or sign are numbers it missed
    cfg = load_config(None, [f"{DS}.tensorboard.job_name='2024'"])
    assert cfg.system.deepspeed_config == {"tensorboard": {"job_name": "2024"}}
    assert [r.getMessage() for r in caplog.records if "deepspeed_config" in r.getMessage()] == [
        f"{DS}.my_plugin: DeepSpeed's config check does not read it; it has an effect only if "
        "another part of DeepSpeed does"]


def test_zero_grad_clip_and_zero_workload_training_steps_are_allowed():
    cfg = load_config(None, ["ppo.grad_clip=0", "workload.sft_steps=0", "workload.reward_steps=0",
                             "workload.tail_sigma=0", "ppo.reward_clip=null"])
    assert cfg.ppo.grad_clip == 0.0 and cfg.ppo.reward_clip is None


NUMBER, NUMBER_OR_NULL = "a number", "a number or null"


@pytest.mark.parametrize("override, expected", [
    ("ppo.actor_lr=.inf", NUMBER), ("ppo.clip_eps=.nan", NUMBER), ("ppo.kl_coef=.inf", NUMBER),
    ("generation.temperature=.inf", NUMBER), ("ppo.weight_decay=.nan", NUMBER),
    ("ppo.entropy_coef=-.inf", NUMBER), ("workload.tail_sigma=.inf", NUMBER),
    ("ppo.actor_lr=1e999", NUMBER), ("ppo.kl_coef=" + "9" * 400, NUMBER),
    ("ppo.grad_clip=.inf", NUMBER_OR_NULL), ("eval.temperature=.nan", NUMBER_OR_NULL),
    ("ppo.filter_groups_reward_range=[0, .inf]", "a list of numbers or null"),
    ("ppo.adam_betas=[0.9, .nan]", NUMBER),
])
def test_non_finite_float_rejected(override, expected):
    """.inf and .nan are YAML floats: every float key took them unless a range check happened
    to refuse them (ppo.actor_lr=.inf trained; entropy_coef has no range at all)."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.key == key
    assert str(err.value).endswith(f"expected {expected} (finite: not inf or nan)")


def test_non_finite_float_rejected_in_a_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^ppo\.dual_clip: got inf, expected a number or null"):
        load_config(_write(tmp_path, "ppo:\n  dual_clip: .inf\n"))


def test_seeds_at_the_ends_of_numpys_range_are_taken():
    cfg = load_config(None, ["seed=4294967295", "data.phase_split_seed=0"])
    assert (cfg.seed, cfg.data.phase_split_seed) == (2**32 - 1, 0)


def test_delta_in_rows_is_free_without_a_group_baseline():
    """GAE with several responses per prompt takes rows one by one: any Delta is valid, as it
    is under a group baseline once it is a whole number of prompts."""
    assert load_config(None, ["data.samples_per_prompt=4", "oppo.overcommit=3"]).oppo.overcommit == 3
    assert load_config(None, ["data.samples_per_prompt=4", "oppo.overcommit=auto",
                              "oppo.delta_max=6"]).oppo.delta_max == 6
    cfg = load_config(None, ["ppo.advantage_estimator=rloo", "data.samples_per_prompt=4",
                             "oppo.overcommit=auto", "oppo.delta_min=4", "oppo.delta_max=12"])
    assert (cfg.oppo.delta_min, cfg.oppo.delta_max) == (4, 12)
    # without overcommitment the bounds are unused and not checked
    assert load_config(None, ["ppo.advantage_estimator=rloo", "data.samples_per_prompt=16"]).oppo.delta_max == 8


def test_critic_free_estimators_take_the_critic_out_of_the_streamed_scorers():
    cfg = load_config(None, ["ppo.advantage_estimator=rloo", "data.samples_per_prompt=4",
                             "oppo.streaming=true"])
    assert cfg.oppo.stream_to == ["reference", "actor"] and not cfg.ppo.uses_critic
    assert cfg.streamed_scorers == ["reward", "reference"]
    # the KL off: no reference streams either (and none is built)
    off = load_config(None, ["ppo.advantage_estimator=rloo", "data.samples_per_prompt=4",
                             "oppo.streaming=true", "ppo.kl_coef=0"])
    assert off.oppo.stream_to == ["actor"] and off.streamed_scorers == ["reward"]
    assert not off.ppo.uses_reference and cfg.ppo.uses_reference
    # REINFORCE has no baseline: one response per prompt is enough
    assert load_config(None, ["ppo.advantage_estimator=reinforce"]).data.samples_per_prompt == 1
    assert load_config(None, []).ppo.uses_critic
    import typing

    from oppo_ds.algo import LOSS_AGG_MODES, RATIO_LEVELS
    hints = typing.get_type_hints(PPOConfig)
    assert typing.get_args(hints["loss_agg_mode"]) == LOSS_AGG_MODES  # the loss knows each mode
    assert typing.get_args(hints["importance_sampling_level"]) == RATIO_LEVELS
    from oppo_ds.algo import CRITIC_FREE_ESTIMATORS, GROUP_ESTIMATORS  # they agree with config's
    assert {e for e in ("gae", *CRITIC_FREE_ESTIMATORS) if PPOConfig(advantage_estimator=e).group_baseline} == \
        set(GROUP_ESTIMATORS)


def test_validation_runs_on_direct_construction():
    with pytest.raises(ValueError, match="mini_batch_size"):
        PPOConfig(batch_size=10, mini_batch_size=4)
    assert PPOConfig(batch_size=12, mini_batch_size=4, micro_batch_size=2).batch_size == 12


def test_top_level_yaml_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="must hold a mapping") as err:
        load_config(_write(tmp_path, "- steps\n- 5\n"))
    assert err.value.key == "--config"


@pytest.mark.parametrize("text", ["# nothing here\n", "", "\n\n"])
def test_empty_yaml_gives_defaults_and_says_so(tmp_path, caplog, text):
    path = _write(tmp_path, text)
    with caplog.at_level("WARNING", logger="oppo_ds.config_yaml"):
        assert load_config(path) == Config()
    assert [r.getMessage() for r in caplog.records] == [
        f"--config {path} sets no key (empty or only comments): every key has its default"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="oppo_ds.config_yaml"):
        load_config(_write(tmp_path, "steps: 3\n"))
    assert not caplog.records


def test_a_section_of_only_comments_is_empty_and_says_so(tmp_path, caplog):
    """`model:` with its keys commented out is null to YAML: it stopped the run with
    "model: expected a mapping, got None", though an empty file only warns."""
    path = _write(tmp_path, "model:\n  # actor: x\nppo:\n  kl_coef: 0.1\n")
    with caplog.at_level("WARNING", logger="oppo_ds.config"):
        cfg = load_config(path)
    assert cfg.model == ModelConfig() and cfg.ppo.kl_coef == 0.1
    assert [r.getMessage() for r in caplog.records] == [
        "model: the section is empty (null, or only comments): every key in it has its default"]
    with pytest.raises(ConfigError, match="^model: expected a mapping, got 3"):
        load_config(None, ["model=3"])


@pytest.mark.parametrize("text, key, lines", [
    ("steps: 4\nsteps: 5\n", "steps", "lines 1 and 2"),
    ("ppo:\n  kl_coef: 0.1\nseed: 1\nppo:\n  batch_size: 8\n", "ppo", "lines 1 and 4"),
    ("ppo:\n  kl_coef: 0.1\n  batch_size: 8\n  kl_coef: 0.2\n", "ppo.kl_coef", "lines 2 and 4"),
    ("data:\n  prompts: [{a: 1, a: 2}]\n", "data.prompts[0].a", "lines 2 and 2"),
    ("ppo: {kl_coef: 0.1, kl_coef: 0.2}\n", "ppo.kl_coef", "lines 1 and 1"),
])
def test_key_given_twice_in_yaml(tmp_path, text, key, lines):
    """PyYAML keeps the last of two equal keys: a second `ppo:` section dropped the first
    one's settings without a word."""
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == key
    assert str(err.value) == (f"{key}: given twice in {path} ({lines}); the later one would "
                              "silently replace the earlier: keep one")


def test_yaml_merge_key_may_be_overridden(tmp_path):
    """A key beside a merge (`<<: *gen`) replaces the merged one: not a key given twice."""
    path = _write(tmp_path, "generation: &gen {temperature: 0.7, top_p: 0.9}\n"
                            "eval:\n  <<: *gen\n  temperature: 0.5\n")
    with pytest.raises(ConfigError, match="^eval.top_p: unknown key"):  # merged, so read
        load_config(path)
    path = _write(tmp_path, "generation: &gen {temperature: 0.7}\n"
                            "eval:\n  <<: *gen\n  temperature: 0.5\n")
    cfg = load_config(path)
    assert cfg.generation.temperature == 0.7 and cfg.eval.temperature == 0.5


def test_config_file_not_utf8(tmp_path):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfesteps: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert err.value.key == "--config"
    assert str(err.value) == (f"--config: {path} is not UTF-8 text (byte 0xff at offset 0); "
                              "save it as UTF-8")


@pytest.mark.parametrize("override", ["=5", " =5", "ppo.=5", ".kl_coef=1", "ppo..kl_coef=1"])
def test_override_without_a_key_is_malformed(override):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value) == (f"malformed override {override!r}: expected KEY=VALUE with a "
                              "dotted key, e.g. ppo.kl_coef=0.05")


def test_missing_file():
    with pytest.raises(ConfigError, match="no such file: /nonexistent/x.yaml"):
        load_config("/nonexistent/x.yaml")


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read") as err:
        load_config(str(tmp_path))
    assert err.value.key == "--config"


@pytest.mark.parametrize("text, where", [
    ("# run\nppo:\n  kl_coef 0.1\n  clip_eps: 0.2\n", "4:11: mapping values are not allowed here"),
    ("ppo:\n\tkl_coef: 0.1\n", "2:1: found character '\\t' that cannot start any token"),
    ("ppo: [unclosed\n", "2:1: expected ',' or ']', but got '<stream end>' (while parsing a "
                         "flow sequence started at 1:6)"),
])
def test_invalid_yaml_names_file_line_and_column(tmp_path, text, where):
    """PyYAML's first line was all the message kept: the problem without its place, or only
    the context ("while scanning for the next token") for a tab."""
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"--config: {path}:{where}"


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_trust_remote_code_off_by_default():
    assert ModelConfig().trust_remote_code is False
    assert load_config(None).model.trust_remote_code is False


# ---------------------------------------------------------------- command line

def _run_cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "oppo_ds.train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("override, words", [
    ("ppo.kl_cof=0.1", "did you mean 'kl_coef'"),
    ("system.zero_stage=7", "one of 0, 1, 2, 3"),
])
def test_cli_bad_key_is_one_line_exit_2(override, words):
    key = override.split("=")[0]
    proc = _run_cli(override)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"oppo-train: error: {key}:")
    assert words in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 trains on a GPU; the refusal is a CPU's")
def test_fp16_on_a_cpu_is_one_line_exit_2(tmp_path):
    """DeepSpeed refuses fp16 on a CPU in its own sanity check ("Type fp16 is not supported on
    your device."), a traceback after the models were loaded; now the one-line error."""
    from _builders import tiny_run_overrides

    proc = _run_cli(*tiny_run_overrides(tmp_path, steps=1), "system.dtype=fp16")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "oppo-train: error: system.dtype: fp16 needs a GPU: on a CPU DeepSpeed trains in fp32 or bf16 "
        "(bf16 keeps fp32's range)")
    assert "Traceback" not in proc.stderr


def test_model_parallel_sizes_the_launch_cannot_hold(tmp_path):
    """tensor_parallel x pipeline_parallel must divide the processes: megatron_tiny.yaml
    (tp 2) started as one process stops before anything is prepared, naming the key and how
    to launch it (was a ValueError traceback from megatron's group setup, after the workload's
    SFT and reward-model training)."""
    cfg = load_config(None, ["system.backend=megatron", "system.tensor_parallel=2",
                             "system.pipeline_parallel=3"])
    cfg.system.check_world(12)
    with pytest.raises(ConfigError, match=r"tensor_parallel: 2 x pipeline_parallel 3 = 6 processes "
                                          r"per model replica, but this run has 4"):
        cfg.system.check_world(4)
    proc = _run_cli("--config", "examples/configs/megatron_tiny.yaml",
                    f"logging.output_dir={tmp_path / 'run'}", f"workload.cache_dir={tmp_path / 'cache'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("oppo-train: error: system.tensor_parallel: 2 x pipeline_parallel 1 = 2 processes per "
            "model replica, but this run has 1: launch a multiple of 2 (deepspeed --num_gpus 2") in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "cache").exists()


def test_cli_output_dir_that_cannot_be_one(tmp_path, capsys):
    """A logging.output_dir that is a file (or under one) stops with one line naming the key,
    before anything is built (was a FileExistsError traceback from the trainer)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    assert train_main(["steps=1", f"logging.output_dir={afile}"]) == 2
    assert capsys.readouterr().err == f"oppo-train: error: logging.output_dir: {afile} is a file, not a directory\n"
    assert train_main(["steps=1", f"logging.output_dir={afile / 'run'}"]) == 2
    assert capsys.readouterr().err == f"oppo-train: error: logging.output_dir: {afile / 'run'}: Not a directory\n"


def test_cli_expands_home_in_every_path_key(tmp_path, monkeypatch, capsys):
    """`model.actor: ~/ckpt` was taken literally ("is not a local directory"): every path
    key now reads `~` as a shell would, once, when the config is built."""
    monkeypatch.setenv("HOME", str(tmp_path))
    keys = {"model.actor": "~/actor", "model.reference": "~/ref", "model.reward": "~/rm",
            "model.critic": "~/critic", "model.tokenizer": "~/tok", "data.prompts": "~/p.jsonl",
            "eval.prompts": "[~/e.jsonl, e2.jsonl]", "data.ptx": "~/ptx.txt",
            "logging.output_dir": "~/run", "workload.cache_dir": "~/cache"}
    overrides = [f"{k}={v}" for k, v in keys.items()] + ["ppo.ptx_coef=0.1"]
    assert train_main(["--print-config", *overrides]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    for key, value in keys.items():
        section, name = key.split(".")
        want = value.replace("~", str(tmp_path))
        assert printed[section][name] == (yaml.safe_load(want) if "[" in want else want), key


@pytest.mark.parametrize("override, hint", [
    ("model.tokenizer=", "null for the default"),
    ("model.reference=''", "null for the default"),
    ("model.actor=", "leave the key out for its default, 'builtin'"),
    ("workload.cache_dir=''", "leave the key out for its default, '.cache/oppo-builtin'"),
])
def test_cli_empty_path_is_refused_naming_the_key(override, hint, capsys):
    """An unset shell variable (`model.tokenizer=$TOK`) gave an empty string, silently taken
    as null; workload.cache_dir='' failed later with "[Errno 2] No such file or directory: ''"."""
    assert train_main(["--print-config", override]) == 2
    key = override.split("=")[0]
    assert capsys.readouterr().err == (f"oppo-train: error: {key}: an empty path (an unset shell "
                                       f"variable?): give a path, or {hint}\n")


@pytest.mark.parametrize("key, source", [
    ("actor", "actor"), ("critic", "critic"), ("reference", "actor_ema"),
    ("tokenizer", "actor/tok"), ("reward", "critic"),
])
def test_cli_refuses_an_export_that_would_replace_a_model_source(tmp_path, capsys, key, source):
    """logging.output_dir=/x with model.actor=/x/actor: the final export deleted the source
    checkpoint and wrote the trained actor in its place."""
    (tmp_path / source).mkdir(parents=True)
    folder = source.split("/")[0]
    argv = [f"logging.output_dir={tmp_path}", f"model.{key}={tmp_path / source}"]
    assert train_main(argv) == 2  # before anything is built
    assert capsys.readouterr().err == (
        f"oppo-train: error: logging.output_dir: the final export (checkpoint.export_hf) replaces "
        f"{tmp_path / folder}, which holds model.{key} ({tmp_path / source}): the run would "
        f"delete its own source; choose another logging.output_dir, or set "
        f"checkpoint.export_hf: false\n")
    assert not os.path.exists(tmp_path / "metrics.jsonl")
    # oppo-train --evaluate exports nothing: it may evaluate a run's exported actor there
    check_export_targets(load_config(None, [*argv, "checkpoint.export_hf=false"]))
    # a run built in Python is refused as well, before anything is built
    from oppo_ds.trainer import PPOTrainer

    with pytest.raises(ConfigError, match=f"holds model.{key}"):
        PPOTrainer(load_config(None, argv))


def test_a_model_source_beside_the_export_folders_is_fine(tmp_path):
    (tmp_path / "actor").mkdir()
    (tmp_path / "sft").mkdir()
    # the run directory inside the source, or the source beside the export folders: no loss
    check_export_targets(load_config(None, [f"logging.output_dir={tmp_path / 'actor'}",
                                            f"model.actor={tmp_path / 'actor'}"]))
    check_export_targets(load_config(None, [f"logging.output_dir={tmp_path}",
                                            f"model.actor={tmp_path / 'sft'}"]))
    # a link to the export folder is the export folder
    os.symlink(tmp_path / "actor", tmp_path / "link")
    with pytest.raises(ConfigError, match="holds model.actor"):
        check_export_targets(load_config(None, [f"logging.output_dir={tmp_path}",
                                                f"model.actor={tmp_path / 'link'}"]))


def test_cli_main_returns_2(capsys):
    assert train_main(["--config", "/nonexistent.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oppo-train: error: --config: no such file") and err.count("\n") == 1


def test_exit_process_runs_atexit_and_flushes_before_it_exits():
    """oppo-train ends through exit_process (no interpreter finalization, see its docstring):
    what a run left in stdout's buffer and the atexit handlers (TensorBoard's, logging's) must
    still come out, and the code must be main's."""
    code = ("import atexit, logging, sys\n"
            "from oppo_ds.cli.train import exit_process\n"
            "atexit.register(lambda: print('atexit ran'))\n"
            "logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
            "logging.getLogger('x').warning('logged')\n"
            "print('buffered', end='')\n"
            "exit_process(3)\n"
            "print('never')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "bufferedatexit ran\n"
    assert proc.stderr == "logged\n"


def test_cli_print_config_round_trips(tmp_path, capsys):
    overrides = ["ppo.kl_coef=0.125", "system.zero_stage=2", "model.reference=null",
                 "ppo.actor_lr=1e-6", "steps=3"]
    assert train_main(["--print-config", *overrides]) == 0
    printed = capsys.readouterr().out
    path = _write(tmp_path, printed)
    reloaded = load_config(path)
    assert reloaded == load_config(None, overrides)
    assert reloaded.ppo.kl_coef == 0.125 and reloaded.system.zero_stage == 2
    assert dataclasses.asdict(reloaded) == yaml.safe_load(printed)


def test_cli_print_config_subprocess():
    proc = _run_cli("--config", "examples/configs/tiny.yaml", "--print-config", "seed=9")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    with open(os.path.join(ROOT, "examples", "configs", "tiny.yaml")) as f:
        every = yaml.safe_load(f)["checkpoint"]["every"]
    assert printed["seed"] == 9 and printed["checkpoint"]["every"] == every


def test_cli_help():
    proc = _run_cli("--help")
    assert proc.returncode == 0
    assert "--config" in proc.stdout and "--print-config" in proc.stdout


def test_only_rank_0_shows_transformers_progress_bars(monkeypatch):
    """Each rank drew its own 'Loading weights' bar per model (eight ranks, four models: 32
    bars interleaved); rank 0's stay, on a terminal: into a log file a bar writes carriage
    returns, as the trainer's own bar would."""
    import logging

    from transformers.utils import logging as hf_logging

    from oppo_ds.cli.train import _quiet_libraries

    root = logging.getLogger()
    saved = root.level, list(root.handlers), os.environ.get("TRANSFORMERS_VERBOSITY"), os.environ.get("HF_HUB_OFFLINE")
    try:
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
        _quiet_libraries(0)
        assert hf_logging.is_progress_bar_enabled()
        _quiet_libraries(1)
        assert not hf_logging.is_progress_bar_enabled()
        hf_logging.enable_progress_bar()
        monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
        _quiet_libraries(0)
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        for key, value in zip(("TRANSFORMERS_VERBOSITY", "HF_HUB_OFFLINE"), saved[2:]):
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_a_lora_learning_rate_needs_lora():
    """model.lora_learning_rate without a LoRA dim trains nothing at it: refused, not ignored."""
    with pytest.raises(ConfigError, match=r"model\.lora_learning_rate: 0\.0005 needs "
                                          r"actor_lora_dim or critic_lora_dim > 0"):
        load_config(None, ["model.lora_learning_rate=5e-4"])
    assert load_config(None, ["model.lora_learning_rate=5e-4", "model.critic_lora_dim=4"]
                       ).model.lora_learning_rate == 5e-4
