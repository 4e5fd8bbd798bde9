"""oppo-train takes a DeepSpeed-Chat step-3 command line (DeepSpeedExamples 3d83278).

The flag mapping, its errors and warnings, the conversion of DeepSpeed-Chat's step-2
critic checkpoint and JSON data, and one real short run from DeepSpeed-Chat flags on tiny
models whose outputs land where DeepSpeed-Chat puts them (output_dir/actor, /critic).
"""
import gzip
import json
import os
import subprocess
import sys

import pytest
import torch

from _builders import single_process_env
from oppo_ds.cli.train import build_parser, main, resolve_config
from oppo_ds.config import ConfigError
from oppo_ds.integrations import dschat_flags

# the flags of DeepSpeed-Chat's OPT-1.3b single-node step-3 script, minus the paths
DSCHAT_ARGS = ["--data_split", "2,4,4", "--num_padding_at_beginning", "1",
               "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "2",
               "--generation_batches", "1", "--ppo_epochs", "1", "--max_answer_seq_len", "8",
               "--max_prompt_seq_len", "16", "--actor_learning_rate", "9.65e-6",
               "--critic_learning_rate", "5e-6", "--actor_weight_decay", "0.1",
               "--critic_weight_decay", "0.1", "--num_train_epochs", "1",
               "--lr_scheduler_type", "cosine", "--gradient_accumulation_steps", "1",
               "--num_warmup_steps", "100", "--deepspeed", "--seed", "1234",
               "--actor_zero_stage", "2", "--critic_zero_stage", "2",
               "--enable_hybrid_engine", "--actor_gradient_checkpointing", "--dtype", "bf16",
               "--enable_tensorboard", "--tensorboard_path", "/tmp/tb"]


def resolve(argv, prepare=False):
    return resolve_config(build_parser().parse_args(argv), prepare_files=prepare)


def test_help_lists_the_dschat_flags(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--actor_model_name_or_path", "--critic_model_name_or_path",
                 "--per_device_generation_batch_size", "--per_device_training_batch_size",
                 "--generation_batches", "--ppo_epochs", "--max_prompt_seq_len",
                 "--max_answer_seq_len", "--actor_learning_rate", "--critic_learning_rate",
                 "--actor_zero_stage", "--critic_zero_stage", "--enable_hybrid_engine",
                 "--inference_tp_size", "--offload", "--offload_reference_model", "--dtype",
                 "--enable_tensorboard", "--tensorboard_path", "--output_dir", "--seed",
                 "--data_path", "--actor_lora_dim", "--only_optimize_lora", "--enable_ema",
                 "--enable_oppo", "--oppo_chunk_size", "--oppo_overcommit", "--oppo_sync_every",
                 "--oppo_static_cache", "--oppo_cuda_graph", "--oppo_cudnn_attention"):
        assert flag in text, flag
    assert "[no effect]" in text and "[refused]" in text


def test_a_dschat_command_line_maps_onto_the_config():
    cfg, notes = resolve(DSCHAT_ARGS + ["--actor_model_name_or_path", "/a",
                                        "--critic_model_name_or_path", "/c",
                                        "--output_dir", "/tmp/out", "--enable_oppo",
                                        "--oppo_chunk_size", "auto", "--oppo_overcommit", "2",
                                        "--oppo_sync_every", "8",
                                        "--actor_lora_dim", "8", "--critic_lora_dim", "4",
                                        "--actor_lora_module_name", "decoder.layers.",
                                        "--only_optimize_lora", "--offload"])
    assert cfg.generation.sync_every == 8
    assert cfg.model.actor == "/a"
    assert (cfg.ppo.batch_size, cfg.ppo.mini_batch_size, cfg.ppo.micro_batch_size) == (4, 2, 2)
    assert (cfg.ppo.actor_lr, cfg.ppo.critic_lr, cfg.ppo.weight_decay) == (9.65e-6, 5e-6, 0.1)
    assert (cfg.ppo.lr_schedule, cfg.ppo.warmup_steps, cfg.ppo.ppo_epochs) == ("cosine", 100, 1)
    assert (cfg.generation.max_prompt_len, cfg.generation.max_new_tokens) == (16, 8)
    assert cfg.data.overlong == "skip"
    s = cfg.system
    assert (s.zero_stage, s.hybrid_engine, s.gradient_checkpointing, s.dtype, s.offload) == \
        (2, True, True, "bf16", True)
    assert (cfg.model.actor_lora_dim, cfg.model.critic_lora_dim, cfg.model.lora_module_name,
            cfg.model.only_optimize_lora) == (8, 4, "decoder.layers.", True)
    assert (cfg.seed, cfg.logging.output_dir, cfg.logging.tensorboard) == (1234, "/tmp/out", True)
    assert (cfg.oppo.streaming, cfg.oppo.chunk_size, cfg.oppo.overcommit) == (True, "auto", 2)
    joined = "\n".join(notes)
    for flag in ("--data_split", "--num_padding_at_beginning", "--tensorboard_path", "--deepspeed"):
        assert flag in joined, flag


