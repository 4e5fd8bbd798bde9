"""Telemetry: phase timers, TensorBoard scalars, a metrics log, sample responses, a progress
bar, summary.json, and a Weights & Biases run when ``logging.wandb_project`` names one.

Only rank 0 writes. ``metrics.jsonl`` holds one line per step and is the run's history: a
resumed run truncates it (and ``samples.jsonl``) to the checkpoint's step and appends, so
summary.json always describes the whole run as if it had never stopped. The truncation
rewrites through a temporary file and a rename, and drops a last line a crash left half
written (``read_history``).
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Optional

import torch

from .datafiles import DataError
from .durable import write_durably

logger = logging.getLogger(__name__)


def _after_queued_work() -> float:
    """perf_counter once this process's GPU stream has run what was queued on it: CUDA
    kernels run asynchronously, and a phase that ends with forwards still queued (scoring)
    would hand its GPU time to the next one. The current stream only: a device-wide sync
    would also wait for NCCL receives posted for the stage placement's next message."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    return time.perf_counter()


class PhaseTimer:
    """Wall time of named phases within one step, and their (start, end) offsets from the
    timer's creation for a timeline trace."""

    def __init__(self):
        self.origin = time.perf_counter()
        self.times: dict[str, float] = {}
        self.events: list[tuple[str, str, float, float]] = []  # (lane, name, start_s, end_s)

    @contextmanager
    def phase(self, name: str):
        start = _after_queued_work()
        try:
            with torch.profiler.record_function(f"phase/{name}"):  # named in a profile
                yield
        finally:
            end = _after_queued_work()
            self.times[name] = self.times.get(name, 0.0) + end - start
            self.events.append(("phases", name, start - self.origin, end - self.origin))


PROFILE_ROWS = 60  # ops listed in a profile's table


@contextmanager
def profiled(stem: Optional[str]):
    """torch's profiler around the block when ``stem`` is set: ``stem``.txt, the ops by self
    CPU time (first by self device time when a GPU is present), and ``stem``.json, the trace
    (Perfetto)."""
    if stem is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        yield
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    prof.export_chrome_trace(stem + ".json")
    # On a GPU both: the kernels' time, and the host's, which bounds a step that issues many
    # small kernels (the length-oracle runs' decode and training were host-bound).
    sorts = (["self_device_time_total"] if gpu else []) + ["self_cpu_time_total"]
    averages = prof.key_averages()
    with open(stem + ".txt", "w") as f:
        for sort_by in sorts:
            f.write(f"ops by {sort_by}\n")
            f.write(averages.table(sort_by=sort_by, row_limit=PROFILE_ROWS) + "\n\n")
    logger.info("profile of the step: %s.txt and %s.json", stem, stem)


EVAL_TEXT_ROWS = 4  # responses of an evaluation shown in TensorBoard's text tab
WANDB_ID_FILE = "wandb-run-id"  # under output_dir: the run a resume continues, its last step


def check_wandb_installed(project: Optional[str]) -> None:
    """``ConfigError`` on ``logging.wandb_project`` when it names a project and the wandb
    package is missing (a ``wandb/`` folder of runs in the working directory is no package)."""
    import importlib.util

    from .config_types import ConfigError

    if project is None:
        return
    spec = importlib.util.find_spec("wandb")
    if spec is None or spec.origin is None:
        raise ConfigError("logging.wandb_project", (
            f"{project!r} asks for wandb logging, but the wandb package is not installed: pip "
            f"install wandb (or oppo-ds[wandb]), or set it null"))


