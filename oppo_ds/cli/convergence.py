"""Does a faster schedule learn the same? Reward and gold against samples seen, over seeds.

    for s in 0 1 2; do
        oppo-bench --config examples/configs/tiny.yaml --modes sequential,oppo --steps 300 \
            --seed $s --json bench/seed$s.json
    done
    python -m oppo_ds.cli.convergence bench/seed0.runs bench/seed1.runs bench/seed2.runs \
        --baseline sequential --json bench/convergence.json --plot docs/img/convergence.png

Each argument is an oppo-bench run directory (one seed) holding one sub-directory per mode
with its ``metrics.jsonl``; every directory must hold the same modes, each with the same steps
(``read_runs``). Per mode and metric, each seed's curve is smoothed by a trailing
moving average of ``--window`` steps (steps carry the same number of samples in every mode, so
step i is the same number of samples seen). The baseline's band is the minimum to maximum over
its seeds at each step; the report gives, per other mode and seed, the share of steps whose
smoothed value lies inside the band, the final values, and a paired comparison with the
baseline run of the same seed (which shares its prepared models, so its reward scale): the
mean of the last ``--window`` steps and their difference in units of the baseline's
step-to-step standard deviation there. With overcommitment, the pool's
``pool/deferrals`` histogram gives the share of deferred sequences that finished within one
extra step.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from typing import Optional

from ..telemetry import deferral_summary, read_history
from .argtypes import output_file_in_new_folders

METRICS = (("reward/mean", "reward"), ("gold/mean", "gold score"))


def read_runs(seed_dirs: list[str]) -> dict[str, list[list[dict]]]:
    """{mode: [rows of seed 0, rows of seed 1, ...]} from oppo-bench run directories. Every
    directory must hold the same modes with the same steps: a seed's run is compared with the
    baseline run of that seed step by step, and a mode missing from one directory, or a run
    cut short (a mode that failed keeps its directory), would pair others' steps or seeds.
    The rounds after the first of ``oppo-bench --repeat`` (``<mode>.roundK``) repeat the same
    run for its timing: not read."""
    found: list[dict[str, list[dict]]] = []
    for seed_dir in seed_dirs:
        if not os.path.isdir(seed_dir):
            raise SystemExit(f"convergence: error: {seed_dir} is not a directory")
        modes = {}
        for mode in sorted(os.listdir(seed_dir)):
            path = os.path.join(seed_dir, mode, "metrics.jsonl")
            if os.path.isfile(path) and not _REPEAT.fullmatch(mode):
                modes[mode] = read_history(path)
        found.append(modes)
    for seed_dir, modes in zip(seed_dirs, found):
        for other_dir, other in zip(seed_dirs, found):
            if set(other) - set(modes):
                raise SystemExit(f"convergence: error: {seed_dir} holds no run of "
                                 f"{', '.join(sorted(set(other) - set(modes)))} (in {other_dir}): "
                                 "every directory must hold the same modes")
        steps = {mode: [r.get("step") for r in rows] for mode, rows in modes.items()}
        longest = max(steps, key=lambda m: len(steps[m]), default=None)
        for mode, these in steps.items():
            if these != steps[longest]:
                raise SystemExit(f"convergence: error: {os.path.join(seed_dir, mode)} has "
                                 f"{_span(these)}, {os.path.join(seed_dir, longest)} "
                                 f"{_span(steps[longest])}: a run cut short (a mode that "
                                 "failed?); run it again or leave that directory out")
    return {mode: [modes[mode] for modes in found] for mode in (found[0] if found else {})}


_REPEAT = re.compile(r".+\.round\d+")


def _span(steps: list) -> str:
    return f"steps {steps[0]}..{steps[-1]} ({len(steps)} rows)" if steps else "no steps"


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def samples_seen(rows: list[dict]) -> list[int]:
    seen, total = [], 0
    for r in rows:
        total += r.get("samples", 0)
        seen.append(total)
    return seen


def band(curves: list[list[float]]) -> tuple[list[float], list[float]]:
    n = min(len(c) for c in curves)
    return ([min(c[i] for c in curves) for i in range(n)],
            [max(c[i] for c in curves) for i in range(n)])


def report(runs: dict, baseline: str, window: int) -> dict:
    if baseline not in runs:
        raise SystemExit(f"convergence: error: no {baseline!r} runs in the given directories "
                         f"(found modes: {', '.join(runs) or 'none'})")
    out = {"baseline": baseline, "window": window, "seeds": len(runs[baseline]), "modes": {}}
    for key, _ in METRICS:
        base = [smooth([r[key] for r in rows if key in r], window) for rows in runs[baseline]]
        if not all(base):
            continue
        low, high = band(base)
        for mode, seeds in runs.items():
            entry = out["modes"].setdefault(mode, {})
            per_seed = []
            for seed, rows in enumerate(seeds):
                raw = [r[key] for r in rows if key in r]
                curve = smooth(raw, window)
                n = min(len(curve), len(low))
                inside = sum(1 for i in range(n) if low[i] <= curve[i] <= high[i])
                entry_seed = {"inside_band": inside / n if n else None,
                              "final": curve[-1] if curve else None}
                # paired with the baseline run of the same seed (same prepared models and
                # prompts): the last `window` steps' mean, and their difference in units of
                # the baseline's step-to-step spread over those steps
                if seed < len(runs[baseline]) and raw:
                    base_raw = [r[key] for r in runs[baseline][seed] if key in r][-window:]
                    mine = raw[-window:]
                    spread = statistics.pstdev(base_raw) if len(base_raw) > 1 else 0.0
                    diff = statistics.fmean(mine) - statistics.fmean(base_raw)
                    entry_seed.update({"last_mean": statistics.fmean(mine),
                                       "baseline_last_mean": statistics.fmean(base_raw),
                                       "diff_in_baseline_std": diff / spread if spread else None})
                per_seed.append(entry_seed)
            entry[key] = per_seed
    for mode, seeds in runs.items():
        shares = [deferral_summary(rows) for rows in seeds]
        if any(shares):
            out["modes"][mode]["deferrals"] = shares
    return out


def plot(runs: dict, baseline: str, window: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(11, 4.2))
    for ax, (key, label) in zip(axes, METRICS):
        base = [smooth([r[key] for r in rows if key in r], window) for rows in runs[baseline]]
        if not all(base):
            continue
        low, high = band(base)
        seen = samples_seen(runs[baseline][0])[:len(low)]
        ax.fill_between(seen, low, high, alpha=0.25, label=f"{baseline} (band of {len(base)} seeds)")
        for i, (mode, seeds) in enumerate(m for m in runs.items() if m[0] != baseline):
            for j, rows in enumerate(seeds):
                curve = smooth([r[key] for r in rows if key in r], window)
                ax.plot(samples_seen(rows)[:len(curve)], curve, color=f"C{i + 1}", linewidth=1,
                        label=f"{mode} ({len(seeds)} seeds)" if j == 0 else None)
        ax.set(xlabel="samples seen", ylabel=f"{label} (moving average of {window} steps)",
               title=label)
        ax.legend(fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oppo_ds.cli.convergence", description=__doc__.split("\n")[0])
    parser.add_argument("seed_dirs", nargs="+", metavar="RUNS_DIR", help="oppo-bench run directories, one per seed")
    parser.add_argument("--baseline", default="sequential", help="the mode whose seeds make the band")
    parser.add_argument("--window", type=int, default=20, help="moving-average window in steps (default 20)")
    parser.add_argument("--json", dest="json_path", type=output_file_in_new_folders,
                        help="write the report here")
    parser.add_argument("--plot", type=output_file_in_new_folders, help="write the PNG here")
    args = parser.parse_args(argv)
    if args.window < 1:
        parser.error("--window must be >= 1")
    runs = read_runs(args.seed_dirs)
    result = report(runs, args.baseline, args.window)
    text = json.dumps(result, indent=2)
    if args.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
        with open(args.json_path, "w") as f:
            f.write(text)
    print(text)
    if args.plot:
        plot(runs, args.baseline, args.window, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