def test_hybrid_engine_knobs_go_into_its_deepspeed_section():
    """--unpin_actor_parameters, --release_inference_cache and --tp_gather_partition_size
    had no effect; they now set the hybrid engine's section as DeepSpeed-Chat's
    get_train_ds_config writes them, through system.deepspeed_config."""
    cfg, notes = resolve(["--enable_hybrid_engine", "--unpin_actor_parameters",
                          "--release_inference_cache", "--tp_gather_partition_size", "4"])
    assert cfg.system.deepspeed_config == {"hybrid_engine": {
        "pin_parameters": False, "release_inference_cache": True, "tp_gather_partition_size": 4}}
    assert not [n for n in notes if "inference_cache" in n or "unpin" in n]
    cfg, notes = resolve(["--release_inference_cache"])  # as in DeepSpeed-Chat: no effect
    assert cfg.system.deepspeed_config is None
    assert "--release_inference_cache has no effect without --enable_hybrid_engine" in notes


def test_dotted_overrides_win_and_gradient_accumulation_sets_the_mini_batch():
    cfg, _ = resolve(["--per_device_generation_batch_size", "8", "--generation_batches", "2",
                      "--per_device_training_batch_size", "2", "--gradient_accumulation_steps",
                      "2", "--seed", "3", "seed=5", "--enable_test_mode", "--test_stop_step", "8"])
    assert (cfg.ppo.batch_size, cfg.ppo.mini_batch_size, cfg.ppo.micro_batch_size) == (16, 4, 2)
    assert (cfg.seed, cfg.steps) == (5, 4)  # 8 generation batches, 2 a step


def test_dschat_test_mode_command_runs_with_a_warmup_longer_than_the_run(capsys):
    """DeepSpeed-Chat's run_single.sh sweep passes --enable_test_mode --test_stop_step 5 with
    --num_warmup_steps 100: it sizes its schedule from the whole epoch and stops early. It
    exited 2 ("ppo.warmup_steps: must be at most the run's optimizer updates ... = 5, got
    100"); the warm-up is now capped at the run's updates, with a warning naming both."""
    argv = DSCHAT_ARGS + ["--enable_test_mode", "--test_stop_step", "5"]
    assert main(argv + ["--print-config"]) == 0
    err = capsys.readouterr().err
    cfg, notes = resolve(argv)
    updates = cfg.steps * cfg.ppo.updates_per_step
    assert (cfg.steps, updates, cfg.ppo.warmup_steps) == (5, 10, 10)
    assert f"--num_warmup_steps 100 is more than the run's {updates} optimizer updates" in err
    assert f"warm-up capped at {updates}" in "\n".join(notes)
    # within the run it stays as given, and a dotted override is the user's (still checked)
    cfg, notes = resolve(argv + ["--num_warmup_steps", "3"])
    assert cfg.ppo.warmup_steps == 3 and not [n for n in notes if "warm-up" in n]
    assert resolve(argv + ["ppo.warmup_steps=2"])[0].ppo.warmup_steps == 2
    with pytest.raises(ConfigError, match="ppo.warmup_steps: must be at most"):
        resolve(argv + ["ppo.warmup_steps=100"])