class WandbRun:
    """The wandb run of the run in ``output_dir`` (rank 0): a resumed run continues the one
    whose id ``WANDB_ID_FILE`` holds, a fresh start begins another. wandb's steps only go
    forward, so a step at or before the last one sent (a crashed run's steps after its last
    checkpoint, repeated by the resume) is not sent again; the file keeps that step, as
    wandb offline does not. wandb's files go under ``output_dir/wandb``. A run wandb cannot
    start (not logged in, no network) is a ``ConfigError`` on ``logging.wandb_project`` naming
    the ways out; our launchers (deepspeed, srun --kill-on-bad-exit) then end the other
    ranks."""

    def __init__(self, output_dir: str, project: str, name: Optional[str], config: dict,
                 resumed: bool):
        import wandb

        from .config_types import ConfigError

        self.id_path = os.path.join(output_dir, WANDB_ID_FILE)
        self.run_id, self.last_step = None, -1
        if resumed and os.path.isfile(self.id_path):
            with open(self.id_path) as f:
                fields = f.read().split()
            if fields:
                self.run_id, self.last_step = fields[0], int(fields[1]) if len(fields) > 1 else -1
        if self.run_id is None:
            self.run_id = secrets.token_hex(4)  # as wandb's own ids: 8 of [a-z0-9]
            self._remember()
        try:
            self.run = wandb.init(project=project, id=self.run_id, resume="allow", config=config,
                                  name=name or os.path.basename(os.path.normpath(output_dir)),
                                  dir=output_dir, reinit="create_new")
        except Exception as err:  # wandb's own errors differ by cause and version
            raise ConfigError("logging.wandb_project", (
                f"wandb could not start the run ({type(err).__name__}: {err}): log in (wandb "
                f"login, or WANDB_API_KEY), or set WANDB_MODE=offline to write it under "
                f"{output_dir}/wandb for a later wandb sync, or set it null")) from None
        self.sent_step = self.last_step  # this sitting may add to the step sent last

    def _remember(self) -> None:
        tmp = self.id_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{self.run_id} {self.last_step}\n")
        os.replace(tmp, self.id_path)

    def log(self, step: int, metrics: dict) -> None:
        """``metrics`` at ``step``, unless an earlier sitting sent a later step; an evaluation
        after a step's metrics joins them (the same step)."""
        if step <= self.sent_step:
            return
        self.run.log(_wandb_values(metrics), step=step)
        if step > self.last_step:
            self.last_step = step
            self._remember()

    def finish(self, summary: dict, failed: bool) -> None:
        self.run.summary.update(summary)
        self.run.finish(exit_code=1 if failed else 0)


def _wandb_values(metrics: dict) -> dict:
    """A step's metrics as wandb takes them: numbers as they are, lists as histograms."""
    import wandb

    out = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)):
            out[key] = value
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            out[key] = wandb.Histogram(value)
    return out


