"""oppo-train: PPO-RLHF training from a YAML config and dotted overrides.

    oppo-train                                   # built-in tiny long-tail workload
    oppo-train --config examples/configs/tiny.yaml ppo.kl_coef=0.1
    deepspeed --num_gpus 2 --module oppo_ds.train --config FILE   # data parallel
    oppo-train --actor_model_name_or_path DIR --critic_model_name_or_path DIR ...
                                          # a DeepSpeed-Chat step-3 command line
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
import warnings

from ..config import ConfigError, load_config
from ..config_checks import check_evaluation_set
from ..config_paths import check_export_targets
from ..datafiles import DataError
from ..integrations import dschat_flags as dschat


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oppo-train", allow_abbrev=False,
        description="PPO-based RLHF with pipeline overlap (OPPO) on DeepSpeed. Without --config "
                    "it trains on the built-in long-tail workload (nothing is downloaded).",
        epilog="Every key is listed in docs/config.md; e.g. ppo.kl_coef=0.05 system.zero_stage=2")
    parser.add_argument("--config", help="YAML config file (see examples/configs/)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit")
    parser.add_argument("--evaluate", action="store_true",
                        help="evaluate the actor once on eval.prompts and exit, training nothing: "
                             "the latest checkpoint in logging.output_dir (checkpoint.resume), "
                             "else model.actor; figures to OUTPUT_DIR/evaluations/step_N.json")
    # set by the deepspeed launcher; the rank is read from the environment instead
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted config overrides, e.g. ppo.kl_coef=0.05")
    dschat.add_dschat_flags(parser)
    return parser


def resolve_config(args, prepare_files: bool = True):
    """The config from --config, DeepSpeed-Chat's flags (mapped onto keys) and the dotted
    overrides, in that order (a later one wins). ``prepare_files``: convert DeepSpeed-Chat's
    step-2 checkpoint into the form oppo-ds reads (under output_dir; --print-config names
    where it would go). Returns (config, warnings)."""
    flags = dschat.given_flags(args)
    if not flags:
        return load_config(args.config, args.overrides), []
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mapped, notes = dschat.dschat_overrides(flags)
    # DeepSpeed-Chat's fixed PPO constants (kl_ctl 0.1, no whitening) where the file sets none
    mapped = dschat.dschat_constants(args.config) + mapped
    cfg = load_config(args.config, mapped + list(args.overrides))
    extra = []
    if "critic_model_name_or_path" in flags:
        critic = dschat.critic_source(flags["critic_model_name_or_path"], cfg.logging.output_dir,
                                      convert=prepare_files)
        extra += [f"model.critic={critic}", f"model.reward={critic}"]
    if "data_path" in flags:
        # JSON, which YAML reads back as it is: a path may hold ':' or '#'
        extra.append(f"data.prompts={json.dumps(dschat.data_source(flags['data_path']))}")
    explicit = {text.split("=", 1)[0].strip() for text in args.overrides}
    if "steps" not in explicit:
        def num_prompts() -> int:
            from ..sources import load_prompts, read_rows, resolve_sources, run_tokenizer

            current = load_config(args.config, mapped + extra + list(args.overrides))
            if current.data.prompts == "builtin":
                return current.workload.num_prompts
            if current.data.overlong != "skip":
                return len(read_rows(current, current.data.prompts))
            # the prompts left after those over the limit (--max_prompt_seq_len) are
            # skipped: DeepSpeed-Chat counts its epoch after that filter too. Every process
            # counts, before the ranks join: none prepares the built-in workload for it
            src = resolve_sources(current, rank=0, prepare=False)
            return len(load_prompts(current, src, run_tokenizer(current, src), log=False)[0])
        steps = dschat.steps_from_flags(flags, cfg.ppo.batch_size, world, num_prompts, notes)
        if steps is not None:
            extra.append(f"steps={steps}")
    # the explicit overrides come last again, so that they win over what was derived here
    cfg = load_config(args.config, mapped + extra + list(args.overrides))
    if dschat.WARMUP_KEY not in explicit:  # --num_warmup_steps within the run's updates
        warmup = dschat.warmup_within(flags, cfg, notes)
        if warmup:
            cfg = load_config(args.config, mapped + extra + warmup + list(args.overrides))
    return cfg, notes


def check_output_dir(path: str) -> None:
    """``ConfigError`` for a ``logging.output_dir`` this process cannot write in (a file of
    that name, no permission), before any model is built or workload prepared."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError("logging.output_dir", f"{path} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ConfigError("logging.output_dir", f"{path}: {err.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError("logging.output_dir", f"{path}: not writable by this user")


def launch_rank(env: dict[str, str]) -> tuple[int, int]:
    """(rank, world size) of this process as its launcher set them, before the process group
    exists: RANK / WORLD_SIZE, or under a bare ``srun`` the task variables they will be
    derived from (``slurm_rendezvous``), else a single process."""
    from ..rendezvous import slurm_rendezvous

    env = slurm_rendezvous(env) or env
    return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))


