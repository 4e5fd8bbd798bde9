"""The simulator checked against reality: fit the ``cpu`` device to the phase timings that
``make bench`` measured on the built-in workload, then predict the other modes' speedups.

Only the **sequential** run is fitted (per step, least squares over the steps after the
warm-up):

    generate = setup + decode_call x longest response + row_cost x sum of responses
    score    = 8 calls x call + token_cost x padded tokens   (actor, reference, critic, reward;
                                                               2 micro-batches each)
    train    = 4 calls x call + token_cost x padded tokens   (actor and critic, forward+backward)

Each slope becomes an effective FLOP/s of the tiny models (FLOPs per token from their shapes),
each intercept a per-call overhead. The streaming and overcommitting modes are then
*predicted* by the simulator from these costs and the sequential run's own response lengths,
and compared with their measured speedups (none of their timings enter the fit).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import numpy as np

from ..config import ConfigError, load_config
from .costs import CPU, Device, with_measured
from .planner import cost_model, layout, length_dist, schedules
from .shapes import Shapes, resolve_shapes
from .simulate import MODES, StepSimulator, _micro_tokens

WARMUP = 2  # oppo-bench leaves the first 2 steps out of its timing


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
    runs = results.get("workdir") or results_path[:-len(".json")] + ".runs"
    if not os.path.isdir(runs):  # the JSON moved with its runs: look beside it
        runs = os.path.splitext(results_path)[0] + ".runs"
    if not os.path.isfile(os.path.join(runs, "sequential", "metrics.jsonl")):
        raise ConfigError("--calibrate", f"{runs}/sequential/metrics.jsonl is missing: the "
                                         f"calibration fits the sequential run's phases")
    return results, runs


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


def _rate(flops: float, seconds: float) -> float:
    """Effective FLOP/s of a per-token (or per-row) slope; a slope too small to measure
    (fitted at 0) leaves the rate unbounded."""
    return flops / seconds if seconds > 0 else 1e18


def fit_cpu(steps: list[dict], shapes: Shapes, prompt_len: int, micro: int, mini: int,
            epochs: int, base: Device = CPU, seed: int = 0) -> tuple[Device, dict]:
    """The ``cpu`` device fitted to sequential steps' phase timings; also the fit's residuals."""
    lengths = [np.asarray(r["response/lengths"], dtype=np.int64) for r in steps]
    gen = np.array([r["time/phase/generate"] for r in steps])
    score = np.array([r["time/phase/score"] for r in steps])
    train = np.array([r["time/phase/train"] for r in steps])
    ones = np.ones(len(steps))
    longest = np.array([x.max() for x in lengths], dtype=float)
    total = np.array([x.sum() for x in lengths], dtype=float)
    setup, per_step, per_row = _lstsq([ones, longest, total], gen)

    padded = np.array([_micro_tokens(x, micro, prompt_len)[0] for x in lengths])
    score_calls = 4 * -(-len(lengths[0]) // micro)
    score0, score_tok = _lstsq([ones, padded], score)
    # training permutes the batch each epoch: the expected padding over permutations
    rng = np.random.default_rng(seed)
    perm_padded = np.array([np.mean([_micro_tokens(x[rng.permutation(len(x))], micro, prompt_len)[0]
                                     for _ in range(16)]) * epochs for x in lengths])
    train_calls = 2 * epochs * -(-len(lengths[0]) // micro)
    train0, train_tok = _lstsq([ones, perm_padded], train)

    a = shapes.actor
    prefill_flops_per_token = sum(2 * s.matmul_params(head) for s, head in (
        (shapes.actor, False), (shapes.reference, False), (shapes.critic, True), (shapes.reward, True)))
    train_flops_per_token = 3 * (2 * shapes.actor.matmul_params() + 2 * shapes.critic.matmul_params(True))
    other = float(np.mean([r["time/step_s"] - r["time/phase/generate"] - r["time/phase/score"]
                           - r["time/phase/train"] for r in steps]))
    device = with_measured(
        # a row's share of a decode step too small to measure: the step's cost is its call
        base, decode_flops=_rate(2 * a.matmul_params(), per_row), decode_call_s=float(per_step),
        prefill_flops=_rate(prefill_flops_per_token, score_tok), prefill_call_s=float(score0 / score_calls),
        train_flops=_rate(train_flops_per_token, train_tok), train_call_s=float(train0 / train_calls),
        layer_s=0.0, optim_s=0.0, step_other_s=other, rollout_setup_s=0.0)
    # the prompt prefill sits in the generate intercept: what is left is the rollout's setup
    prompt = _micro_tokens(np.zeros(len(lengths[0]), np.int64), len(lengths[0]), prompt_len)
    prefill = (device.prefill_call_s + 2 * a.matmul_params() * prompt[0] / device.prefill_flops)
    device = with_measured(device, rollout_setup_s=max(0.0, float(setup) - prefill))
    fit = {"generate": {"intercept_s": float(setup), "per_decode_step_s": float(per_step),
                        "per_row_token_s": float(per_row)},
           "score": {"intercept_s": float(score0), "per_padded_token_s": float(score_tok)},
           "train": {"intercept_s": float(train0), "per_padded_token_s": float(train_tok)},
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
    seq = read_steps(runs, "sequential")
    p = cfg.ppo
    device, fit = fit_cpu(seq, shapes, lay.prompt_len, p.micro_batch_size, p.mini_batch_size,
                          p.ppo_epochs, base=base, seed=seed)
    model = cost_model(cfg, shapes, device, lay)
    measured_modes = results.get("modes", {})
    out: dict = {"results": results_path, "fit": fit, "device": _device_json(device), "modes": {}}
    predicted = {}
    for mode in MODES:
        # replay the lengths the mode's own run generated, step by step (its policy drifted
        # its own way; the sequential run's when the mode was not run); timings are not read
        source = mode if os.path.isfile(os.path.join(runs, mode, "metrics.jsonl")) else "sequential"
        per_step = tuple(tuple(r["response/lengths"]) for r in read_steps(runs, source, warmup=0))
        sim = StepSimulator(model, dataclasses.replace(length_dist(cfg), per_step=per_step))
        runs_of_mode = [sim.run(s, steps=len(per_step), warmup=WARMUP, seed=seed)
                        for s in schedules(cfg, mode)]
        predicted[mode] = min(runs_of_mode, key=lambda r: r.mean("step_s"))
    base_s = predicted["sequential"].mean("step_s")
    measured_seq = _measured_step(runs, "sequential")
    for mode, res in predicted.items():
        entry = {"predicted_step_s": round(res.mean("step_s"), 5),
                 "predicted_speedup": round(base_s / res.mean("step_s"), 4),
                 "chunk_size": res.schedule.chunk if res.schedule.streamed else None,
                 "delta": res.schedule.delta,
                 "predicted_phases_s": {k: round(res.mean(k), 5) for k in ("generate", "score", "train")}}
        measured = measured_modes.get(mode, {}).get("speedup")
        if measured is not None and os.path.isdir(os.path.join(runs, mode)):
            entry["measured_step_s"] = round(_measured_step(runs, mode), 5)
            entry["measured_speedup"] = round(measured, 4)
            entry["speedup_error"] = round(entry["predicted_speedup"] / measured - 1.0, 4)
            entry["step_error"] = round(res.mean("step_s") / _measured_step(runs, mode) - 1.0, 4)
            entry["measured_phases_s"] = _measured_phases(runs, mode)
        out["modes"][mode] = entry
    out["measured_sequential_step_s"] = round(measured_seq, 5)
    return out


def _measured_step(runs: str, mode: str) -> float:
    """Mean step time after the warm-up: oppo-bench's speedup is samples/s, i.e. this mean."""
    return float(np.mean([r["time/step_s"] for r in read_steps(runs, mode)]))


def _measured_phases(runs: str, mode: str) -> dict:
    rows = read_steps(runs, mode)
    return {k: round(float(np.mean([r.get(f"time/phase/{k}", 0.0) for r in rows])), 5)
            for k in ("generate", "score", "train")}


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
    p = cfg.ppo
    device, _ = fit_cpu(read_steps(runs, "sequential"), resolve_shapes(cfg), layout(cfg, 1, 1).prompt_len,
                        p.micro_batch_size, p.mini_batch_size, p.ppo_epochs)
    return device
