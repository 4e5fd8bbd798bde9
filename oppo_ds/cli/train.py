"""oppo-train: PPO-RLHF training from a YAML config and dotted overrides.

    oppo-train                                   # built-in tiny long-tail workload
    oppo-train --config examples/configs/tiny.yaml ppo.kl_coef=0.1
    deepspeed --num_gpus 2 --module oppo_ds.train --config FILE   # data parallel
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

from ..config import ConfigError, load_config
from ..data import DataError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oppo-train",
        description="PPO-based RLHF with pipeline overlap (OPPO) on DeepSpeed. Without --config "
                    "it trains on the built-in long-tail workload (nothing is downloaded).",
        epilog="Every key is listed in docs/config.md; e.g. ppo.kl_coef=0.05 system.zero_stage=2")
    parser.add_argument("--config", help="YAML config file (see examples/configs/)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit")
    # set by the deepspeed launcher; the rank is read from the environment instead
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted config overrides, e.g. ppo.kl_coef=0.05")
    return parser


def _quiet_libraries(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("deepspeed", "DeepSpeed", "torch.distributed", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"oppo-train: error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    rank = int(os.environ.get("RANK", "0"))
    _quiet_libraries(rank)
    from ..trainer import PPOTrainer

    try:
        trainer = PPOTrainer(cfg)
    except (DataError, FileNotFoundError) as err:
        print(f"oppo-train: error: {err}", file=sys.stderr)
        return 2
    summary = trainer.train()
    if summary is not None:
        print(json.dumps(summary, indent=2))
        print(f"run directory: {os.path.abspath(cfg.logging.output_dir)}")
    if trainer.preempted:  # stopped on a signal after a checkpoint: a job script requeues
        from ..preemption import PREEMPTED_EXIT

        return PREEMPTED_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
