"""oppo-bench logic: run each schedule (mode) on the same workload, summarise, compare, plot.

Every mode runs as its own ``python -m oppo_ds.train`` process, one after another, so that no
state (caches, RNG, allocator, threads) carries from one mode into the next. The summary of a
run is a pure function of its ``metrics.jsonl`` rows (``summarize_mode``).
"""
from __future__ import annotations

import importlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from .rollout.waste import tail_waste


@dataclass(frozen=True)
class Mode:
    streams: bool
    """Whether scoring overlaps decoding (``oppo.streaming``); a mode that does not hides no
    scoring time."""
    overcommits: bool
    """Whether the step overcommits (``oppo.overcommit``, ``auto`` unless the user sets a
    Delta); a mode that does not runs with Delta = 0 whatever the user gives."""
    extra: tuple[str, ...] = ()
    """Further overrides of the mode, applied before the user's."""

    @property
    def defaults(self) -> tuple[str, ...]:
        """Overrides applied before the user's: the settings a user may tune for this mode
        (the streaming modes choose their chunk size online, as OPPO does; the overcommitting
        ones adapt Delta)."""
        return ((("oppo.chunk_size=auto",) if self.streams else ())
                + (("oppo.overcommit=auto",) if self.overcommits else ()) + self.extra)

    @property
    def pinned(self) -> tuple[str, ...]:
        """Overrides applied after the user's: what makes this mode this mode. A user's
        ``oppo.overcommit=16`` reaches the overcommitting modes only; without this an
        ``intra`` run given it overcommitted too and was oppo under another name (the first
        H100 run, 2026-11-26)."""
        return ((f"oppo.streaming={'true' if self.streams else 'false'}",)
                + (() if self.overcommits else ("oppo.overcommit=0",)))


# The one table of schedules oppo-bench can run: adding a mode is one line here. Each mode
# sets both techniques, so a config that turns one on (llama3_70b.yaml overcommits) still gives
# a true baseline.
MODES: dict[str, Mode] = {
    "sequential": Mode(streams=False, overcommits=False),
    "intra": Mode(streams=True, overcommits=False),
    "inter": Mode(streams=False, overcommits=True),
    "oppo": Mode(streams=True, overcommits=True),
}
# A user override of these keys would turn one mode into another: refused up front.
MODE_KEYS = ("oppo.streaming",)
# Other systems run on the same workload for comparison: name -> the module whose CLI takes
# [--config FILE] --steps N --seed S --out DIR [KEY=VALUE ...] and writes DIR/metrics.jsonl in
# our format (oppo_ds/peers/).
PEERS: dict[str, str] = {"trl": "oppo_ds.peers.trl_peer"}
PEER_PACKAGES = {"trl": "trl"}

# Named by the design but not implemented yet: asked for, a mode here is refused up front
# rather than silently run as another mode.
PLANNED_MODES: tuple[str, ...] = ()

# Every child run starts fresh and writes nothing the benchmark does not read.
# evaluation runs between the steps the modes are compared on: off, no run spends time on it
BASE_OVERRIDES = ("checkpoint.resume=never", "checkpoint.final=false", "checkpoint.export_hf=false",
                  "logging.progress=false", "eval.prompts=null")