class Telemetry:
    def __init__(self, output_dir: str, *, enabled: bool, tensorboard: bool, progress: bool,
                 total_steps: int, start_step: int, log_every: int,
                 wandb: Optional[dict] = None):
        """``wandb``: ``WandbRun``'s project, name and config, when a wandb run is wanted."""
        self.enabled = enabled
        self.output_dir = output_dir
        self.log_every = log_every
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self.samples_path = os.path.join(output_dir, "samples.jsonl")
        self.eval_path = os.path.join(output_dir, "eval.jsonl")
        self.eval_samples_path = os.path.join(output_dir, "eval_samples.jsonl")
        self.writer = None
        self.bar = None
        self.wandb = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if wandb is not None:  # first: a run wandb refuses leaves the history untouched
            self.wandb = WandbRun(output_dir, resumed=start_step > 0, **wandb)
        _truncate_history(self.metrics_path, start_step)
        if os.path.isfile(self.samples_path):
            _truncate_history(self.samples_path, start_step)
        for path in (self.eval_path, self.eval_samples_path):
            if os.path.isfile(path):  # a fresh start drops the old run's step-0 evaluation too
                _truncate_history(path, start_step if start_step else -1)
        _drop_traces_after(os.path.join(output_dir, "traces"), start_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard hides the older files' events from purge_step on: a resume's steps
            # after its checkpoint, a fresh start's step-0 evaluation too
            self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"),
                                        purge_step=start_step + 1 if start_step else 0)
        if progress:
            from tqdm import tqdm

            # disable=None: no bar when stderr is not a terminal (CI logs, redirected runs)
            self.bar = tqdm(total=total_steps, initial=start_step, desc="ppo", unit="step",
                            dynamic_ncols=True, disable=None)

    def log_step(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and value == value:
                    self.writer.add_scalar(key, value, step)
                elif isinstance(value, list) and value:
                    self.writer.add_histogram(key, torch.tensor(value, dtype=torch.float32), step)
        if self.wandb is not None:
            self.wandb.log(step, metrics)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                                 **({"gold": f"{metrics['gold/mean']:.3f}"} if "gold/mean" in metrics else {}))
        if self.log_every and step % self.log_every == 0:
            keys = ("reward/mean", "gold/mean", "kl/mean", "loss/policy", "loss/value",
                    "response/len_mean", "time/step_s")
            text = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
            (self.bar.write if self.bar is not None else print)(f"step {step}: {text}")

    def log_samples(self, step: int, samples: list[dict], show: bool) -> None:
        """Append ``samples`` (each with ``prompt``, ``response``, ``reward``, ...) to
        samples.jsonl, put them in TensorBoard's text tab, and print them when ``show``."""
        if not self.enabled or not samples:
            return
        with open(self.samples_path, "a", encoding="utf-8") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, **sample}, ensure_ascii=False) + "\n")
        if self.writer is not None:
            self.writer.add_text("samples", _markdown(samples), step)
        if show:
            write = self.bar.write if self.bar is not None else print
            for i, x in enumerate(samples):
                write(f"step {step} sample {i}: {_sample_head(x)}\n"
                      f"  prompt:   {_indent(x['prompt'], 12)}\n"
                      f"  response: {_indent(x['response'], 12)}")

    def log_eval(self, step: int, metrics: dict, records: list[dict]) -> None:
        """An evaluation after ``step`` (0: before training): its figures to eval.jsonl and
        TensorBoard (``eval/...``), every response to eval_samples.jsonl, a line printed."""
        if not self.enabled:
            return
        with open(self.eval_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        with open(self.eval_samples_path, "a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps({"step": step, **record}, ensure_ascii=False) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
            self.writer.add_text("eval", _markdown(records[:EVAL_TEXT_ROWS]), step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(step, metrics)
        if self.log_every:
            names = (("eval/reward_mean", "reward"), ("eval/gold_mean", "gold"),
                     ("eval/response_len_mean", "len"), ("eval/ended_frac", "ended"))
            text = " ".join(f"{name}={metrics[k]:.4g}" for k, name in names if k in metrics)
            when = f"after step {step}" if step else "before step 1"
            (self.bar.write if self.bar is not None else print)(
                f"eval {when}: {text} ({metrics['eval/prompts']} prompts, "
                f"{metrics['eval/time_s']:.1f}s)")

    def close(self, summary_extra: Optional[dict] = None) -> Optional[dict]:
        if not self.enabled:
            return None
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        summary = summarize(read_history(self.metrics_path))
        evaluations = read_history(self.eval_path)
        if evaluations:
            summary["eval"] = eval_summary(evaluations)
        summary.update(summary_extra or {})
        with open(os.path.join(self.output_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        if self.wandb is not None:  # called in a finally: a run ended by an exception failed
            self.wandb.finish(summary, failed=sys.exc_info()[0] is not None)
            self.wandb = None
        return summary


def _markdown(samples: list[dict]) -> str:
    """Responses with their prompts for TensorBoard's text tab (markdown)."""
    return "\n\n".join(f"**{_sample_head(x)}**\n\nprompt:\n\n    {_indent(x['prompt'])}\n\n"
                       f"response:\n\n    {_indent(x['response'])}" for x in samples)


def _sample_head(sample: dict) -> str:
    gold = f" gold={sample['gold']:.4g}" if sample.get("gold") is not None else ""
    end = "" if sample["ended"] else ", cut at max_new_tokens"
    tokens = f"{sample['length']} token" + ("s" if sample["length"] != 1 else "")
    return f"reward={sample['reward']:.4g}{gold} ({tokens}{end}; {sample['prompt_id']})"


def _indent(text: str, width: int = 4) -> str:
    """A multi-line text under a label ``width`` columns wide (a markdown code block when 4)."""
    return text.replace("\n", "\n" + " " * width)


def read_history(path: str) -> list[dict]:
    """The rows of a JSONL history (metrics.jsonl, ...). An unreadable last line, what a
    kill, a full disk or a lost node leaves of a row being appended, is dropped with a
    warning; one before it is corruption: a ``DataError`` naming the file and line."""
    return [row for _, row in _history_lines(path)]


def _history_lines(path: str) -> list[tuple[bytes, dict]]:
    """``(line, row)`` of each row of ``path``, as ``read_history`` reads them."""
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as f:  # bytes: a torn line may end inside a character
        numbered = [(i, line) for i, line in enumerate(f.read().split(b"\n"), 1)
                    if line.strip()]
    out = []
    for i, line in numbered:
        try:
            row = json.loads(line)
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            row = None
        if isinstance(row, dict):
            out.append((line, row))
        elif i == numbered[-1][0]:
            logger.warning("%s:%d: dropped an unreadable last line (%d bytes), what a crash "
                           "left of a row being written", path, i, len(line))
        else:
            raise DataError(f"{path}:{i}: not a JSON row, and not the last line (a torn "
                            f"write is only ever the last): the file is corrupt; repair or "
                            f"remove that line, or start afresh with checkpoint.resume=never")
    return out


def _drop_traces_after(trace_dir: str, last_step: int) -> None:
    """Remove the step traces (``stepN.json``) an earlier run in the same output directory
    wrote after ``last_step``: the run starting there writes its own."""
    if not os.path.isdir(trace_dir):
        return
    for name in os.listdir(trace_dir):
        match = re.fullmatch(r"step(\d+)\.json", name)
        if match and int(match.group(1)) > last_step:
            os.remove(os.path.join(trace_dir, name))


def _truncate_history(path: str, last_step: int) -> None:
    """Keep the rows of ``path`` up to ``last_step`` (none at a fresh start: ``last_step``
    below 1, where nothing of the old file is read), rewritten whole in one rename: a crash
    during the rewrite leaves the old file, not a part of it."""
    lines = [line for line, row in _history_lines(path) if row["step"] <= last_step] \
        if last_step >= 1 else []
    write_durably(path, lambda f: f.writelines(line + b"\n" for line in lines))


def _mean(xs):
    return statistics.fmean(xs) if xs else None


def _stdev(xs):
    """Sample standard deviation; NaN when a value is not finite (statistics.stdev raises
    AttributeError on a NaN), None under two values."""
    if len(xs) < 2:
        return None
    return statistics.stdev(xs) if all(math.isfinite(x) for x in xs) else float("nan")


def summarize(history: list[dict]) -> dict:
    """Reward and gold over the first and last 10 steps, with the step-to-step noise (the std
    of per-step means over the run's first 10 steps) to judge whether the change is real."""
    def column(key):
        return [r[key] for r in history if key in r]

    out = {"steps": len(history),
           "wall_s": sum(column("time/step_s"))}
    for key, name in (("reward/mean", "reward"), ("gold/mean", "gold")):
        values = column(key)
        if not values:
            continue
        out[f"{name}_first10"] = _mean(values[:10])
        out[f"{name}_last10"] = _mean(values[-10:])
        out[f"{name}_noise_std"] = _stdev(values[:10])
    samples = sum(column("samples"))
    out["samples"] = samples
    out["samples_per_s"] = samples / out["wall_s"] if out["wall_s"] else None
    phases = [k for k in (history[0] if history else {}) if k.startswith("time/phase/")]
    total = sum(sum(column(k)) for k in phases)
    if total:
        out["phase_fraction"] = {k.rsplit("/", 1)[-1]: sum(column(k)) / total for k in phases}
    lengths = sorted(x for row in column("response/lengths") for x in row)
    if lengths:
        out["response_len_mean"] = _mean(lengths)
        out["response_len_p50"] = lengths[len(lengths) // 2]
        # nearest rank: the smallest length at or above 99% of them (was one rank above it,
        # and the longest of all for 100 lengths or fewer)
        out["response_len_p99"] = lengths[max(0, math.ceil(0.99 * len(lengths)) - 1)]
    deferrals = deferral_summary(history)
    if deferrals:
        out["deferrals"] = deferrals
    return out


def eval_summary(evaluations: list[dict]) -> dict:
    """The first and last held-out evaluations of a run (eval.jsonl rows)."""
    first, last = evaluations[0], evaluations[-1]
    out = {"evaluations": len(evaluations), "first_step": first["step"], "last_step": last["step"]}
    for key, name in (("eval/reward_mean", "reward"), ("eval/gold_mean", "gold"),
                      ("eval/response_len_mean", "response_len")):
        if key in first:
            out[f"{name}_first"], out[f"{name}_last"] = first[key], last[key]
    return out


def deferral_summary(history: list[dict]) -> Optional[dict]:
    """Overcommitment over a run, from the per-step ``pool/deferrals`` lists (times each
    trained sequence was deferred): how many were deferred, and the share of those that
    finished within one extra step. None for a run without the pool."""
    counts = [d for r in history for d in r.get("pool/deferrals", [])]
    if not counts:
        return None
    deferred = [d for d in counts if d > 0]
    return {"trained": len(counts), "deferred": len(deferred),
            "deferred_share": len(deferred) / len(counts),
            "within_one_extra_step": (sum(1 for d in deferred if d == 1) / len(deferred)
                                      if deferred else 1.0),
            "max_deferrals": max(counts)}
