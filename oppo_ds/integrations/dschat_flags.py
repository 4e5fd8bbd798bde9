"""DeepSpeed-Chat step 3's command-line flags, for ``oppo-train``.

A DeepSpeed-Chat step-3 run script works with ``oppo-train`` by changing its command: every
flag of ``training/step3_rlhf_finetuning/main.py`` (DeepSpeedExamples 3d83278) is accepted.
Each flag is one of
  * mapped onto config keys (``dschat_overrides`` turns the given flags into dotted
    overrides, applied before the command line's own ``key=value`` overrides, which win);
  * accepted with no effect: a warning names the flag and says why;
  * refused: an error names the flag and says why (a feature oppo-ds does not have).
Flags not given change nothing: oppo-ds's own defaults hold (e.g. ``system.dtype: fp32``,
where DeepSpeed-Chat's default is fp16); the exception is ``--data_split``, whose default
2,4,4 applies with ``--data_path`` because it decides which prompts DeepSpeed-Chat reads. Conflicts our single keys cannot express (actor and
critic ZeRO stages, weight decays or LoRA scopes that differ) are errors naming both flags.
DeepSpeed-Chat's PPO constants, fixed in its code (``DSCHAT_CONSTANTS``: kl_ctl 0.1, no
whitening of advantages, ...), replace oppo-ds's defaults (``dschat_constants``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Optional, Union

from ..config import ConfigError

MAPPED, IGNORED, REFUSED = "mapped", "ignored", "refused"


@dataclass(frozen=True)
class Flag:
    name: str
    kind: str                   # MAPPED / IGNORED / REFUSED
    note: str                   # what it maps to, or why it has no effect / is refused
    type: Optional[Callable] = None  # None: a switch (store_true)
    nargs: Optional[str] = None
    choices: Optional[tuple] = None


def _f(name, kind, note, type=None, **kw) -> Flag:
    return Flag(name, kind, note, type, **kw)


def positive_int(text: str) -> int:
    """An integer >= 1 (--oppo_sync_every)."""
    return _bounded_int(text, 1)


def auto_int(text: str) -> Union[int, str]:
    """``auto`` or an integer >= 0 (--oppo_chunk_size, --oppo_overcommit)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    return _bounded_int(text, 0, " or auto")


def _bounded_int(text: str, least: int, alternative: str = "") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer{alternative}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}{alternative}, got {value}")
    return value


