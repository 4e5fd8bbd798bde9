"""The simulator checked against reality: fit the ``cpu`` device to the phase timings that
``make bench`` measured on the built-in workload, then predict the other modes' speedups.

Only the **sequential** run is fitted, and with the simulator's own cost formulas: every
per-call overhead and every inverse FLOP/s (decode, prefill, training; the rollout's setup)
enters a simulated phase time linearly, so the sequential schedule is simulated once per
parameter, on a probe device where that parameter alone costs one unit, over the run's own
response lengths step by step. Those per-step phase times (generate, score, train) are the
regressors; non-negative least squares against the measured ones gives the parameters. The
fitted device therefore reproduces the sequential run's phases as the simulator computes them
(decode steps, padded micro-batches, attention over the context, the prompt's prefill), not
a simplified formula beside it. The streaming and overcommitting modes are then *predicted*
from these costs and each mode's own response lengths, and compared with their measured
speedups over the same runs (none of their timings enter the fit).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import numpy as np

from ..config import Config, ConfigError, load_config
from .costs import CPU, Device, with_measured
from .planner import cost_model, layout, length_dist, schedules
from .shapes import resolve_shapes
from .simulate import MODES, StepSimulator

WARMUP = 2  # oppo-bench leaves the first 2 steps out of its timing by default (--warmup)
PHASES = ("generate", "score", "train")
# the cost-model parameters the fit measures, each entering the simulator linearly: per-call
# overheads in seconds, and the inverse of each effective FLOP/s
FITTED = ("rollout_setup_s", "decode_call_s", "decode_flops", "prefill_call_s", "prefill_flops",
          "train_call_s", "train_flops")
UNBOUNDED = 1e18  # a rate whose time is too small to count: shown as 1e+18


def read_bench(results_path: str) -> tuple[dict, str]:
    """oppo-bench's JSON and the directory holding each mode's run (``<mode>/metrics.jsonl``)."""
    try:
        with open(results_path) as f:
            results = json.load(f)
    except FileNotFoundError:
        raise ConfigError("--calibrate", f"no such file: {results_path} (make bench writes "
                                         f"bench/results.json)") from None
    except json.JSONDecodeError as err:
        raise ConfigError("--calibrate", f"{results_path} is not JSON: {err}") from None
    # beside the JSON first (oppo-bench's default, and where a copy keeps them: the workdir it
    # names may hold another run's by now, e.g. the GPU script's /tmp/gpu-work), else its workdir
    runs = os.path.splitext(results_path)[0] + ".runs"
    if not os.path.isdir(runs) and results.get("workdir"):
        runs = results["workdir"]
    if not os.path.isfile(os.path.join(runs, "sequential", "metrics.jsonl")):
        raise ConfigError("--calibrate", f"{runs}/sequential/metrics.jsonl is missing: the "
                                         f"calibration fits the sequential run's phases")
    return results, runs


def bench_warmup(results: dict) -> int:
    """The steps the benchmark left out of its timing (its --warmup, in its JSON)."""
    return int((results.get("modes", {}).get("sequential") or {}).get("warmup_steps", WARMUP))


def read_steps(runs: str, mode: str, warmup: int = WARMUP) -> list[dict]:
    with open(os.path.join(runs, mode, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[min(warmup, len(rows) - 1):]


def _lstsq(columns: list[np.ndarray], y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (a cost is never negative): a column
    whose coefficient comes out negative is dropped and the rest refitted."""
    keep = list(range(len(columns)))
    while True:
        coef, *_ = np.linalg.lstsq(np.stack([columns[i] for i in keep], axis=1), y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = np.zeros(len(columns))
            out[keep] = np.maximum(coef, 0.0)
            return out
        keep.pop(int(np.argmin(coef)))


def _rate(seconds_per_flop: float) -> float:
    """Effective FLOP/s from a fitted time per FLOP; one too small to measure (fitted at 0)
    leaves the rate unbounded."""
    return 1.0 / seconds_per_flop if seconds_per_flop > 0 else UNBOUNDED


def _probe(base: Device, name: str) -> Device:
    """A device whose only cost is one unit of ``name`` (a second per call, or one FLOP a
    second): the simulator's phase times under it are that parameter's regressors."""
    zero = {k: (UNBOUNDED if k.endswith("flops") else 0.0) for k in FITTED}
    zero[name] = 1.0
    return with_measured(base, bw=UNBOUNDED, layer_s=0.0, optim_s=0.0, step_other_s=0.0, **zero)


def fit_cpu(cfg: Config, steps: list[dict], base: Device = CPU, seed: int = 0,
            warmup: int = WARMUP) -> tuple[Device, dict]:
    """The ``cpu`` device fitted to a sequential run's phase timings (``steps``: its
    metrics.jsonl from the first step, the first ``warmup`` left out), and the fit's
    figures."""
    shapes, lay = resolve_shapes(cfg), layout(cfg, 1, 1)
    dist = dataclasses.replace(length_dist(cfg), per_step=tuple(tuple(r["response/lengths"]) for r in steps))
    sched = schedules(cfg, "sequential")[0]

    def phases(device: Device) -> np.ndarray:
        sim = StepSimulator(cost_model(cfg, shapes, device, lay), dist)
        res = sim.run(sched, steps=len(steps), warmup=warmup, seed=seed)
        return np.concatenate([[s.phases[k] for s in res.steps] for k in PHASES])

    timed = steps[warmup:]
    measured = np.concatenate([[r[f"time/phase/{k}"] for r in timed] for k in PHASES])
    coef = _lstsq([phases(_probe(base, name)) for name in FITTED], measured)
    fields = {name: (_rate(c) if name.endswith("flops") else float(c)) for name, c in zip(FITTED, coef)}
    other = float(np.mean([r["time/step_s"] - sum(r[f"time/phase/{k}"] for k in PHASES) for r in timed]))
    # memory traffic is no term of the fit: the tiny models' weights stay in the CPU's
    # caches and their calls' overheads dominate, so the fitted device leaves it out too
    device = with_measured(base, bw=UNBOUNDED, layer_s=0.0, optim_s=0.0, step_other_s=other, **fields)
    fitted, real = phases(device).reshape(len(PHASES), -1), measured.reshape(len(PHASES), -1)
    fit = {"measured_s": {k: float(m.mean()) for k, m in zip(PHASES, real)},
           "fitted_s": {k: float(f.mean()) for k, f in zip(PHASES, fitted)},
           "rms_residual_s": {k: float(np.sqrt(np.mean((f - m) ** 2))) for k, f, m in zip(PHASES, fitted, real)},
           "other_s": other}
    return device, fit


def calibrate(results_path: str, seed: int = 0,
              base: Device = CPU) -> dict:
    """Fit the cpu device to the sequential run of an oppo-bench result, predict every mode's
    speedup with the simulator and compare with the measured ones."""
    results, runs = read_bench(results_path)
    cfg = load_config(os.path.join(runs, "sequential", "config.yaml"))
    shapes = resolve_shapes(cfg)
    lay = layout(cfg, 1, 1)
    warmup = bench_warmup(results)
    device, fit = fit_cpu(cfg, read_steps(runs, "sequential", warmup=0), base=base, seed=seed,
                          warmup=warmup)
    model = cost_model(cfg, shapes, device, lay)
    out: dict = {"results": results_path, "fit": fit, "device": _device_json(device), "modes": {},
                 "machine": _machine(results.get("machine") or {})}
    predicted = {}
    for mode in MODES:
        # replay the lengths the mode's own run generated, step by step (its policy drifted
        # its own way; the sequential run's when the mode was not run); timings are not read
        source = mode if os.path.isfile(os.path.join(runs, mode, "metrics.jsonl")) else "sequential"
        per_step = tuple(tuple(r["response/lengths"]) for r in read_steps(runs, source, warmup=0))
        sim = StepSimulator(model, dataclasses.replace(length_dist(cfg), per_step=per_step))
        runs_of_mode = [sim.run(s, steps=len(per_step), warmup=warmup, seed=seed)
                        for s in schedules(cfg, mode)]
        predicted[mode] = min(runs_of_mode, key=lambda r: r.mean("step_s"))
    base_s = predicted["sequential"].mean("step_s")
    measured_seq = _measured_step(runs, "sequential", warmup)
    for mode, res in predicted.items():
        entry = {"predicted_step_s": round(res.mean("step_s"), 5),
                 "predicted_speedup": round(base_s / res.mean("step_s"), 4),
                 "chunk_size": res.schedule.chunk if res.schedule.streamed else None,
                 "delta": res.schedule.delta,
                 "predicted_phases_s": {k: round(res.mean(k), 5) for k in PHASES}}
        if mode in results.get("modes", {}) and os.path.isdir(os.path.join(runs, mode)):
            # over the runs whose lengths were replayed (under --repeat, the first round's;
            # oppo-bench's own figure is then the median over the rounds)
            step = _measured_step(runs, mode, warmup)
            measured = measured_seq / step
            entry["measured_step_s"] = round(step, 5)
            entry["measured_speedup"] = round(measured, 4)
            entry["speedup_error"] = round(entry["predicted_speedup"] / measured - 1.0, 4)
            entry["step_error"] = round(res.mean("step_s") / step - 1.0, 4)
            entry["measured_phases_s"] = _measured_phases(runs, mode, warmup)
        out["modes"][mode] = entry
    out["measured_sequential_step_s"] = round(measured_seq, 5)
    return out


def _measured_step(runs: str, mode: str, warmup: int) -> float:
    """Mean step time after the warm-up: oppo-bench's speedup is samples/s, i.e. this mean."""
    return float(np.mean([r["time/step_s"] for r in read_steps(runs, mode, warmup)]))


def _measured_phases(runs: str, mode: str, warmup: int) -> dict:
    rows = read_steps(runs, mode, warmup)
    return {k: round(float(np.mean([r.get(f"time/phase/{k}", 0.0) for r in rows])), 5)
            for k in PHASES}


def _machine(machine: dict) -> str:
    """What the benchmark ran on, from oppo-bench's ``machine`` record: the GPU when there
    was one (the fit describes whatever ran, a GPU's as well as this CPU's)."""
    if machine.get("cuda_device"):
        count = machine.get("cuda_device_count") or 1
        return f"{count} x {machine['cuda_device']}" if count > 1 else str(machine["cuda_device"])
    cores = machine.get("cpu_count")
    return f"{cores}-core CPU" if cores else "the benchmark's machine"


def _device_json(d: Device) -> dict:
    keys = ("decode_flops", "prefill_flops", "train_flops", "decode_call_s", "prefill_call_s",
            "train_call_s", "rollout_setup_s", "step_other_s")
    return {k: float(f"{getattr(d, k):.4g}") for k in keys}


def calibrated_device(results_path: Optional[str]) -> Device:
    """The cpu device fitted to ``results_path`` (the shipped constants when None)."""
    if results_path is None:
        return CPU
    results, runs = read_bench(results_path)
    cfg = load_config(os.path.join(runs, "sequential", "config.yaml"))
    return fit_cpu(cfg, read_steps(runs, "sequential", warmup=0), warmup=bench_warmup(results))[0]
