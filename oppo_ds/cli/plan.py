"""oppo-plan: per-GPU memory and predicted step time of every schedule, without running a model.

    oppo-plan --config examples/configs/llama3_70b.yaml --nodes 8 --gpus-per-node 8 --gpu H100-80GB
    oppo-plan --config FILE --nodes 1 --gpus-per-node 8 --gpu A100-80GB --json plan.json \\
        workload.median_len=200 --shape actor=llama3-8b
    oppo-plan --calibrate bench/results.json      # the simulator against make bench's timings

Exit status: 0 when the plan fits (or the calibration ran), 1 when it does not fit, 2 on a
bad flag, config key or file (one line naming it).
"""
from __future__ import annotations

import argparse
import json
import sys

from ..config import ConfigError, load_config
from .argtypes import output_file, seed
from ..plan.costs import DEVICES, get_device
from ..plan.simulate import MODES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="oppo-plan", description="Memory per GPU and predicted PPO step time (sequential, "
                                      "intra, inter, oppo) for a config on a cluster, by calculation.")
    p.add_argument("--config", metavar="FILE", help="YAML config (default: the built-in workload)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node (default 1)")
    p.add_argument("--gpu", metavar="NAME", help=f"device; one of {', '.join(DEVICES)}")
    p.add_argument("--json", dest="json_path", metavar="OUT", type=output_file,
                   help="also write the plan as JSON")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="share of device memory kept free for fragmentation and spikes (default 0.1)")
    p.add_argument("--shape", action="append", default=[], metavar="MODEL=NAME",
                   help="shape of a model whose path gives none, e.g. actor=llama3-70b (repeatable)")
    p.add_argument("--lengths", metavar="FILE",
                   help="response lengths to draw from (a JSON list) instead of the config's "
                        "log-normal (workload.median_len, workload.tail_sigma)")
    p.add_argument("--modes", default=",".join(MODES), help=f"modes to simulate (default {','.join(MODES)})")
    p.add_argument("--steps", type=int, default=30, help="simulated PPO steps per mode (default 30)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the simulated lengths (default 0)")
    p.add_argument("--calibrate", metavar="RESULTS.json",
                   help="fit the cpu device to an oppo-bench result's sequential run and compare the "
                        "predicted speedups of the other modes with the measured ones")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. ppo.batch_size=32")
    return p


def _shape_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError("--shape", f"expected MODEL=NAME, got {item!r}")
        key, name = item.split("=", 1)
        out[key.strip()] = name.strip()
    return out


def _read_lengths(path: str) -> list[int]:
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError("--lengths", f"cannot read {path}: {err}") from None
    if not isinstance(values, list) or not values or not all(isinstance(v, int) and v >= 1 for v in values):
        raise ConfigError("--lengths", f"{path} must hold a non-empty JSON list of integers >= 1")
    return values


def _gib(x: float) -> str:
    return f"{x:8.2f}"


def format_plan(out: dict, config: str) -> str:
    lines = [f"oppo-plan: {config} on {out['nodes']} node(s) x {out['gpus_per_node']} {out['device']}"
             f" ({out['nodes'] * out['gpus_per_node']} GPUs)"]
    for k, m in out["models"].items():
        n = m["params"]
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"
        lines.append(f"  {k:<9} {m['shape']}: {size} parameters")
    if "reference" not in out["models"]:
        lines.append("  reference none (ppo.kl_coef 0: the KL is off)")
    if "reward" not in out["models"]:
        lines.append("  reward    none (model.reward_function scores the responses)")
    if "critic" not in out["models"]:
        lines.append("  critic    none (a critic-free ppo.advantage_estimator)")
    rows = out["rows_per_rank"]
    deltas = sorted({m["delta"] for m in out["modes"].values() if m["delta"]})
    wider = rows["widest_rollout"] > rows["batch_size"] + rows["delta"]
    lines += [f"  rows per rank: B = {rows['batch_size']}, Delta = {rows['delta']} as configured (memory)"
              + (f"; inter/oppo simulate Delta = {deltas[0]}" if deltas else "")
              + (f"; a later round of ppo.filter_groups decodes up to {rows['widest_rollout']}"
                 if wider else ""),
              "", "per-GPU memory (GiB)"]
    for item, gib in out["breakdown_gib"].items():
        if gib:
            lines.append(f"  {item:<22}{_gib(gib)}")
    lines.append("  phase totals: " + ", ".join(f"{k} {v:.2f}" for k, v in out["phases_gib"].items()))
    verdict = "FITS" if out["fits"] else "DOES NOT FIT"
    lines.append(f"  peak {out['peak_mem_gib']:.2f} GiB ({out['peak_phase']}) of {out['capacity_gib']:.1f} GiB; "
                 f"usable {out['usable_gib']:.1f} GiB at {out['headroom']:.0%} headroom: {verdict}")
    if out["cpu_per_node_gib"]:
        lines.append(f"  CPU memory per node (offloaded states): {out['cpu_per_node_gib']:.1f} GiB")
    lines += ["", "predicted step (discrete-event simulation, roofline costs)",
              f"  {'mode':<11}{'step s':>10}{'speedup':>9}{'generate':>10}{'score':>9}{'train':>9}"
              f"{'chunk':>7}{'Delta':>7}{'hidden':>8}{'tail waste':>12}"]
    for mode, m in out["modes"].items():
        ph = m["phases_s"]
        lines.append(f"  {mode:<11}{m['step_s']:>10.4g}{out['predicted_speedup'].get(mode, 0):>8.2f}x"
                     f"{ph['generate']:>10.4g}{ph['score']:>9.4g}{ph['train']:>9.4g}"
                     f"{m['chunk_size'] or '-':>7}{m['delta']:>7}{m['scoring_hidden_frac']:>8.0%}"
                     f"{m['tail_waste_frac']:>12.0%}")
    sim = out["simulation"]
    split = sim.get("model_split", {})
    group = (f"megatron replica(s) of tp {split['tensor_parallel']} x pp {split['pipeline_parallel']}"
             if sim.get("backend") == "megatron" else f"decode group(s) of tp {sim['tp']}")
    lines.append(f"  ({sim['steps']} steps, {sim['decode_groups']} {group}, "
                 f"prompt {sim['prompt_len']} tokens, lengths: {sim['lengths']})")
    if sim.get("costs") == "assumed":
        lines += [f"  {ASSUMED_COSTS[0]}", f"  {ASSUMED_COSTS[1]}"]
    return "\n".join(lines)