class BenchError(Exception):
    """A failure shown to the user as one message; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


VARIANT_SEP = "@"  # "oppo@graph": mode oppo with the overrides of variant graph
_VARIANT_NAME = re.compile(r"[A-Za-z0-9_-]+")


def base_mode(entry: str) -> str:
    """The schedule of a ``--modes`` entry: ``oppo@graph`` -> ``oppo`` (of a ``--peers`` entry
    the peer: ``trl@graph`` -> ``trl``)."""
    return entry.split(VARIANT_SEP, 1)[0]


def variant_of(entry: str) -> Optional[str]:
    """The variant a ``--modes`` entry names: ``oppo@graph`` -> ``graph``, ``oppo`` -> None."""
    return entry.split(VARIANT_SEP, 1)[1] if VARIANT_SEP in entry else None


def parse_variants(items: list[str]) -> dict[str, list[str]]:
    """``--variant NAME:KEY=VALUE[,KEY=VALUE...]`` (each may be given several times) ->
    {NAME: [KEY=VALUE, ...]}: overrides that a ``--modes`` entry ``MODE@NAME`` adds to its
    run, after the ones every mode gets (so that one benchmark compares, say, a decode option
    under each schedule against the same sequential baseline). A comma splits overrides only
    before another ``KEY=``, so a list value keeps its commas. A malformed item, a name that
    is not letters, digits, ``-`` or ``_``, or a key a mode sets itself raises BenchError
    (code 2)."""
    variants: dict[str, list[str]] = {}
    for item in items:
        name, sep, rest = item.partition(":")
        if not sep or not _VARIANT_NAME.fullmatch(name) or not rest.strip():
            raise BenchError(f"--variant {item!r}: expected NAME:KEY=VALUE[,KEY=VALUE...] with a "
                             f"NAME of letters, digits, - or _", code=2)
        overrides = [o.strip() for o in re.split(r",(?=\s*[A-Za-z_][\w.]*=)", rest)]
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise BenchError(f"--variant {item!r}: {bad[0]!r} is not KEY=VALUE", code=2)
        check_user_overrides(overrides)
        variants.setdefault(name, []).extend(overrides)
    return variants


def parse_modes(text: str, variants: Optional[dict[str, list[str]]] = None) -> list[str]:
    """``"sequential,intra"`` -> ["sequential", "intra"]; ``oppo@graph`` is mode oppo with
    variant graph's overrides (``parse_variants``). An unknown or planned mode, or an
    undefined variant, raises BenchError(code=2) naming what is available."""
    variants = variants or {}
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if base_mode(m) not in MODES]
    if not modes or unknown:
        planned = [m for m in unknown if m in PLANNED_MODES]
        what = (f"mode(s) {', '.join(planned)} not implemented yet" if planned and planned == unknown
                else f"unknown mode(s) {', '.join(unknown) or repr(text)}")
        raise BenchError(f"{what}; available modes: {', '.join(MODES)}", code=2)
    undefined = [m for m in modes if variant_of(m) not in (None, *variants)]
    if undefined:
        defined = ", ".join(variants) or "none"
        raise BenchError(f"{', '.join(undefined)}: no such --variant (defined: {defined}); "
                         f"define one with --variant NAME:KEY=VALUE,...", code=2)
    if len(set(modes)) != len(modes):
        raise BenchError(f"mode listed twice in {text!r}", code=2)
    return modes


def child_overrides(mode: str, steps: int, seed: int, run_dir: str, user: list[str],
                    trace_step: Optional[int] = None,
                    variants: Optional[dict[str, list[str]]] = None) -> list[str]:
    """The child run's overrides; ``trace_step`` asks for the Chrome trace of that step (and
    of its multiples) for the timeline plot. A mode that does not stream scores after
    generation wherever ``oppo.placement`` says to stream: it is set to inline for it (last,
    so that ``oppo.placement=stage`` given for the streaming modes leaves the others valid;
    with ``--ranks N`` they then train on all N ranks, the stage modes on N - 1 and the
    scorer rank). ``mode`` may name a variant (``oppo@graph``): its overrides follow the
    user's."""
    schedule = MODES[base_mode(mode)]
    variant = (variants or {})[variant_of(mode)] if variant_of(mode) else []
    trace = [f"logging.trace_every={trace_step}"] if trace_step else []
    placement = [] if schedule.streams else ["oppo.placement=inline"]
    return [f"steps={steps}", f"seed={seed}", f"logging.output_dir={run_dir}", *BASE_OVERRIDES,
            *trace, *schedule.defaults, *user, *variant, *schedule.pinned, *placement]


def check_user_overrides(user: list[str]) -> None:
    """Refuse (BenchError, code 2) a user override that would make every mode the same
    schedule: each mode sets ``oppo.streaming`` itself."""
    for item in user:
        key = item.split("=", 1)[0].strip()
        if key in MODE_KEYS:
            each = ", ".join(f"{name}: {str(mode.streams).lower()}" for name, mode in MODES.items())
            raise BenchError(f"{item!r}: {key} is set by each mode ({each}); choose the modes "
                             f"with --modes instead", code=2)