def test_a_constant_schedule_has_no_warmup_as_in_dschat():
    """DeepSpeed-Chat builds its schedule with transformers' get_scheduler, whose "constant"
    takes no warm-up: --lr_scheduler_type constant --num_warmup_steps 4 warmed up 4 updates
    here. constant_with_warmup keeps it."""
    argv = ["--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2",
            "--num_warmup_steps", "4", "steps=10"]
    cfg, notes = resolve(argv + ["--lr_scheduler_type", "constant"])
    assert (cfg.ppo.lr_schedule, cfg.ppo.warmup_steps) == ("constant", 0)
    assert any("--num_warmup_steps has no effect with --lr_scheduler_type constant" in n
               for n in notes)
    cfg, notes = resolve(argv + ["--lr_scheduler_type", "constant_with_warmup"])
    assert (cfg.ppo.lr_schedule, cfg.ppo.warmup_steps) == ("constant", 4)


def test_test_stop_step_counts_generation_batches_within_one_epoch(tmp_path):
    """DeepSpeed-Chat's --test_stop_step counts generation batches (main.py's step loop), and
    a PPO step takes --generation_batches of them; test mode stops after the first epoch. It
    was taken as PPO steps: --test_stop_step 7 --generation_batches 2 ran 7 steps where
    DeepSpeed-Chat trains 3."""
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"a {i}"}) + "\n" for i in range(20)))
    base = ["--per_device_generation_batch_size", "2", "--generation_batches", "2",
            "--per_device_training_batch_size", "2", "--data_split", "0,0,1",
            "--data_path", str(data), "--enable_test_mode"]  # 20 prompts: 5 steps of 4
    for more, steps in ((["--test_stop_step", "8"], 4), (["--test_stop_step", "7"], 3),
                        (["--test_stop_step", "1"], 1), (["--test_stop_step", "40"], 5),
                        ([], 5), (["--num_train_epochs", "3"], 5),
                        (["--test_stop_step", "40", "steps=9"], 9)):
        cfg, notes = resolve(base + more)
        assert cfg.steps == steps, more
        uneven = [n for n in notes if "counts generation batches" in n]
        assert bool(uneven) == (more[:2] in (["--test_stop_step", "7"],
                                             ["--test_stop_step", "1"])), (more, notes)
    _, notes = resolve(base + ["--test_stop_step", "7"])
    assert "DeepSpeed-Chat trains 3 step(s) and stops; oppo-train runs 3" in "\n".join(notes)


def test_dschat_fixed_ppo_constants_replace_oppo_ds_defaults(tmp_path):
    """DeepSpeed-Chat fixes kl_ctl = 0.1 and does not whiten advantages (ppo_trainer.py): the
    flag route had oppo-ds's kl_coef 0.05 and whitening. Its other constants are ours already.
    A dotted override, and a value the --config file sets, still win."""
    p = resolve(["--seed", "1"])[0].ppo
    assert (p.kl_coef, p.whiten_advantages, p.whiten_rewards, p.kl_estimator, p.kl_penalty,
            p.kl_target, p.reward_clip, p.clip_eps, p.value_clip_eps, p.gamma, p.lam) == \
        (0.1, False, False, "k1", "reward", None, 5.0, 0.2, 0.2, 1.0, 0.95)
    p = resolve(["--seed", "1", "ppo.kl_coef=0.02", "ppo.whiten_advantages=true"])[0].ppo
    assert (p.kl_coef, p.whiten_advantages) == (0.02, True)
    path = tmp_path / "c.yaml"
    path.write_text("ppo:\n  kl_coef: 0.3\n")
    p = resolve(["--config", str(path), "--seed", "1"])[0].ppo
    assert (p.kl_coef, p.whiten_advantages) == (0.3, False)
    path.write_text("ppo:\n  kl_coef: 0.05\n")  # the file's choice, though oppo-ds's default
    p = resolve(["--config", str(path), "--seed", "1"])[0].ppo
    assert (p.kl_coef, p.whiten_advantages) == (0.05, False)
    p = resolve([])[0].ppo  # no DeepSpeed-Chat flag: oppo-ds's own defaults
    assert (p.kl_coef, p.whiten_advantages) == (0.05, True)


