"""docs/metrics.md stays true to the code: every key real runs log (metrics.jsonl, eval.jsonl)
has its row there, and every key it documents is one the code names or a run logged.

Two short runs on the built-in workload's tiny models turn on what adds keys: streaming,
the rollout pool under `auto` Delta, truncated importance sampling, dual clip, value clip,
the overlong penalty, PPO-ptx and evaluations in one; a critic-free estimator with groups,
DAPO's dynamic sampling over the pool, the KL in the loss and two reward functions in the
other. A documented key with a ``<placeholder>`` (``reward_fn/<name>/mean``) stands for the
keys it matches.
"""
from __future__ import annotations

import json
import os
import re

from oppo_ds.config import load_config
from oppo_ds.telemetry import read_history

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["workload.num_prompts=64", "workload.sft_steps=20", "workload.reward_steps=20",
         "generation.max_new_tokens=24", "ppo.batch_size=8", "ppo.mini_batch_size=4",
         "ppo.micro_batch_size=4", "logging.progress=false", "logging.log_every=0",
         "checkpoint.every=0", "checkpoint.final=false", "checkpoint.export_hf=false"]
# a metric key: a known family, a slash, a name (the TRL peer's own names are not ours)
KEY = re.compile(r'"((?:reward|gold|kl|loss|policy|value|pool|stream|rollout|time|train|'
                 r'response|lr|grad_norm|filter|oppo|eval)/[a-z_0-9/]*[a-z_0-9])"')


def documented() -> set[str]:
    """The keys in the first column of docs/metrics.md's tables (``a``, ``b`` in one cell)."""
    with open(os.path.join(ROOT, "docs", "metrics.md")) as f:
        cells = [line.split("|")[1] for line in f if line.startswith("| `")]
    return {name for cell in cells for name in re.findall(r"`([^`]+)`", cell)}


def pattern(doc_key: str) -> re.Pattern:
    """The keys ``doc_key`` stands for: itself, or any with a ``<placeholder>`` filled in."""
    parts = re.split(r"<[^>]+>", doc_key)
    return re.compile("[^/]+".join(re.escape(p) for p in parts) + "$")


def undocumented(keys: set[str], docs: set[str]) -> list[str]:
    """``keys`` that no key of ``docs`` stands for."""
    patterns = [pattern(d) for d in docs]
    return sorted(k for k in keys if not any(p.match(k) for p in patterns))


def named_in_code() -> set[str]:
    names = set()
    for folder, dirs, files in os.walk(os.path.join(ROOT, "oppo_ds")):
        dirs[:] = [d for d in dirs if d != "peers"]
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    names.update(KEY.findall(f.read()))
    return names


def logged_keys(cache_dir, out_dir, *overrides) -> set[str]:
    from oppo_ds.trainer import PPOTrainer

    cfg = load_config(None, SMALL + [f"workload.cache_dir={cache_dir}",
                                     f"logging.output_dir={out_dir}", *overrides])
    PPOTrainer(cfg).train()
    keys = {k for row in read_history(str(out_dir / "metrics.jsonl")) for k in row}
    if (out_dir / "eval.jsonl").exists():
        keys |= {k for row in read_history(str(out_dir / "eval.jsonl")) for k in row}
    return keys


def test_every_logged_and_every_named_metric_is_documented(cache_dir, tmp_path):
    ptx = tmp_path / "ptx.jsonl"
    ptx.write_text("".join(json.dumps({"text": "a b c d e f g h " * 4}) + "\n" for _ in range(8)))
    logged = logged_keys(
        cache_dir, tmp_path / "oppo", "steps=3", "oppo.streaming=true", "oppo.overcommit=auto",
        "oppo.off_policy=truncated_is", "ppo.dual_clip=3.0", "ppo.value_clip_eps=0.2",
        "ppo.overlong_buffer_len=8", "ppo.ptx_coef=0.1", f"data.ptx={ptx}",
        "ppo.kl_target=1.0", "eval.prompts=builtin", "eval.num_prompts=8", "eval.every=2",
        "ppo.micro_batch_tokens=150")
    logged |= logged_keys(
        cache_dir, tmp_path / "dapo", "steps=2", "ppo.advantage_estimator=rloo",
        "data.samples_per_prompt=2", "ppo.filter_groups=true", "oppo.overcommit=2",
        "ppo.kl_penalty=loss", "ppo.kl_estimator=k3",
        "model.reward_function=[oppo_ds.workload:gold_reward,oppo_ds.workload:gold_reward]",
        "model.reward_weights=[0.5,0.5]")
    docs = documented()
    # what a run of each part logs (a key no run logs here comes from the code's names)
    for key in ("pool/deferrals", "stream/scoring_hidden_frac", "train/is_weight_mean",
                "loss/ptx", "loss/kl", "filter/rounds", "eval/reward_mean", "train/ratio_max",
                "policy/dual_clip_frac", "reward/overlong_penalty",
                "reward_fn/0_gold_reward/mean", "train/micro_batches_needed"):
        assert key in logged, key
    assert undocumented(logged, docs) == [], "logged, not in docs/metrics.md"
    named = named_in_code()
    assert sorted(named - docs) == [], "named in oppo_ds/, not in docs/metrics.md"
    unseen = [d for d in docs - named if not any(pattern(d).match(k) for k in logged)]
    assert sorted(unseen) == [], "in docs/metrics.md, neither named nor logged"