def trace_step(steps: int, warmup: int) -> int:
    """The step whose timeline is drawn: the middle of the timed steps (past the warm-up, and
    past chunk_size: auto's two calibration steps)."""
    first = min(warmup, steps - 1) + 1
    return max(first, (first + steps) // 2)


# ------------------------------------------------------------------ summary (pure)

def _mean(xs: list[float]) -> Optional[float]:
    return statistics.fmean(xs) if xs else None


def summarize_mode(steps: list[dict], warmup: int = 2, hidden_default: Optional[float] = None) -> dict:
    """A mode's benchmark fields from its metrics.jsonl rows (one dict per step).

    Timing fields (step_time_s, samples_per_s, tokens_per_s, decode_s, phase_fraction,
    scoring_hidden_frac) use the steps after the first ``warmup`` (at least one step is always
    kept); reward, gold and tail waste use every step. tokens_per_s: the trained responses'
    tokens (``response/lengths``) over the same time as samples_per_s, None when a timed step
    has no lengths; a schedule that trains shorter responses first (the pool's) gains
    samples/s over a few steps that it does not gain tokens/s. ``hidden_default`` is
    scoring_hidden_frac when no step reports it (0.0 for a mode that does not stream:
    nothing is hidden), and then also
    scoring_overlap_frac's (the part of scoring that ran concurrently with the actor's decode;
    a run logged before the key existed has None). decode_s: the median of the generate
    phase less the scoring the actor waited for (``stream/scoring_tail_s`` after its last
    token; under ``inline`` also ``stream/scoring_between_chunks_s``), the actor's own decode.
    """
    if not steps:
        raise ValueError("no steps to summarise")
    skipped = min(warmup, len(steps) - 1)
    timed = steps[skipped:]

    def column(rows, key):
        return [r[key] for r in rows if key in r]

    step_times = column(timed, "time/step_s")
    total_time = sum(step_times)
    out = {
        "steps": len(steps),
        "warmup_steps": skipped,
        "step_time_s": statistics.median(step_times) if step_times else None,
        "samples_per_s": sum(column(timed, "samples")) / total_time if total_time > 0 else None,
    }
    lengths = column(timed, "response/lengths")
    out["tokens_per_s"] = (sum(sum(x) for x in lengths) / total_time
                           if total_time > 0 and len(lengths) == len(timed) else None)
    for key, name in (("reward/mean", "reward"), ("gold/mean", "gold")):
        values = column(steps, key)
        if values:
            out[f"{name}_first"] = _mean(values[:10])
            out[f"{name}_last"] = _mean(values[-10:])
    # the mean of the timed steps' fractions (each step weighs the same, however long its
    # scoring; the planner's simulation weighs by scorer time)
    hidden = column(timed, "stream/scoring_hidden_frac")
    out["scoring_hidden_frac"] = _mean(hidden) if hidden else hidden_default
    # the part that ran while the actor was busy: 0 inline, where scoring waits between chunks
    overlap = column(timed, "stream/scoring_overlap_frac")
    out["scoring_overlap_frac"] = _mean(overlap) if overlap else \
        (0.0 if hidden_default == 0.0 else None)
    # the trainer reports the decode slots its rollout really left idle (with the pool, its
    # rows stop at the B-th finish); older runs only have the lengths
    waste = column(steps, "rollout/tail_waste_frac") or \
        [tail_waste(x) for x in column(steps, "response/lengths")]
    out["tail_waste_frac"] = _mean(waste)
    # the actor's rollout alone: its generate phase less the wait for the scorers after its
    # last token (where a placement's contention with the decode shows: on the fifth GPU run
    # the colocated decode with a CUDA graph was 5-7% slower than the sequential one)
    decode = [r["time/phase/generate"] - r.get("stream/scoring_tail_s", 0.0)
              - r.get("stream/scoring_between_chunks_s", 0.0)
              for r in timed if "time/phase/generate" in r]
    out["decode_s"] = statistics.median(decode) if decode else None
    phases = list(dict.fromkeys(k for r in timed for k in r if k.startswith("time/phase/")))  # step order
    phase_total = sum(sum(column(timed, k)) for k in phases)
    out["phase_fraction"] = ({k[len("time/phase/"):]: sum(column(timed, k)) / phase_total for k in phases}
                             if phase_total > 0 else {})
    return out


def add_speedups(modes: dict[str, dict]) -> None:
    """speedup = samples_per_s / sequential's samples_per_s (None without a sequential run)."""
    base = modes.get("sequential", {}).get("samples_per_s")
    for fields in modes.values():
        rate = fields.get("samples_per_s")
        fields["speedup"] = rate / base if base and rate is not None else None


# timing fields of a mode that differ from round to round; the rest (reward, gold, tail waste)
# is the same in every round (same code, workload and seeds)
ROUND_FIELDS = ("step_time_s", "samples_per_s", "tokens_per_s", "speedup", "decode_s",
                "scoring_hidden_frac", "scoring_overlap_frac",
                "ideal_step_time_s", "of_ideal", "process_s", "outside_steps_s")


def add_process_time(fields: dict, steps: list[dict], process_s: float) -> None:
    """``process_s``: the mode's child process(es) from launch to exit; ``outside_steps_s``:
    the part of it no step took (imports, building the models and engines, the exit): on a
    GPU at Qwen2.5-0.5B shapes about 90 s a mode, which a benchmark of few steps spends mostly
    there."""
    fields["process_s"] = process_s
    fields["outside_steps_s"] = process_s - sum(r.get("time/step_s", 0.0) for r in steps)


def round_dir(workdir: str, name: str, round_index: int) -> str:
    """Where round ``round_index`` (1-based) of a mode or peer runs: ``workdir/name`` for the
    first (the layout of a single-round benchmark), ``workdir/name.roundK`` after it."""
    return os.path.join(workdir, name if round_index == 1 else f"{name}.round{round_index}")


def combine_rounds(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """One summary per name (mode or peer) from the same benchmark repeated round-robin.

    Every round runs every mode once, one after another, and ``rounds[k]`` holds round k's
    summaries with their speedups already taken within that round (against that round's
    sequential run). Each timing field becomes the median over the rounds: a mode's
    ``speedup`` is thus the median of ratios between runs taken minutes apart, which a drift
    of the machine's speed over the whole benchmark does not bias. ``rounds`` (per name) keeps
    each round's timing fields; ``phase_fraction`` is averaged; the other fields, the same in
    every round, are the first round's."""
    if not rounds:
        raise ValueError("no rounds to combine")
    out = {}
    for name, first in rounds[0].items():
        per_round = [r[name] for r in rounds if name in r]
        fields = dict(first)
        for key in ROUND_FIELDS:
            values = [r.get(key) for r in per_round if r.get(key) is not None]
            fields[key] = statistics.median(values) if values else first.get(key)
        phases = list(dict.fromkeys(k for r in per_round for k in r.get("phase_fraction", {})))
        fields["phase_fraction"] = {k: statistics.fmean(r.get("phase_fraction", {}).get(k, 0.0)
                                                        for r in per_round) for k in phases}
        fields["rounds"] = [{key: r.get(key) for key in ROUND_FIELDS} for r in per_round]
        out[name] = fields
    return out


def ideal_step_time(steps: list[dict], warmup: int = 2) -> Optional[float]:
    """The step time of a sequential run if scoring were fully hidden under decoding and no
    decode slot were wasted on the tail, from its own measured phases (median over the steps
    after ``warmup``): per step, ``generate * (1 - tail_waste) + advantages + train``, with the
    tail waste of that step's lengths (decoding costs per token step: a batch whose rows all
    had the mean length would decode mean / max of the steps). None without phase times."""
    timed = steps[min(warmup, len(steps) - 1):]
    ideal = []
    for r in timed:
        if "time/phase/generate" not in r or "response/lengths" not in r:
            continue
        waste = tail_waste(r["response/lengths"])
        ideal.append(r["time/phase/generate"] * (1.0 - waste) + r.get("time/phase/advantages", 0.0)
                     + r.get("time/phase/train", 0.0))
    return statistics.median(ideal) if ideal else None


def add_ideal(modes: dict[str, dict], ideal_s: Optional[float]) -> None:
    """of_ideal = ideal step time / the mode's median step time (1.0 = the bound reached)."""
    for fields in modes.values():
        step = fields.get("step_time_s")
        fields["ideal_step_time_s"] = ideal_s
        fields["of_ideal"] = ideal_s / step if ideal_s and step else None


# ------------------------------------------------------------------ running

def prepare_run_dir(run_dir: str) -> None:
    """Start each mode in an empty directory; only a directory an earlier oppo-bench left
    (it holds stdout.log) is cleared, never one the user keeps something else in."""
    if os.path.isdir(run_dir) and os.listdir(run_dir):
        if not os.path.isfile(os.path.join(run_dir, "stdout.log")):
            raise BenchError(f"{run_dir} exists and was not written by oppo-bench; "
                             f"choose another --workdir", code=2)
        shutil.rmtree(run_dir)
    os.makedirs(run_dir, exist_ok=True)


def _last_lines(path: str, n: int = 20) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def parse_peers(text: Optional[str], variants: Optional[dict[str, list[str]]] = None) -> list[str]:
    """``"trl,trl@graph"`` -> ["trl", "trl@graph"]: ``PEER@NAME`` runs the peer with the
    overrides of ``--variant NAME`` after the user's, as ``MODE@NAME`` does a mode (so that,
    say, TRL decodes with the static cache our ``@graph`` modes use). An unknown peer, an
    undefined variant or a peer listed twice raises BenchError (code 2)."""
    variants = variants or {}
    peers = [p.strip() for p in (text or "").split(",") if p.strip()]
    unknown = [p for p in peers if base_mode(p) not in PEERS]
    if unknown:
        raise BenchError(f"unknown peer(s) {', '.join(unknown)}; available peers: {', '.join(PEERS)}",
                         code=2)
    undefined = [p for p in peers if variant_of(p) not in (None, *variants)]
    if undefined:
        raise BenchError(f"{', '.join(undefined)}: no such --variant (defined: "
                         f"{', '.join(variants) or 'none'}); define one with --variant "
                         f"NAME:KEY=VALUE,...", code=2)
    if len(set(peers)) != len(peers):
        raise BenchError(f"peer listed twice in {text!r}", code=2)
    return peers


def peer_overrides(peer: str, user: list[str],
                   variants: Optional[dict[str, list[str]]] = None) -> list[str]:
    """A peer's overrides: the user's, then those of the variant it names (``trl@graph``)."""
    return [*user, *((variants or {})[variant_of(peer)] if variant_of(peer) else [])]


def run_peer(peer: str, config: Optional[str], steps: int, seed: int, user: list[str],
             run_dir: str, variants: Optional[dict[str, list[str]]] = None) -> list[dict]:
    """Run a peer system (``trl`` or ``trl@NAME``) in a child process on the same workload;
    its metrics rows."""
    cmd_args = [*(["--config", config] if config else []), "--steps", str(steps), "--seed", str(seed),
                "--out", run_dir, *peer_overrides(peer, user, variants)]
    return run_mode(f"peer {peer}", None, cmd_args, run_dir, module=PEERS[base_mode(peer)])


def check_peer(peer: str, config: Optional[str], steps: int, seed: int, user: list[str],
               variants: Optional[dict[str, list[str]]] = None) -> None:
    """Refuse (BenchError, exit 2) a workload the peer cannot run, before any mode runs."""
    from .config import ConfigError

    module = importlib.import_module(PEERS[base_mode(peer)])
    try:
        module.check_settings(config, peer_overrides(peer, user, variants), steps, seed)
    except (ConfigError, module.PeerSettingError) as err:
        raise BenchError(f"peer {peer!r}: {err}", code=2) from None


def run_order(runs: list, round_index: int) -> list:
    """The order round ``round_index`` (1-based) runs ``runs`` (the modes, then the peers) in:
    rotated by one place a round, so that over the rounds each runs first, last and between,
    and a drift of the machine's speed over the benchmark lands on no one run alone (without
    it the peers always ran last)."""
    shift = (round_index - 1) % len(runs) if runs else 0
    return runs[shift:] + runs[:shift]


def mode_ranks(mode: str, ranks: int, baseline_ranks: Optional[int] = None) -> int:
    """The processes ``mode`` runs as: ``ranks``, or for a mode that does not stream
    (sequential, inter) ``baseline_ranks`` when given."""
    if baseline_ranks is None or MODES[base_mode(mode)].streams:
        return ranks
    return baseline_ranks


def launch_command(module: str, args: list[str], ranks: int = 1) -> list[str]:
    """The command of one run: ``python -m module`` for one process, else DeepSpeed's
    launcher starting ``ranks`` processes on this machine (``deepspeed --num_gpus ranks``, on
    a free port; with GPUs one per process)."""
    if ranks < 1:
        raise BenchError(f"--ranks must be >= 1, got {ranks}", code=2)
    if ranks == 1:
        return [sys.executable, "-m", module, *args]
    from .engines.deepspeed_engine import find_free_port

    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
            "--master_port", str(find_free_port()), "--module", module, *args]


# what a launcher tells a process about the world it belongs to
RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT")


def child_env(ranks: int, env: Optional[dict] = None, cores: Optional[int] = None) -> dict:
    """The environment of one run: this process's, less the rendezvous variables when the
    run is one process (it is a world of its own; DeepSpeed's launcher sets them for several).
    A leftover LOCAL_RANK made accelerate, under TRL's trainer, wait for a distributed world
    that did not exist (MASTER_ADDR expected, but not set). Several processes share the
    machine's ``cores`` (default: this machine's): each gets its share of torch threads
    (``OMP_NUM_THREADS``, unless it is set), as torchrun does; by default each would start
    one thread per core, more threads than cores in all (on the 2-core development VM a
    second process of 2 threads made tiny-model steps several times slower, see
    docs/benchmarks.md)."""
    env = dict(os.environ if env is None else env)
    if ranks == 1:
        for key in RENDEZVOUS_VARS:
            env.pop(key, None)
    else:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (cores or os.cpu_count() or 1) // ranks)))
    return env


def run_mode(mode: str, config: Optional[str], overrides: list[str], run_dir: str,
             module: str = "oppo_ds.train", ranks: int = 1) -> list[dict]:
    """Train ``mode`` in a child process (``ranks`` of them under DeepSpeed's launcher);
    returns its metrics rows or raises BenchError."""
    prepare_run_dir(run_dir)
    log_path = os.path.join(run_dir, "stdout.log")
    cmd = launch_command(module, [*(["--config", config] if config else []), *overrides], ranks)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=child_env(ranks)).returncode
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if code != 0 or not os.path.isfile(metrics_path):
        raise BenchError(f"mode {mode!r} failed (exit {code}); log: {log_path}; last lines:\n"
                         + _last_lines(log_path))
    with open(metrics_path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _cpu_model() -> Optional[str]:
    """The processor's name (Linux: /proc/cpuinfo), else what ``platform`` knows, else None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_info() -> dict:
    """Where the numbers were taken; the load average shows whether others shared the CPU
    (on a small CPU a busy neighbour slows torch's threads far more than its share). The
    processor's name too: on a GPU the decode by default is bound by the host issuing
    kernels, so two machines with the same GPU gave the sequential baseline 1.5x apart
    (docs/benchmarks.md, the fifth GPU run)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        ds_version = version("deepspeed")
    except PackageNotFoundError:
        ds_version = None
    cuda = torch.cuda.is_available()
    return {"platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "cpu_model": _cpu_model(),
            "torch": torch.__version__, "deepspeed": ds_version,
            "cuda_device": torch.cuda.get_device_name(0) if cuda else None,
            "cuda_device_count": torch.cuda.device_count() if cuda else 0,
            "load_avg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None}


# ------------------------------------------------------------------ reporting

def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(modes: dict[str, dict]) -> str:
    header = ("mode", "step_time_s", "samples/s", "tokens/s", "speedup", "of ideal", "decode_s",
              "hidden",
              "concurrent", "tail waste", "reward first->last")
    rows = [header]
    for name, m in modes.items():
        rows.append((name, _fmt(m["step_time_s"], ".4f"), _fmt(m["samples_per_s"], ".2f"),
                     _fmt(m.get("tokens_per_s"), ".1f"),
                     _fmt(m["speedup"], ".2f") + ("x" if m["speedup"] is not None else ""),
                     _fmt(m.get("of_ideal"), ".1%"), _fmt(m.get("decode_s"), ".4f"),
                     _fmt(m["scoring_hidden_frac"], ".1%"),
                     _fmt(m.get("scoring_overlap_frac"), ".1%"), _fmt(m["tail_waste_frac"], ".1%"),
                     f"{_fmt(m.get('reward_first'), '.3f')} -> {_fmt(m.get('reward_last'), '.3f')}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def format_rounds(modes: dict[str, dict]) -> str:
    """Each mode's speedup round by round (a repeated benchmark's table gives their medians)."""
    rows = [(name, [r.get("speedup") for r in m.get("rounds", [])]) for name, m in modes.items()]
    width = max(len(name) for name, _ in rows)
    lines = ["speedup per round (the table gives their medians):"]
    lines += [f"  {name.ljust(width)}  " + "  ".join(_fmt(x, ".2f") + "x" for x in values)
              for name, values in rows if values]
    return "\n".join(lines)


def format_markdown(report: dict) -> str:
    """The results as a markdown table (modes, then peers), with the run's facts."""
    machine = report.get("machine", {})
    repeat = report.get("repeat") or 1
    rounds = (f" {repeat} rounds round-robin, medians over the rounds (a speedup: the median of "
              f"the rounds' own);" if repeat > 1 else "")
    ranks, base = report.get("ranks") or 1, report.get("baseline_ranks") or report.get("ranks") or 1
    procs = "" if ranks == base == 1 else \
        (f" {ranks} processes per mode," if ranks == base else
         f" {ranks} processes per streaming mode, {base} per mode that does not stream,")
    cpu = f" ({machine['cpu_model']})" if machine.get("cpu_model") else ""
    lines = [f"`oppo-bench` {report.get('steps')} steps per run,{procs}{rounds} seed {report.get('seed')}, "
             f"config {report.get('config') or 'built-in workload'}; {machine.get('platform')}, "
             f"{machine.get('cpu_count')} CPUs{cpu}, GPU: {machine.get('cuda_device') or 'none'}, "
             f"torch {machine.get('torch')}, DeepSpeed {machine.get('deepspeed')}.",
             *[f"`@{name}`: {' '.join(overrides)}." for name, overrides in
               (report.get("variants") or {}).items()],
             "",
             "| run | step time (median) | samples/s | tokens/s | speedup | of ideal | "
             "decode (median) | scoring hidden | scoring concurrent | tail waste | "
             "reward first -> last | gold first -> last |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = [(name, m) for name, m in report.get("modes", {}).items()]
    rows += [(f"{name} (peer)", m) for name, m in report.get("peers", {}).items()]
    for name, m in rows:
        lines.append(
            f"| {name} | {_fmt(m.get('step_time_s'), '.4f')} s | {_fmt(m.get('samples_per_s'), '.2f')} | "
            f"{_fmt(m.get('tokens_per_s'), '.1f')} | "
            f"{_fmt(m.get('speedup'), '.2f')}x | {_fmt(m.get('of_ideal'), '.1%')} | "
            f"{_fmt(m.get('decode_s'), '.4f')} s | {_fmt(m.get('scoring_hidden_frac'), '.1%')} | "
            f"{_fmt(m.get('scoring_overlap_frac'), '.1%')} | {_fmt(m.get('tail_waste_frac'), '.1%')} | "
            f"{_fmt(m.get('reward_first'), '.3f')} -> {_fmt(m.get('reward_last'), '.3f')} | "
            f"{_fmt(m.get('gold_first'), '.3f')} -> {_fmt(m.get('gold_last'), '.3f')} |")
    if repeat > 1:
        lines.append("\nSpeedup per round: " + "; ".join(
            f"{name} " + ", ".join(_fmt(r.get("speedup"), ".2f") + "x" for r in m.get("rounds", []))
            for name, m in report.get("modes", {}).items()) + ".")
    for name, ratio in report.get("ratios", {}).items():
        lines.append(f"\n{name}: {_fmt(ratio, '.2f')}x")
    return "\n".join(lines) + "\n"


def plot(histories: dict[str, list[dict]], modes: dict[str, dict], path: str) -> None:
    """(a) reward and (b) gold against samples seen, (c) reward and (d) gold against training
    time, per mode; (e) median step time per mode with its phase breakdown stacked (each
    phase's share of phase time times the median step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(11, 11.5))
    (ax_reward, ax_gold), (ax_wall, ax_gold_wall), (ax_time, ax_unused) = axes
    ax_unused.axis("off")
    for i, (name, rows) in enumerate(histories.items()):
        seen, wall, total, elapsed = [], [], 0, 0.0
        for r in rows:
            total += r.get("samples", 0)
            elapsed += r.get("time/step_s", 0.0)
            seen.append(total)
            wall.append(elapsed)
        style = dict(label=name, linestyle=("-", "--", ":", "-.")[i % 4], marker="o",
                     markersize=2)  # modes with the same samples overlap: keep them visible
        ax_reward.plot(seen, [r.get("reward/mean", float("nan")) for r in rows], **style)
        ax_gold.plot(seen, [r.get("gold/mean", float("nan")) for r in rows], **style)
        ax_wall.plot(wall, [r.get("reward/mean", float("nan")) for r in rows], **style)
        ax_gold_wall.plot(wall, [r.get("gold/mean", float("nan")) for r in rows], **style)
    ax_reward.set(xlabel="samples seen", ylabel="reward/mean", title="(a) reward against samples")
    ax_gold.set(xlabel="samples seen", ylabel="gold/mean", title="(b) gold score against samples")
    ax_wall.set(xlabel="training time (s, sum of step times)", ylabel="reward/mean",
                title="(c) reward against time")
    ax_gold_wall.set(xlabel="training time (s, sum of step times)", ylabel="gold/mean",
                     title="(d) gold score against time")
    for ax in (ax_reward, ax_gold, ax_wall, ax_gold_wall):
        ax.legend(fontsize="small")
    names = list(modes)
    phases = list(dict.fromkeys(p for m in modes.values() for p in m["phase_fraction"]))
    bottoms = [0.0] * len(names)
    for phase in phases:
        heights = [(modes[n]["step_time_s"] or 0.0) * modes[n]["phase_fraction"].get(phase, 0.0)
                   for n in names]
        ax_time.bar(names, heights, bottom=bottoms, label=phase)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax_time.set(ylabel="median step time (s)", title="(e) step time by phase")
    ax_time.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# Lanes of the timeline, top to bottom; trace lanes map onto them (see timeline_lanes).
TIMELINE_LANES = ("actor decode", "reward", "reference", "critic", "scoring (batched)", "training")


def timeline_lanes(trace: dict) -> dict[str, list[tuple[float, float]]]:
    """One step's Chrome trace (the trainer's ``traces/stepN.json``) as {lane: [(start_s,
    duration_s)]} from the step's start. Streamed runs have the actor's chunks and each
    scorer's calls on their own lanes; the phases give the rest: ``generate`` is the actor
    lane when no chunk was traced, ``score`` is scoring after decoding, ``advantages`` and
    ``train`` are training."""
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [(names.get(e["tid"], "?"), e["name"], e["ts"] / 1e6, e["dur"] / 1e6)
             for e in events if e.get("ph") == "X"]
    origin = min((start for _, _, start, _ in spans), default=0.0)
    lanes: dict[str, list[tuple[float, float]]] = {lane: [] for lane in TIMELINE_LANES}
    streamed = any(lane == "actor" for lane, _, _, _ in spans)
    for lane, name, start, dur in spans:
        at = (start - origin, dur)
        if lane == "actor":
            lanes["actor decode"].append(at)
        elif lane in ("reward", "reference", "critic"):
            lanes[lane].append(at)
        elif lane == "phases":
            if name == "generate" and not streamed:
                lanes["actor decode"].append(at)
            elif name == "score":
                lanes["scoring (batched)"].append(at)
            elif name in ("advantages", "train"):
                lanes["training"].append(at)
    return lanes


def plot_timeline(traces: dict[str, dict], path: str) -> None:
    """One traced step per mode, lanes as in the OPPO paper's Figure 1: the actor's decode,
    each scorer's prefill, batched scoring and training, on one time axis per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 1.2 + 1.6 * len(traces)), sharex=True,
                             squeeze=False)
    for ax, (mode, trace) in zip(axes[:, 0], traces.items()):
        lanes = timeline_lanes(trace)
        used = [lane for lane in TIMELINE_LANES if lanes[lane]]
        for y, lane in enumerate(reversed(used)):
            ax.broken_barh(lanes[lane], (y - 0.35, 0.7), color=f"C{TIMELINE_LANES.index(lane)}")
        ax.set_yticks(range(len(used)), list(reversed(used)), fontsize="small")
        step = trace.get("step")
        ax.set_title(f"{mode}" + (f" (step {step})" if step is not None else ""), fontsize="medium",
                     loc="left")
    axes[-1, 0].set_xlabel("seconds from the start of the step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def timeline_path(plot_path: str) -> str:
    """Where ``--plot OUT.png`` puts the timeline: ``OUT-timeline.png``."""
    root, ext = os.path.splitext(plot_path)
    return f"{root}-timeline{ext or '.png'}"


def read_trace(run_dir: str, step: int) -> Optional[dict]:
    path = os.path.join(run_dir, "traces", f"step{step}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        trace = json.load(f)
    trace["step"] = step
    return trace