@pytest.mark.parametrize("argv, flag", [
    (["--actor_zero_stage", "3", "--critic_zero_stage", "2"], "--actor_zero_stage"),
    (["--actor_weight_decay", "0.1", "--critic_weight_decay", "0"], "--actor_weight_decay"),
    (["--enable_mixed_precision_lora"], "--enable_mixed_precision_lora"),
    # a hub name, not a local copy: nothing is downloaded
    (["--unsupervised_dataset_name", "wikitext", "--unsupervised_dataset_config_name",
      "wikitext-2-raw-v1"], "--unsupervised_dataset_name"),
    (["--offload_reference_model"], "--offload_reference_model"),
    (["--lr_scheduler_type", "polynomial"], "--lr_scheduler_type"),
    (["--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "3"],
     "--per_device_training_batch_size"),
    (["--seed", "-1"], "--seed"),  # numpy's "Seed must be between 0 and 2**32 - 1" at start
    (["--seed", str(2**32)], "--seed"),
    (["--num_train_epochs", "0"], "--num_train_epochs"),  # was `steps: 1`, silently
    (["--num_train_epochs", "-2"], "--num_train_epochs"),
])
def test_conflicts_and_refused_flags_are_errors_naming_the_flag(argv, flag, capsys):
    assert main(argv + ["--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"oppo-train: error: {flag}:"), err


def test_lora_flags_give_dschats_scale_and_learning_rate():
    """DeepSpeed-Chat's LoRA update is lora_scaling / lora_dim x R L with lora_scaling 1, and
    its LoRA matrices train at --actor_lora_learning_rate / --critic_lora_learning_rate
    (default 5e-4) in their own optimizer group. oppo-train left model.lora_alpha unset (scale
    1, dim times DeepSpeed-Chat's) and ignored the LoRA learning rates."""
    from oppo_ds.engines.factory import prepare_trained
    from oppo_ds.lora import LoRALayer
    from oppo_ds.models import build_causal_lm

    lora = ["--actor_lora_dim", "8", "--actor_lora_module_name", "layers."]
    cfg, notes = resolve(lora)
    assert (cfg.model.lora_alpha, cfg.model.lora_learning_rate) == (1.0, 5e-4)
    model = prepare_trained(build_causal_lm("tiny-llama", vocab_size=64, seed=0), cfg, "actor")
    scales = {m.lora_scaling for m in model.modules() if isinstance(m, LoRALayer)}
    assert scales == {1 / 8}  # DeepSpeed-Chat's LinearLayer_LoRA: lora_scaling / lora_dim
    both = lora + ["--critic_lora_dim", "4", "--actor_lora_learning_rate", "1e-4"]
    cfg, _ = resolve(both + ["--critic_lora_learning_rate", "1e-4"])
    assert (cfg.model.lora_alpha, cfg.model.lora_learning_rate) == (1.0, 1e-4)
    with pytest.raises(ConfigError, match=r"--actor_lora_learning_rate: 0.0001 differs from "
                                          r"--critic_lora_learning_rate 0.0005"):
        resolve(both)  # the critic's default 5e-4
    cfg, notes = resolve(lora + ["--critic_lora_learning_rate", "1e-3"])  # no critic LoRA
    assert cfg.model.lora_learning_rate == 5e-4
    assert "--critic_lora_learning_rate has no effect without --critic_lora_dim > 0" in notes
    cfg, notes = resolve(["--actor_lora_learning_rate", "1e-3", "--actor_lora_dim", "0"])
    assert (cfg.model.lora_alpha, cfg.model.lora_learning_rate) == (None, None)
    assert "--actor_lora_learning_rate has no effect without --actor_lora_dim > 0" in notes
    cfg, _ = resolve(lora + ["model.lora_learning_rate=null", "model.lora_alpha=16"])
    assert (cfg.model.lora_alpha, cfg.model.lora_learning_rate) == (16, None)  # overrides win


def test_deepspeeds_own_deprecated_flags_are_accepted(capsys):
    """deepspeed.add_config_arguments, which DeepSpeed-Chat's main.py calls, adds --deepscale
    and --deepscale_config beside --deepspeed; oppo-train refused them as unknown (exit 2)."""
    cfg, notes = resolve(["--deepscale", "--deepscale_config", "/tmp/ds.json", "--seed", "1"])
    assert cfg.system.deepspeed_config is None
    joined = "\n".join(notes)
    assert "--deepscale has no effect" in joined
    assert "--deepscale_config has no effect in oppo-train: DeepSpeed's deprecated " \
           "--deepspeed_config; the file is not read" in joined
    assert main(["--deepscale", "--deepscale_config", "/tmp/ds.json", "--print-config"]) == 0
    assert "--deepscale_config has no effect" in capsys.readouterr().err


def test_unknown_and_abbreviated_flags_are_errors(capsys):
    for argv, name in ((["--actor_model_path", "x"], "--actor_model_path"),
                       (["--actor_model_name", "x"], "--actor_model_name")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert name in capsys.readouterr().err


def test_dschat_run_scripts_oppo_flags_give_a_config_that_runs():
    """The docs' command: DeepSpeed-Chat's run_1.3b.sh (a generation batch of 4) and its llama2
    scripts (1, --offload_reference_model under ZeRO-3) with --enable_oppo --oppo_chunk_size
    auto --oppo_overcommit auto appended. Both were refused: auto kept oppo.delta_max 8, more
    than the batch (the patch caps Delta at B/4), and the partitioned reference was left in
    oppo.stream_to, where it cannot stream."""
    oppo = ["--enable_oppo", "--oppo_chunk_size", "auto", "--oppo_overcommit", "auto"]
    for batch, delta_max in ((16, 4), (4, 1), (1, 1)):
        cfg, _ = resolve(["--per_device_generation_batch_size", str(batch),
                          "--per_device_training_batch_size", str(batch)] + oppo)
        assert (cfg.ppo.batch_size, cfg.oppo.overcommit, cfg.oppo.delta_max) == \
            (batch, "auto", delta_max)
    cfg, notes = resolve(["--per_device_generation_batch_size", "1",
                          "--per_device_training_batch_size", "1", "--actor_zero_stage", "3",
                          "--critic_zero_stage", "3", "--offload_reference_model"] + oppo)
    assert cfg.system.partition_reference and cfg.system.offload_reference
    assert cfg.oppo.stream_to == ["critic", "actor"]
    assert any("the partitioned reference scores whole sequences" in n for n in notes)
    cfg, _ = resolve(["--per_device_generation_batch_size", "4",
                      "--per_device_training_batch_size", "4", "oppo.delta_max=2"] + oppo)
    assert cfg.oppo.delta_max == 2  # a dotted override still wins
    cfg, _ = resolve(["--actor_zero_stage", "3", "--offload_reference_model"])
    assert cfg.oppo.stream_to == ["reference", "critic", "actor"]  # nothing streams anyway


def test_print_config_names_the_critic_it_would_train(tmp_path, capsys):
    """--print-config printed critic: null and reward: builtin for a command line giving
    --critic_model_name_or_path (the path was set only when files were prepared)."""
    cfg, _ = resolve(["--actor_model_name_or_path", str(tmp_path / "a"),
                      "--critic_model_name_or_path", str(tmp_path / "c")])
    assert cfg.model.critic == cfg.model.reward == str(tmp_path / "c")
    assert not (tmp_path / "c").exists() and not os.listdir(tmp_path)  # nothing written


def test_oppo_knobs_without_enable_oppo_warn_and_change_nothing():
    cfg, notes = resolve(["--oppo_overcommit", "2"])
    assert not cfg.oppo.streaming and cfg.oppo.overcommit == 0
    assert any("--oppo_overcommit has no effect without --enable_oppo" in n for n in notes)


def test_data_path_prompts_are_tokenized_as_they_are(tmp_path):
    """DeepSpeed-Chat tokenizes its prompts ("Human: ... Assistant:") as they are; an actor
    whose tokenizer has a chat template must not wrap them in it (data.chat_template=auto
    did), and a dotted override still wins."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Human: hi Assistant:"}) + "\n")
    cfg, _ = resolve(["--data_path", str(data)])
    assert cfg.data.chat_template == "off"
    assert resolve([])[0].data.chat_template == "auto"
    cfg, _ = resolve(["data.chat_template=on", "--data_path", str(data)])  # nargs="*" flag last
    assert cfg.data.chat_template == "on"


def test_print_answers_prints_samples():
    cfg, notes = resolve(["--print_answers", "--print_answers_interval", "5"])
    assert (cfg.logging.print_samples, cfg.logging.samples_every, cfg.logging.samples) == (True, 5, 2)
    cfg, _ = resolve(["--print_answers"])
    assert (cfg.logging.print_samples, cfg.logging.sample_period) == (True, 1)  # every step
    cfg, notes = resolve(["--print_answers_interval", "5"])
    assert not cfg.logging.print_samples
    assert "--print_answers_interval has no effect without --print_answers" in notes


def test_data_path_rules(tmp_path):
    data = tmp_path / "train.json"
    data.write_text(json.dumps([{"prompt": "Human: hi Assistant:", "chosen": "a", "rejected": "b"},
                                {"prompt": "Human: yo Assistant:", "chosen": "c",
                                 "rejected": "d"}]))
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"prompt": "Human: hey Assistant:"}) + "\n")
    from oppo_ds.datafiles import read_prompt_rows

    assert dschat_flags.data_source([str(data)]) == str(data)
    assert dschat_flags.data_source([str(data), str(more)]) == [str(data), str(more)]
    rows = read_prompt_rows(str(data))  # DeepSpeed-Chat's JSON array, read as it is
    assert [r.text_or_messages for r in rows] == ["Human: hi Assistant:", "Human: yo Assistant:"]
    for paths, text in ((["Dahoas/rm-static"], "never downloads"),
                        ([str(data), "b.jsonl"], "'b.jsonl' is not a local file"),
                        ([str(data), "ppo.kl_coef=0.1"], "put overrides before it"),
                        (["local/jsonfile"], "pass that file's path"),
                        ([], "no path given")):
        with pytest.raises(ConfigError, match=text):
            dschat_flags.data_source(paths)


def test_data_split_reads_step_3s_part_of_each_data_path(tmp_path):
    """DeepSpeed-Chat's step 3 reads the third part of each --data_path (--data_split, 2,4,4
    by default) and blends them; oppo-train read every prompt (a warning said so), so a run
    trained on the reward model's own prompts and --num_train_epochs counted 2.5x the steps."""
    first, second = tmp_path / "a.jsonl", tmp_path / "b.json"
    first.write_text("".join(json.dumps({"prompt": f"a {i}"}) + "\n" for i in range(20)))
    second.write_text(json.dumps([{"prompt": f"b {i}"} for i in range(10)]))
    base = ["--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2",
            "--num_train_epochs", "1"]
    cfg, notes = resolve(base + ["--data_path", str(first), str(second)], prepare=True)
    assert cfg.data.prompts == [str(first), str(second)]
    assert cfg.data.phase_split == [2.0, 4.0, 4.0]  # DeepSpeed-Chat's default
    assert cfg.data.phase_split_seed is None  # the run's seed (--seed), as DeepSpeed-Chat
    assert cfg.steps == (8 + 4) // 2  # one pass over the 40% of each source, 2 per step
    assert not [n for n in notes if "data_split" in n]
    # --print-config (no files prepared) shows the same prompts: it showed builtin
    assert resolve(["--data_path", str(first), str(second)])[0].data.prompts == [str(first),
                                                                                str(second)]
    cfg, _ = resolve(base + ["--data_split", "6,2,2", "--data_path", str(first)], prepare=True)
    assert (cfg.data.phase_split, cfg.steps) == ([6.0, 2.0, 2.0], 2)
    cfg, _ = resolve(base + ["data.phase_split=null", "--data_path", str(first)], prepare=True)
    assert (cfg.data.phase_split, cfg.steps) == (None, 10)  # a dotted override wins
    for text, message in (("2,4", "three comma-separated weights"),
                          ("2,4,x", "three comma-separated weights"),
                          ("1,-1,4", "three comma-separated weights"),
                          ("5,5,0", "leaves step 3 no prompts")):
        with pytest.raises(ConfigError, match=message):
            resolve(["--data_split", text, "--data_path", str(first)])
    _, notes = resolve(["--data_split", "2,4,4"])
    assert "--data_split has no effect without --data_path" in "\n".join(notes)


def test_num_train_epochs_counts_the_prompts_left_after_the_overlong_ones(tmp_path):
    """--max_prompt_seq_len skips longer prompts (DeepSpeed-Chat's step 3 filters them); its
    epoch is a pass over those left: 10 of 16 prompts here, 5 steps of 2, not 8."""
    data = tmp_path / "p.jsonl"
    long = " ".join(["a"] * 40)
    data.write_text("".join(json.dumps({"prompt": long if i % 8 < 3 else f"a {i}"}) + "\n"
                            for i in range(16)))
    base = ["--per_device_generation_batch_size", "2", "--per_device_training_batch_size", "2",
            "--num_train_epochs", "1", "--max_prompt_seq_len", "16", "--data_split", "0,0,1"]
    # the count needs the built-in workload's tokenizer only, and every process counts before
    # the ranks join: none prepares the workload (rank 0 does that once, after the join)
    cfg, _ = resolve(base + [f"workload.cache_dir={tmp_path / 'w'}", "--data_path", str(data)],
                     prepare=True)
    assert (cfg.data.overlong, cfg.generation.max_prompt_len) == ("skip", 16)
    assert cfg.steps == 5
    assert not (tmp_path / "w").exists()


def test_an_empty_data_path_file_is_named_not_counted_as_one_step(tmp_path, capsys):
    """--num_train_epochs over an empty prompt file counted 0 prompts and ran `steps: 1`."""
    empty = tmp_path / "p.jsonl"
    empty.write_text("")
    assert main(["--data_path", str(empty), "--num_train_epochs", "1", "--print-config"]) == 2
    assert capsys.readouterr().err == (f"oppo-train: error: {empty}: no prompt rows (the file "
                                       "is empty, or holds only blank lines or a header)\n")


def test_the_split_is_deepspeed_chats_own(tmp_path):
    """phase_part against DeepSpeed-Chat's get_raw_dataset_split_index itself, from a
    DeepSpeedExamples tree at 3d83278 named by OPPO_DSCHAT_ROOT."""
    root = os.environ.get("OPPO_DSCHAT_ROOT")
    app = os.path.join(root or "", "applications", "DeepSpeed-Chat")
    if not root or not os.path.isfile(os.path.join(app, "dschat", "utils", "data",
                                                   "data_utils.py")):
        pytest.skip("OPPO_DSCHAT_ROOT does not point at a DeepSpeedExamples tree (CI has no "
                    "network to fetch one; the local check is recorded in docs/deepspeed-chat.md)")
    sys.path.insert(0, app)
    try:
        from dschat.utils.data.data_utils import get_raw_dataset_split_index
    finally:
        sys.path.remove(app)
    from oppo_ds.datafiles import phase_part

    checked = 0
    for n in (1, 5, 8, 10, 33, 1001):
        for split in ("2,4,4", "1,1,1", "6,2,2", "0,0,1", "1,0,9", "0.5,0.25,0.25"):
            for seed in (0, 1234):
                weights = dschat_flags.phase_weights(split)
                for part in range(3):
                    theirs = get_raw_dataset_split_index(0, str(tmp_path), "x", seed, "train",
                                                         split, part, n, rebuild=part == 0)
                    assert phase_part(n, weights, seed, part) == theirs, (n, split, seed, part)
                    checked += 1
    assert checked == 6 * 6 * 2 * 3


def _save_dschat_checkpoints(root, vocab_size):
    """An actor as DeepSpeed-Chat's step 1 saves it (HF model + tokenizer) and a critic as
    its step 2 saves it: the RewardModel's state dict (``rwtransformer.*``, ``v_head``) in
    pytorch_model.bin beside the base model's config.json."""
    from transformers import AutoModel, AutoModelForCausalLM

    from oppo_ds.models import tiny_config
    from oppo_ds.workload import build_tokenizer

    tok = build_tokenizer()
    config = tiny_config("tiny-llama", vocab_size, hidden_size=32,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(config)
    actor.save_pretrained(root / "actor")
    tok.save_pretrained(root / "actor")
    body = AutoModel.from_config(config)
    state = {f"rwtransformer.{k}": v for k, v in body.state_dict().items()}
    state["v_head.weight"] = torch.randn(1, config.hidden_size)
    os.makedirs(root / "critic")
    torch.save(state, root / "critic" / "pytorch_model.bin")
    config.save_pretrained(root / "critic")
    tok.save_pretrained(root / "critic")
    return state, tok


def test_dschat_critic_checkpoint_is_converted_for_the_value_model(tmp_path):
    from oppo_ds.models import build_value_model
    from oppo_ds.workload import VOCAB

    state, _ = _save_dschat_checkpoints(tmp_path, len(VOCAB))
    assert dschat_flags.is_dschat_reward_checkpoint(str(tmp_path / "critic"))
    assert not dschat_flags.is_dschat_reward_checkpoint(str(tmp_path / "actor"))
    out = dschat_flags.critic_source(str(tmp_path / "critic"), str(tmp_path / "run"))
    assert out == str(tmp_path / "run" / "dschat_converted" / "critic")
    model = build_value_model(out, require_head=True)
    assert torch.equal(model.value_head.weight, state["v_head.weight"])
    key = "layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.body.state_dict()[key], state[f"rwtransformer.{key}"])
    assert dschat_flags.critic_source(str(tmp_path / "critic"), str(tmp_path / "run")) == out


def test_oppo_train_runs_a_dschat_command_line(tmp_path):
    """A real run, launched as a DeepSpeed-Chat step-3 script would be with only its
    command changed: two steps with OPPO on, the final actor and critic in DeepSpeed-Chat's
    layout, loadable again."""
    from oppo_ds.models import build_causal_lm, build_value_model
    from oppo_ds.workload import VOCAB

    _save_dschat_checkpoints(tmp_path, len(VOCAB))
    data = tmp_path / "train.json"  # DeepSpeed-Chat's local/jsonfile format
    data.write_text(json.dumps([{"prompt": f"want a b {x} ->", "chosen": "x", "rejected": "y"}
                                for x in "abcdefghij"]))
    more = tmp_path / "more.jsonl.gz"  # a second source, compressed
    more.write_bytes(gzip.compress("".join(json.dumps({"prompt": f"want b a {x} ->"}) + "\n"
                                           for x in "abcde").encode()))
    out = tmp_path / "step3"
    cmd = [sys.executable, "-m", "oppo_ds.train",
           "--actor_model_name_or_path", str(tmp_path / "actor"),
           "--critic_model_name_or_path", str(tmp_path / "critic"),
           "--data_split", "2,4,4", "--num_padding_at_beginning", "0",
           "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "2",
           "--max_prompt_seq_len", "16", "--max_answer_seq_len", "8",
           "--actor_zero_stage", "0", "--critic_zero_stage", "0", "--seed", "1",
           "--enable_test_mode", "--test_stop_step", "2", "--output_dir", str(out),
           "--enable_oppo", "--oppo_chunk_size", "4", "--oppo_overcommit", "1",
           "logging.progress=false", "logging.tensorboard=false", "system.torch_threads=1",
           "--data_path", str(data), str(more)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=single_process_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{data}: 4 of 10 prompts, the PPO part of data.phase_split" in proc.stderr
    assert f"{more}: 2 of 5 prompts" in proc.stderr
    summary = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert rows[-1]["pool/delta"] == 1 and rows[-1]["oppo/chunk_size"] == 4
    actor = build_causal_lm(str(out / "actor"))
    critic = build_value_model(str(out / "critic"), require_head=True)
    assert actor.config.num_hidden_layers == critic.config.num_hidden_layers == 2


def test_static_cache_flags_map_and_the_hybrid_engine_refuses_them():
    """--oppo_static_cache / --oppo_cuda_graph map onto generation.static_cache / cuda_graph;
    with --enable_hybrid_engine (whose inference kernels decode with a cache of their own)
    the static cache is refused, naming the key."""
    base = [a for a in DSCHAT_ARGS if a != "--enable_hybrid_engine"] + [
        "--actor_model_name_or_path", "/a", "--critic_model_name_or_path", "/c", "--enable_oppo"]
    cfg, _ = resolve(base + ["--oppo_static_cache"])
    assert cfg.generation.static_cache and not cfg.generation.cuda_graph
    with pytest.raises(ConfigError, match="generation.cuda_graph: needs static_cache"):
        resolve(base + ["--oppo_cuda_graph"])
    with pytest.raises(ConfigError, match="system.hybrid_engine: True replaces"):
        resolve(base + ["--oppo_static_cache", "--enable_hybrid_engine"])
    assert not cfg.system.cudnn_attention
    assert resolve(base + ["--oppo_cudnn_attention"])[0].system.cudnn_attention


def test_docs_list_every_dschat_flag():
    text = open(os.path.join(os.path.dirname(__file__), os.pardir, "docs",
                             "deepspeed-chat.md")).read()
    missing = [f.name for f in dschat_flags.FLAGS if f"`--{f.name}`" not in text]
    assert not missing, f"docs/deepspeed-chat.md does not list {missing}"