# printed under a plan on a device whose costs were not fitted to a measurement (every GPU)
ASSUMED_COSTS = ("costs assumed: data-sheet rates and host overheads not measured on this device; "
                 "on one H100 a sequential step",
                 "of Qwen2.5-0.5B shapes took 7-14x the predicted time (docs/scaling.md): "
                 "oppo-plan --calibrate fits them to a run")


def format_calibration(out: dict) -> str:
    fit = out["fit"]
    lines = [f"oppo-plan --calibrate {out['results']}: costs fitted to the sequential run "
             f"on {out['machine']}",
             "  " + ", ".join(f"{k} {v:.4g}" for k, v in out["device"].items()),
             "  sequential phases per step, measured / fitted (rms residual): " + ", ".join(
                 f"{k} {fit['measured_s'][k]:.4f} / {fit['fitted_s'][k]:.4f} s ({fit['rms_residual_s'][k]:.4f})"
                 for k in fit["measured_s"]), "",
             f"  {'mode':<11}{'pred. step':>11}{'meas. step':>11}{'pred. speedup':>14}"
             f"{'meas. speedup':>14}{'error':>8}"]
    for mode, m in out["modes"].items():
        meas = m.get("measured_speedup")
        step = f"{m['measured_step_s']:>11.4f}" if "measured_step_s" in m else f"{'-':>11}"
        lines.append(f"  {mode:<11}{m['predicted_step_s']:>11.4f}{step}{m['predicted_speedup']:>13.3f}x"
                     + (f"{meas:>13.3f}x{m['speedup_error']:>+8.1%}" if meas is not None else f"{'-':>14}"))
    return "\n".join(lines)


def run(args) -> int:
    if args.calibrate:
        from ..plan.calibrate import calibrate

        out = calibrate(args.calibrate, seed=args.seed)
        text, code = format_calibration(out), 0
    else:
        from ..plan.planner import plan

        if not args.gpu:
            raise ConfigError("--gpu", f"required; one of {', '.join(DEVICES)}")
        device = get_device(args.gpu)
        cfg = load_config(args.config, args.overrides)
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        unknown = [m for m in modes if m not in MODES]
        if unknown or not modes:
            raise ConfigError("--modes", f"unknown mode {unknown[0] if unknown else ''!r}; allowed: {', '.join(MODES)}")
        if "sequential" not in modes:
            modes = ["sequential"] + modes  # speedups are relative to it
        if args.steps < 2:
            raise ConfigError("--steps", f"must be >= 2, got {args.steps}")
        lengths = _read_lengths(args.lengths) if args.lengths else None
        out = plan(cfg, args.nodes, args.gpus_per_node, device,
                   shape_overrides=_shape_overrides(args.shape), headroom=args.headroom,
                   lengths=lengths, steps=args.steps, seed=args.seed, modes=modes)
        out["config"] = args.config or "built-in workload"
        text, code = format_plan(out, out["config"]), (0 if out["fits"] else 1)
    print(text)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=2)
    return code


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ConfigError, ValueError) as err:
        print(f"oppo-plan: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