FLAGS: tuple[Flag, ...] = (
    _f("actor_model_name_or_path", MAPPED, "model.actor (and the reference)", str),
    _f("critic_model_name_or_path", MAPPED, "model.critic and model.reward (both start from the "
       "step-2 checkpoint, as in DeepSpeed-Chat; its RewardModel pytorch_model.bin is converted "
       "once into output_dir/dschat_converted/critic)", str),
    _f("data_path", MAPPED, "data.prompts: local .jsonl/.json/.csv/.tsv/.parquet files, datasets "
       "save_to_disk directories or hub snapshots (DeepSpeed-Chat's JSON array files too), one or "
       "several (their prompts together); nothing is downloaded. A path naming a data set "
       "DeepSpeed-Chat knows gets that set's prompts as its step 3 builds them, a .json file "
       "its local/jsonfile prompts (data.deepspeed_chat_formats: true). Prompts are tokenized "
       "as they are (data.chat_template: off), as DeepSpeed-Chat does", str,
       nargs="*"),
    _f("enable_ema", MAPPED, "model.actor_ema: true, an average of the actor's weights (decay "
       "0.992, as DeepSpeed-Chat's) exported to output_dir/actor_ema"),
    _f("unsupervised_dataset_name", MAPPED, "data.ptx (PPO-ptx, with "
       "--unsupervised_dataset_config_name): a local copy of the pretraining text (its train "
       "split's text field), cut into blocks of --max_prompt_seq_len "
       "+ --max_answer_seq_len tokens as DeepSpeed-Chat cuts it; its loss joins the actor's PPO "
       "update, where DeepSpeed-Chat takes an optimizer step of its own on it", str),
    _f("unsup_coef", MAPPED, "ppo.ptx_coef, with --unsupervised_dataset_name (DeepSpeed-Chat's "
       "default 27.8 when not given)", float),
    _f("unsupervised_dataset_config_name", MAPPED, "with --unsupervised_dataset_name, switches "
       "PPO-ptx on, as DeepSpeed-Chat trains on the data set only when both are given; where "
       "the local copy holds a folder of that name (a hub snapshot's configurations: "
       "wikitext-2-raw-v1/, wikitext-103-raw-v1/), that folder is read", str),
    _f("print_answers", MAPPED, "logging.print_samples: true, every --print_answers_interval "
       "steps (logging.samples_every, 1 when not given, as in DeepSpeed-Chat): logging.samples "
       "(2) responses of rank 0's batch with their prompts and rewards, where DeepSpeed-Chat "
       "prints every rank's whole batch; output_dir/samples.jsonl has them too"),
    _f("print_answers_interval", MAPPED, "logging.samples_every, with --print_answers", int),
    _f("data_split", MAPPED, "data.phase_split, with --data_path (DeepSpeed-Chat's default 2,4,4 "
       "when not given): of each source only the third part, step 3's, is read, cut as "
       "DeepSpeed-Chat cuts it, so the same --seed gives the same prompts", str),
    _f("per_device_generation_batch_size", MAPPED, "ppo.batch_size (times "
       "--generation_batches)", int),
    _f("per_device_training_batch_size", MAPPED, "ppo.micro_batch_size; ppo.mini_batch_size is "
       "this times --gradient_accumulation_steps (one optimizer step per micro-batch)", int),
    _f("generation_batches", MAPPED, "multiplies ppo.batch_size", int),
    _f("gradient_accumulation_steps", MAPPED, "ppo.mini_batch_size = training batch x this", int),
    _f("ppo_epochs", MAPPED, "ppo.ppo_epochs", int),
    _f("max_prompt_seq_len", MAPPED, "generation.max_prompt_len, longer prompts skipped "
       "(data.overlong: skip), as DeepSpeed-Chat filters them", int),
    _f("max_answer_seq_len", MAPPED, "generation.max_new_tokens", int),
    _f("actor_learning_rate", MAPPED, "ppo.actor_lr", float),
    _f("critic_learning_rate", MAPPED, "ppo.critic_lr", float),
    _f("actor_weight_decay", MAPPED, "ppo.weight_decay (must equal --critic_weight_decay)", float),
    _f("critic_weight_decay", MAPPED, "ppo.weight_decay (must equal --actor_weight_decay)", float),
    _f("lr_scheduler_type", MAPPED, "ppo.lr_schedule (constant, linear, cosine; "
       "constant_with_warmup = constant with --num_warmup_steps, which plain constant ignores "
       "as in DeepSpeed-Chat; others refused)", str,
       choices=("linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                "constant_with_warmup")),
    _f("num_warmup_steps", MAPPED, "ppo.warmup_steps, at most the run's optimizer updates "
       "(a longer warm-up is capped, with a warning: DeepSpeed-Chat sizes its schedule from "
       "whole epochs, also when --enable_test_mode stops it early)", int),
    _f("num_train_epochs", MAPPED, "steps = epochs x prompts / (batch x ranks), counted from "
       "--data_path (steps=N overrides it)", int),
    _f("output_dir", MAPPED, "logging.output_dir; the final actor and critic go to "
       "output_dir/actor and output_dir/critic, as in DeepSpeed-Chat", str),
    _f("seed", MAPPED, "seed", int),
    _f("enable_hybrid_engine", MAPPED, "system.hybrid_engine: true"),
    _f("inference_tp_size", MAPPED, "system.inference_tp_size", int),
    _f("offload", MAPPED, "system.offload: true"),
    _f("offload_reference_model", MAPPED, "system.partition_reference and "
       "system.offload_reference: true (needs ZeRO stage 3); with --enable_oppo, reference "
       "left out of oppo.stream_to (a partitioned reference cannot stream)"),
    _f("dtype", MAPPED, "system.dtype (not given: oppo-ds's fp32, not DeepSpeed-Chat's fp16)",
       str, choices=("fp16", "bf16", "fp32")),
    _f("actor_zero_stage", MAPPED, "system.zero_stage (one stage for actor and critic: the "
       "stages given must agree)", int, choices=(0, 1, 2, 3)),
    _f("critic_zero_stage", MAPPED, "system.zero_stage (must agree with --actor_zero_stage)",
       int, choices=(0, 1, 2, 3)),
    _f("actor_gradient_checkpointing", MAPPED, "system.gradient_checkpointing (actor and critic)"),
    _f("critic_gradient_checkpointing", MAPPED, "system.gradient_checkpointing (actor and critic)"),
    _f("actor_lora_dim", MAPPED, "model.actor_lora_dim; with either LoRA dim, model.lora_alpha: "
       "1 (DeepSpeed-Chat scales the update by 1 / dim) and model.lora_learning_rate (see "
       "--actor_lora_learning_rate)", int),
    _f("critic_lora_dim", MAPPED, "model.critic_lora_dim (and model.lora_alpha: 1, as with "
       "--actor_lora_dim)", int),
    _f("actor_lora_module_name", MAPPED, "model.lora_module_name (one scope for both)", str),
    _f("critic_lora_module_name", MAPPED, "model.lora_module_name (must equal the actor's)", str),
    _f("only_optimize_lora", MAPPED, "model.only_optimize_lora: true"),
    _f("enable_tensorboard", MAPPED, "logging.tensorboard: true (events in "
       "output_dir/tensorboard)"),
    _f("enable_test_mode", MAPPED, "steps: those of --test_stop_step, within one epoch (the "
       "first epoch without it), as DeepSpeed-Chat stops"),
    _f("test_stop_step", MAPPED, "with --enable_test_mode: steps = N / --generation_batches "
       "(rounded down, at least 1; DeepSpeed-Chat counts generation batches), at most one "
       "epoch's", int),
    _f("enable_oppo", MAPPED, "oppo.streaming: true, with --oppo_chunk_size and "
       "--oppo_overcommit (the patched DeepSpeed-Chat's flags)"),
    _f("oppo_chunk_size", MAPPED, "oppo.chunk_size (an integer or auto), with --enable_oppo",
       auto_int),
    _f("oppo_overcommit", MAPPED, "oppo.overcommit (Delta: an integer or auto, auto within "
       "[0, B/4]: oppo.delta_max = a quarter of the batch flags' batch), with --enable_oppo",
       auto_int),
    _f("oppo_placement", MAPPED, "oppo.placement (inline or colocated; auto = the config's), "
       "with --enable_oppo", str, choices=("auto", "inline", "colocated")),
    _f("oppo_sync_every", MAPPED, "generation.sync_every (tokens between two host checks of "
       "ended responses), with --enable_oppo", positive_int),
    _f("oppo_static_cache", MAPPED, "generation.static_cache (every decode forward at one "
       "shape), with --enable_oppo"),
    _f("oppo_cuda_graph", MAPPED, "generation.cuda_graph (the one-token forward replayed as a "
       "CUDA graph; needs --oppo_static_cache), with --enable_oppo"),
    _f("oppo_cudnn_attention", MAPPED, "system.cudnn_attention (torch's cuDNN attention, which "
       "plans every new shape, allowed), with --enable_oppo"),
    _f("deepspeed", IGNORED, "oppo-train always runs on DeepSpeed"),
    # deepspeed.add_config_arguments, which step 3's main.py calls, adds these two as well
    _f("deepscale", IGNORED, "DeepSpeed's deprecated --deepspeed; oppo-train always runs on "
       "DeepSpeed"),
    _f("deepscale_config", IGNORED, "DeepSpeed's deprecated --deepspeed_config; the file is not "
       "read (nor by DeepSpeed-Chat, whose engines get the config it builds): the DeepSpeed "
       "config is built from the oppo-ds config (system.* keys; entries of your own: "
       "system.deepspeed_config)", str),
    _f("tensorboard_path", IGNORED, "TensorBoard events go to output_dir/tensorboard", str),
    _f("data_output_path", IGNORED, "oppo-train keeps no data index files", str),
    _f("preprocessing_num_workers", IGNORED, "prompts are tokenized in-process", int),
    _f("num_padding_at_beginning", IGNORED, "the reward is read at the last response token, "
       "not found by counting pads", int),
    _f("end_of_conversation_token", IGNORED, "responses end at the tokenizer's EOS", str),
    _f("add_eot_token", IGNORED, "the tokenizer is used as saved"),
    _f("actor_dropout", IGNORED, "oppo-train switches dropout off in every model (PPO ratios "
       "compare two forwards of the same weights)", float),
    _f("critic_dropout", IGNORED, "see --actor_dropout", float),
    _f("actor_lora_learning_rate", MAPPED, "model.lora_learning_rate (the LoRA matrices' own "
       "optimizer group), with --actor_lora_dim > 0; DeepSpeed-Chat's default 5e-4 when not "
       "given. One key for both models: where both have LoRA the two rates must agree", float),
    _f("critic_lora_learning_rate", MAPPED, "model.lora_learning_rate, with --critic_lora_dim "
       "> 0 (default 5e-4; must agree with the actor's where both have LoRA)", float),
    _f("compute_fp32_loss", IGNORED, "the PPO losses are reduced in fp32 already"),
    _f("align_overflow", IGNORED, "actor and critic keep their own loss scales"),
    _f("offload_reward_model", IGNORED, "the reward model stays on the device (it streams)"),
    _f("unpin_actor_parameters", MAPPED, "system.deepspeed_config.hybrid_engine.pin_parameters: "
       "false (the hybrid engine's, as in DeepSpeed-Chat)"),
    _f("release_inference_cache", MAPPED, "system.deepspeed_config.hybrid_engine."
       "release_inference_cache: true"),
    _f("tp_gather_partition_size", MAPPED, "system.deepspeed_config.hybrid_engine."
       "tp_gather_partition_size", int),
    _f("enable_mixed_precision_lora", REFUSED, "ZeRO++ quantized LoRA weights are not supported"),
    _f("deepspeed_config", REFUSED, "the DeepSpeed config is built from the oppo-ds config "
       "(system.* keys; entries of your own: system.deepspeed_config)", str),
)
BY_NAME = {f.name: f for f in FLAGS}


def add_dschat_flags(parser: argparse.ArgumentParser) -> None:
    """Add every DeepSpeed-Chat step-3 flag (default: not given) with its mapping as help."""
    group = parser.add_argument_group(
        "DeepSpeed-Chat step-3 flags",
        "A DeepSpeed-Chat step-3 command line works as it is; each flag maps onto config keys, "
        "or says that it has no effect or is refused (see docs/deepspeed-chat.md).")
    for flag in FLAGS:
        tag = {MAPPED: "", IGNORED: "[no effect] ", REFUSED: "[refused] "}[flag.kind]
        kw = dict(dest=flag.name, default=argparse.SUPPRESS,
                  help=tag + flag.note.replace("%", "%%"))
        if flag.type is None:
            group.add_argument(f"--{flag.name}", action="store_true", **kw)
        else:
            metavar = {int: "N", float: "X", auto_int: "N|auto"}.get(flag.type, "S")
            if flag.choices:
                metavar = "{" + ",".join(map(str, flag.choices)) + "}"
            group.add_argument(f"--{flag.name}", type=flag.type, nargs=flag.nargs,
                               choices=flag.choices, metavar=metavar, **kw)


def given_flags(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in BY_NAME if hasattr(args, name)}


def _agree(flags: dict, a: str, b: str):
    """The value of flags a and b (either may be absent); both given and different: error."""
    if a in flags and b in flags and flags[a] != flags[b]:
        raise ConfigError(f"--{a}", f"{flags[a]!r} differs from --{b} {flags[b]!r}: oppo-train has "
                                    f"one setting for both models; give them the same value")
    return flags.get(a, flags.get(b))


def dschat_overrides(flags: dict) -> tuple[list[str], list[str]]:
    """(dotted overrides, warnings) for the DeepSpeed-Chat flags given ({name: value}).
    Raises ``ConfigError`` naming the flag for refused flags and conflicts. The flags that
    need the rest of the config come later: ``steps_from_flags``, ``warmup_within``."""
    out: dict[str, object] = {}
    warnings = []
    for name, value in flags.items():
        flag = BY_NAME[name]
        if flag.kind == REFUSED and value not in (False, None):
            raise ConfigError(f"--{name}", f"not supported by oppo-train: {flag.note}")
        if flag.kind == IGNORED and value not in (False, None):
            warnings.append(f"--{name} has no effect in oppo-train: {flag.note}")
    epochs = flags.get("num_train_epochs")
    if epochs is not None and epochs < 1:  # else `steps: 1` whatever it was
        raise ConfigError("--num_train_epochs", f"must be >= 1 (passes over the prompts), got "
                                                f"{epochs}")
    if flags.get("seed") is not None and not 0 <= flags["seed"] < 2**32:  # numpy's range
        raise ConfigError("--seed", f"must be in [0, 2**32 - 1] (a 32-bit seed), got "
                                    f"{flags['seed']}")

    def put(key, value):
        out[key] = value

    simple = {"actor_model_name_or_path": "model.actor", "ppo_epochs": "ppo.ppo_epochs",
              "max_answer_seq_len": "generation.max_new_tokens",
              "actor_learning_rate": "ppo.actor_lr", "critic_learning_rate": "ppo.critic_lr",
              "output_dir": "logging.output_dir",
              "seed": "seed", "inference_tp_size": "system.inference_tp_size",
              "dtype": "system.dtype", "actor_lora_dim": "model.actor_lora_dim",
              "critic_lora_dim": "model.critic_lora_dim"}
    _lora(flags, put, warnings)
    for name, key in simple.items():
        if name in flags:
            put(key, flags[name])
    switches = {"enable_hybrid_engine": "system.hybrid_engine", "offload": "system.offload",
                "enable_ema": "model.actor_ema",
                "only_optimize_lora": "model.only_optimize_lora",
                "enable_tensorboard": "logging.tensorboard"}
    for name, key in switches.items():
        if flags.get(name):
            put(key, True)
    hybrid = {"unpin_actor_parameters": ("pin_parameters", False),
              "release_inference_cache": ("release_inference_cache", True),
              "tp_gather_partition_size": ("tp_gather_partition_size", None)}
    for name, (entry, value) in hybrid.items():  # as DeepSpeed-Chat writes its section
        if flags.get(name) in (None, False):
            continue
        if not flags.get("enable_hybrid_engine"):
            warnings.append(f"--{name} has no effect without --enable_hybrid_engine")
            continue
        put(f"system.deepspeed_config.hybrid_engine.{entry}",
            flags[name] if value is None else value)
    if "data_path" in flags:
        # DeepSpeed-Chat's prompts carry their own format ("\n\nHuman: ... \n\nAssistant:") and
        # it tokenizes them as they are; a chat template would wrap them in a second one
        put("data.chat_template", "off")
        put("data.phase_split", phase_weights(flags.get("data_split", DSCHAT_DATA_SPLIT)))
        # its data sets' prompts as it builds them (' Human: ' + field + ' Assistant:', ...)
        put("data.deepspeed_chat_formats", True)
    elif "data_split" in flags:
        warnings.append("--data_split has no effect without --data_path: the built-in "
                        "workload's prompts are all read")
    ptx_flags = ("unsupervised_dataset_name", "unsupervised_dataset_config_name")
    if flags.get(ptx_flags[0]) and not flags.get(ptx_flags[1]):
        warnings.append("--unsupervised_dataset_name has no effect without "
                        "--unsupervised_dataset_config_name: DeepSpeed-Chat trains on it only "
                        "with both, and so does oppo-train")
    elif flags.get(ptx_flags[1]) and not flags.get(ptx_flags[0]):
        warnings.append("--unsupervised_dataset_config_name has no effect without "
                        "--unsupervised_dataset_name")
    elif flags.get(ptx_flags[0]):
        path = flags["unsupervised_dataset_name"]
        if not os.path.exists(path):
            raise ConfigError("--unsupervised_dataset_name", f"{path!r} is not a local file or "
                              "directory (oppo-ds never downloads data sets; save it locally first)")
        config = os.path.join(path, flags["unsupervised_dataset_config_name"])
        if os.path.isdir(config):  # a hub snapshot's folder of that configuration (wikitext's
            path = config          # wikitext-2-raw-v1/ beside wikitext-103-raw-v1/)
        put("data.ptx", path)
        put("ppo.ptx_coef", flags.get("unsup_coef", DSCHAT_UNSUP_COEF))
    if "unsup_coef" in flags and "data.ptx" not in out:
        warnings.append("--unsup_coef has no effect without --unsupervised_dataset_name and "
                        "--unsupervised_dataset_config_name")
    if flags.get("print_answers"):
        put("logging.print_samples", True)
        put("logging.samples_every", flags.get("print_answers_interval", 1))
    elif "print_answers_interval" in flags:
        warnings.append("--print_answers_interval has no effect without --print_answers")
    if "max_prompt_seq_len" in flags:
        put("generation.max_prompt_len", flags["max_prompt_seq_len"])
        put("data.overlong", "skip")
    stage = _agree(flags, "actor_zero_stage", "critic_zero_stage")
    if stage is not None:
        put("system.zero_stage", stage)
    decay = _agree(flags, "actor_weight_decay", "critic_weight_decay")
    if decay is not None:
        put("ppo.weight_decay", decay)
    scope = _agree(flags, "actor_lora_module_name", "critic_lora_module_name")
    if scope is not None:
        put("model.lora_module_name", scope)
    if flags.get("actor_gradient_checkpointing") or flags.get("critic_gradient_checkpointing"):
        put("system.gradient_checkpointing", True)
    if flags.get("offload_reference_model"):
        if stage != 3:
            raise ConfigError("--offload_reference_model", "needs --actor_zero_stage 3 in "
                              "oppo-train (the offloaded reference is a ZeRO-3 partition)")
        put("system.partition_reference", True)
        put("system.offload_reference", True)
        if flags.get("enable_oppo"):
            # its forwards are collective over the ranks, which decode rows of their own: it
            # scores whole sequences after generation, as in DeepSpeed-Chat
            from ..config import OppoConfig

            put("oppo.stream_to", [k for k in OppoConfig().stream_to if k != "reference"])
            warnings.append("--offload_reference_model: the partitioned reference scores whole "
                            "sequences after generation (it cannot stream); oppo.stream_to "
                            "keeps the critic and the actor")
    _oppo(flags, put, warnings)
    _batches(flags, put)
    _schedule(flags, put)
    return [f"{k}={json.dumps(v)}" for k, v in out.items()], warnings


# DeepSpeed-Chat's PPO constants: fixed in its code (dschat/rlhf/ppo_trainer.py,
# DeepSpeedPPOTrainer.__init__: kl_ctl, clip_reward_value, cliprange, cliprange_value, gamma,
# lam; compute_rewards: -kl_ctl * (logp - ref_logp) a token, the clipped score added at the
# end; get_advantages_and_returns: no whitening), so no step-3 flag changes them
DSCHAT_CONSTANTS = {"ppo.kl_coef": 0.1, "ppo.kl_estimator": "k1", "ppo.kl_penalty": "reward",
                    "ppo.kl_target": None, "ppo.reward_clip": 5.0, "ppo.clip_eps": 0.2,
                    "ppo.value_clip_eps": 0.2, "ppo.gamma": 1.0, "ppo.lam": 0.95,
                    "ppo.whiten_advantages": False, "ppo.whiten_rewards": False}


def dschat_constants(config_path: Optional[str]) -> list[str]:
    """Dotted overrides that set DeepSpeed-Chat's fixed PPO constants (``DSCHAT_CONSTANTS``)
    where the --config file ``config_path`` (None: none) does not set the key: a value the
    file gives stays, even one equal to oppo-ds's default. Applied before the flags'
    overrides and the command line's own, which win."""
    from ..config_yaml import read_config_file

    data = read_config_file(config_path) if config_path is not None else {}
    written = {f"{section}.{key}" for section, keys in data.items() if isinstance(keys, dict)
               for key in keys}
    return [f"{key}={json.dumps(value)}" for key, value in DSCHAT_CONSTANTS.items()
            if key not in written]


DSCHAT_LORA_LR = 5e-4  # step 3's default --actor_lora_learning_rate, --critic_lora_learning_rate


def _lora(flags: dict, put, warnings: list) -> None:
    """DeepSpeed-Chat's LoRA (dschat/utils/module/lora.py): the update is
    ``lora_scaling / lora_dim * R L`` with lora_scaling 1, i.e. ``model.lora_alpha: 1`` in
    oppo-ds's ``alpha / rank``; its LoRA matrices train at the LoRA learning rate of their
    model, in an optimizer group of their own (dschat/utils/utils.py,
    get_optimizer_grouped_parameters): ``model.lora_learning_rate``, one key for both."""
    with_lora = [kind for kind in ("actor", "critic") if (flags.get(f"{kind}_lora_dim") or 0) > 0]
    warnings += [f"--{kind}_lora_learning_rate has no effect without --{kind}_lora_dim > 0"
                 for kind in ("actor", "critic")
                 if kind not in with_lora and f"{kind}_lora_learning_rate" in flags]
    if not with_lora:
        return
    put("model.lora_alpha", 1.0)
    rates = {kind: flags.get(f"{kind}_lora_learning_rate", DSCHAT_LORA_LR) for kind in with_lora}
    if len(set(rates.values())) > 1:
        raise ConfigError("--actor_lora_learning_rate", (
            f"{rates['actor']!r} differs from --critic_lora_learning_rate {rates['critic']!r} "
            f"(DeepSpeed-Chat's default {DSCHAT_LORA_LR} for one not given): oppo-train has one "
            f"LoRA learning rate for both models (model.lora_learning_rate); give them the "
            f"same value"))
    put("model.lora_learning_rate", rates[with_lora[0]])


DSCHAT_DATA_SPLIT = "2,4,4"  # step 3's default --data_split
DSCHAT_UNSUP_COEF = 27.8  # step 3's default --unsup_coef


def phase_weights(text: str) -> list[float]:
    """--data_split ``"2,4,4"`` -> [2.0, 4.0, 4.0]: three weights >= 0, the third > 0."""
    try:
        weights = [float(part) for part in text.split(",")]
    except ValueError:
        weights = []
    if len(weights) != 3 or min(weights) < 0 or not all(map(math.isfinite, weights)):
        raise ConfigError("--data_split", f"{text!r}: three comma-separated weights >= 0 for "
                          "steps 1, 2 and 3, e.g. 2,4,4")
    if weights[2] == 0:
        raise ConfigError("--data_split", f"{text!r} leaves step 3 no prompts (its weight, the "
                          "third, is 0)")
    return weights


def _oppo(flags: dict, put, warnings: list) -> None:
    knobs = {"oppo_chunk_size": "oppo.chunk_size", "oppo_overcommit": "oppo.overcommit",
             "oppo_placement": "oppo.placement", "oppo_sync_every": "generation.sync_every",
             "oppo_static_cache": "generation.static_cache",
             "oppo_cuda_graph": "generation.cuda_graph",
             "oppo_cudnn_attention": "system.cudnn_attention"}
    if not flags.get("enable_oppo"):
        warnings += [f"--{name} has no effect without --enable_oppo" for name in knobs
                     if name in flags]
        return
    put("oppo.streaming", True)
    for name, key in knobs.items():
        # chunk size and Delta take auto as a config value; placement auto keeps the config's
        if name in flags and not (name == "oppo_placement" and flags[name] == "auto"):
            put(key, flags[name])
    batch = _step_batch(flags)
    if flags.get("oppo_overcommit") == "auto" and batch is not None:
        # as the patched DeepSpeed-Chat's: Delta within [0, B/4] (oppo.delta_max's default, 8,
        # is more than a DeepSpeed-Chat batch of 4 or 1 takes)
        put("oppo.delta_max", max(1, batch // 4))


BATCH_FLAGS = ("per_device_generation_batch_size", "per_device_training_batch_size",
               "generation_batches", "gradient_accumulation_steps")


def _step_batch(flags: dict) -> Optional[int]:
    """A step's prompts a rank, ppo.batch_size, from DeepSpeed-Chat's batch flags (their
    defaults for those not given); None when none is given (the config's batch stands)."""
    if not set(BATCH_FLAGS) & set(flags):
        return None
    return flags.get("per_device_generation_batch_size", 16) * flags.get("generation_batches", 1)


def _batches(flags: dict, put) -> None:
    batch = _step_batch(flags)
    if batch is None:
        return
    gen = flags.get("per_device_generation_batch_size", 16)
    train = flags.get("per_device_training_batch_size", 16)
    batches = flags.get("generation_batches", 1)
    accumulate = flags.get("gradient_accumulation_steps", 1)
    mini = train * accumulate
    if batch % mini:
        raise ConfigError("--per_device_training_batch_size",
                          f"{train} x --gradient_accumulation_steps {accumulate} must divide "
                          f"--per_device_generation_batch_size {gen} x --generation_batches "
                          f"{batches} = {batch} (oppo-train splits a step's batch evenly)")
    put("ppo.batch_size", batch)
    put("ppo.mini_batch_size", mini)
    put("ppo.micro_batch_size", train)


def _schedule(flags: dict, put) -> None:
    kind = flags.get("lr_scheduler_type")
    if kind is None:
        return
    table = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear",
             "cosine": "cosine"}
    if kind not in table:
        raise ConfigError("--lr_scheduler_type", f"{kind!r} is not supported by oppo-train; "
                          f"use one of {', '.join(table)}")
    put("ppo.lr_schedule", table[kind])


def steps_from_flags(flags: dict, batch_size: int, world_size: int, num_prompts,
                     warnings: Optional[list] = None) -> Optional[int]:
    """PPO steps DeepSpeed-Chat would run: ``--num_train_epochs`` passes over the prompts
    (``num_prompts()`` counts them; a step takes ``batch_size`` prompts a rank). Under
    ``--enable_test_mode`` it stops after ``--test_stop_step`` generation batches, within the
    first epoch (main.py: the count is of generation batches, each PPO step takes
    ``--generation_batches`` of them, and the epoch loop breaks after the first epoch); a
    notice for ``warnings`` where its count does not come out in whole PPO steps."""
    def epochs(count) -> int:
        return max(1, math.ceil(count * num_prompts() / (batch_size * world_size)))

    if flags.get("enable_test_mode"):
        stop = int(flags.get("test_stop_step") or 0)
        if stop <= 0:  # DeepSpeed-Chat's default 0: the first epoch
            return epochs(1)
        per_step = int(flags.get("generation_batches", 1))
        steps = min(max(1, stop // per_step), epochs(1))
        if stop % per_step and warnings is not None:
            warnings.append(f"--test_stop_step {stop} counts generation batches, "
                            f"--generation_batches {per_step} a PPO step: DeepSpeed-Chat trains "
                            f"{stop // per_step} step(s) and stops; oppo-train runs {steps}")
        return steps
    if "num_train_epochs" in flags:
        return epochs(flags["num_train_epochs"])
    return None


WARMUP_KEY = "ppo.warmup_steps"


def warmup_within(flags: dict, cfg, warnings: list) -> list[str]:
    """The override for ``--num_warmup_steps`` once the run's optimizer updates are known
    (``cfg``: the config without it): at most those updates. DeepSpeed-Chat sizes its
    schedule from whole epochs whatever stops the run (``--enable_test_mode``) and accepts a
    warm-up longer than the run; oppo-ds's schedule spans the run and refuses one. A longer
    warm-up is capped, with a notice naming both numbers."""
    if "num_warmup_steps" not in flags:
        return []
    if flags.get("lr_scheduler_type") == "constant" and flags["num_warmup_steps"]:
        # transformers' get_scheduler builds "constant" without the warm-up it is given
        warnings.append("--num_warmup_steps has no effect with --lr_scheduler_type constant: "
                        "DeepSpeed-Chat's constant schedule has no warm-up (use "
                        "constant_with_warmup for one)")
        return []
    from ..config_checks import optimizer_updates

    asked, updates = int(flags["num_warmup_steps"]), optimizer_updates(cfg)
    if asked <= updates:
        return [f"{WARMUP_KEY}={asked}"]
    warnings.append(f"--num_warmup_steps {asked} is more than the run's {updates} optimizer "
                    f"updates (DeepSpeed-Chat sizes its schedule from whole epochs and stops "
                    f"early under --enable_test_mode); warm-up capped at {updates}: the "
                    f"learning rate reaches its peak at the last update, where DeepSpeed-Chat's "
                    f"would reach {updates}/{asked} of it")
    return [f"{WARMUP_KEY}={updates}"]


# ---------------------------------------------------------------- DeepSpeed-Chat checkpoints

def data_source(paths: list) -> Union[str, list[str]]:
    """The local prompt sources of --data_path: one path, or a list of several (a DeepSpeed-Chat
    JSON array file, its ``local/jsonfile`` format, is read as it is: see
    ``oppo_ds.datafiles.read_prompt_rows``)."""
    if not paths:
        raise ConfigError("--data_path", "no path given")
    for path in paths:
        if path == "local/jsonfile":
            raise ConfigError("--data_path", "local/jsonfile names DeepSpeed-Chat's own "
                              "data/train.json: pass that file's path instead")
        if "=" in path and not os.path.exists(path):
            raise ConfigError("--data_path", f"{path!r} is not a local file or directory; a "
                              f"KEY=VALUE override after --data_path is read as one more path "
                              f"(it takes several): put overrides before it")
        if not os.path.exists(path):
            raise ConfigError("--data_path", f"{path!r} is not a local file or directory "
                              f"(oppo-ds never downloads data sets; save it locally first)")
    return paths[0] if len(paths) == 1 else list(paths)


def is_dschat_reward_checkpoint(path: str) -> bool:
    """A DeepSpeed-Chat step-2 output: ``pytorch_model.bin`` holding ``rwtransformer.*`` and
    ``v_head.weight`` (its RewardModel's state dict), not an HF model's keys."""
    if not os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        return False
    import torch

    state = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu",
                       weights_only=True, mmap=True)
    return "v_head.weight" in state and any(k.startswith("rwtransformer.") for k in state)


def convert_dschat_reward_checkpoint(path: str, out: str) -> str:
    """Write DeepSpeed-Chat's RewardModel checkpoint as a directory ``ValueHeadModel`` loads
    (HF base model in safetensors + ``value_head.safetensors``, tokenizer files copied).
    Several ranks may call it at once: each writes its own temporary directory and the first
    rename wins. Returns ``out``."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from ..models import VALUE_HEAD_FILE

    if os.path.isfile(os.path.join(out, VALUE_HEAD_FILE)):
        return out
    state = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu",
                       weights_only=True)
    tmp = f"{out}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    body = {k[len("rwtransformer."):]: v.contiguous() for k, v in state.items()
            if k.startswith("rwtransformer.")}
    save_file(body, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    save_file({"weight": state["v_head.weight"].contiguous()}, os.path.join(tmp, VALUE_HEAD_FILE))
    for name in os.listdir(path):
        if name != "pytorch_model.bin" and os.path.isfile(os.path.join(path, name)):
            shutil.copy(os.path.join(path, name), tmp)
    try:
        os.rename(tmp, out)
    except OSError:  # another rank was first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def critic_source(path: str, out_dir: str, convert: bool = True) -> str:
    """The critic / reward model's path for a --critic_model_name_or_path: DeepSpeed-Chat's
    RewardModel checkpoint converted under ``out_dir`` (only named, with ``convert`` false:
    --print-config), any other path as it is."""
    if os.path.isdir(path) and is_dschat_reward_checkpoint(path):
        out = os.path.join(out_dir, "dschat_converted", "critic")
        return convert_dschat_reward_checkpoint(path, out) if convert else out
    return path