def _quiet_libraries(rank: int, scorer_rank: bool = False, bars: bool = True) -> None:
    # rank 0 reports the run; the stage placement's scorer rank reports its own few lines
    level = logging.INFO if rank == 0 or scorer_rank else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("deepspeed", "DeepSpeed", "torch.distributed", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
    if rank != 0 or not bars or not sys.stderr.isatty():  # one set of transformers' loading
        # and writing bars, not one per rank; none under logging.progress: false, nor into a
        # log file (a bar redraws itself with carriage returns), as the trainer's own bar
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")


def _close_process_groups() -> None:
    """Destroy the world's process groups while the interpreter is whole (the stage
    placement's links are closed by ``trainer.close()``). Left to interpreter exit,
    a gloo worker thread can still hold a finished send's work, whose tensor it frees after
    Python is gone: SIGABRT, "terminate called without an active exception" (seen on the
    stage placement's scorer rank, about 1 run in 10). Not enough alone: a group DeepSpeed
    still holds outlives this; ``exit_process`` then skips finalization."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from ..preemption import hold_early_signals, release_early_signals

    hold_early_signals()  # a cluster's USR1 while the run starts: stop before step 1, requeue
    try:
        return _main(argv)
    finally:  # a run that ended before training began (a bad config) holds no signal after
        release_early_signals()


def _main(argv: list[str] | None) -> int:
    # intermixed: KEY=VALUE overrides before and after a flag (`steps=2 --evaluate eval.x=y`)
    args = build_parser().parse_intermixed_args(argv)
    if args.evaluate:  # trains nothing: a TERM (in a Slurm job held) or USR1 ends it as usual
        from ..preemption import drop_early_hold

        drop_early_hold()
    rank, world = launch_rank(dict(os.environ))
    try:
        cfg, notes = resolve_config(args, prepare_files=not args.print_config)
        if args.evaluate and not args.print_config:
            check_evaluation_set(cfg)  # the trainer checks again, for one built in Python
        if not args.print_config:
            check_output_dir(cfg.logging.output_dir)
        if not args.print_config and not args.evaluate:  # before anything is set up (the
            check_export_targets(cfg)  # trainer checks again, for a run built in Python)
    except (ConfigError, DataError) as err:
        print(f"oppo-train: error: {err}", file=sys.stderr)
        return 2
    for note in notes if rank == 0 else ():
        print(f"oppo-train: warning: {note}", file=sys.stderr)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    _quiet_libraries(rank, cfg.oppo.placement == "stage" and rank == world - 1 > 0,
                     bars=cfg.logging.progress)
    from ..rollout.stage_layout import StageAborted

    try:
        return _run(cfg, args, rank)
    except StageAborted as err:  # another process of the stage failed: its log has the
        print(f"oppo-train: error: {err}", file=sys.stderr)  # traceback, and the links are
        return 1  # broken, so there is nothing to close


def _run(cfg, args, rank: int) -> int:
    """Build the trainer and run it; its errors become one line and an exit code."""
    from ..finite import NonFiniteError
    from ..reward_fn import RewardFunctionError
    from ..trainer import PPOTrainer

    try:
        trainer = PPOTrainer(cfg, evaluate_only=args.evaluate)
    except (ConfigError, DataError, FileNotFoundError) as err:  # a checkpoint the settings cannot continue
        print(f"oppo-train: error: {err}", file=sys.stderr)
        return 2
    try:
        summary = trainer.evaluate_only() if args.evaluate else trainer.train()
    except NonFiniteError as err:  # every actor rank stops alike, before anything is saved
        if rank == 0:
            print(f"oppo-train: error: {err}", file=sys.stderr)
        trainer.close()
        _close_process_groups()
        return 1
    except RewardFunctionError as err:  # the user's function: its frames and one line, not ours
        if err.__cause__ is not None:
            print("".join(traceback.format_exception(err.__cause__)), end="", file=sys.stderr)
        print(f"oppo-train: error: rank {rank}: {err}", file=sys.stderr)
        return 1  # the launcher ends the other ranks, as after a traceback
    trainer.close()  # the stage placement's links, then the world's groups; after a failure
    _close_process_groups()  # the traceback is printed and the launcher ends all
    if summary is not None:
        print(json.dumps(summary, indent=2))
        print(f"run directory: {os.path.abspath(cfg.logging.output_dir)}")
    if trainer.preempted:  # stopped on a signal after a checkpoint: a job script requeues
        from ..preemption import PREEMPTED_EXIT

        return PREEMPTED_EXIT
    return 0


def exit_process(code: int) -> None:
    """End the program with ``code`` once ``main`` returned: atexit handlers run and every
    stream is flushed while the interpreter is whole, then the process exits without
    finalizing it. A finished run has nothing left to tear down, but torch.distributed's C++
    threads (gloo's, DeepSpeed's groups keep them alive past ``destroy_process_group``) can
    still be releasing a tensor when finalization starts; a thread that asks for the GIL then
    is stopped with a forced unwind, and the process aborts, "terminate called without an
    active exception", exit -6 after a complete run (measured: 1 of 12 two-rank runs of the
    Slurm test's config on the CPU VM; the CI's Slurm test failed on it; pytorch/pytorch#179291
    describes the same race)."""
    import atexit

    try:
        atexit._run_exitfuncs()
        logging.shutdown()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed, or a pipe whose reader is gone
                pass
        os._exit(code)


def entry() -> None:
    """The ``oppo-train`` console script and ``python -m oppo_ds.train``."""
    exit_process(main())


if __name__ == "__main__":
    entry()
