"""oppo-bench: the same workload and seeds under each schedule, one process after another.

    oppo-bench --config examples/configs/tiny.yaml --modes sequential,intra --steps 50 \
        --json bench.json --plot bench.png
    oppo-bench --config FILE --modes sequential --steps 20 --json out.json ppo.batch_size=32

Each mode runs ``python -m oppo_ds.train`` in its own process with its run directory under
--workdir (default: next to the JSON, ``<json without .json>.runs/``); its output goes to
``<workdir>/<mode>/stdout.log``. Modes and the overrides that select them: oppo_ds.bench.MODES.
With ``--ranks N`` each mode runs as N processes under DeepSpeed's launcher (one per GPU):

    oppo-bench --ranks 8 --config FILE --modes sequential,oppo --steps 50 --json out.json \
        oppo.placement=stage      # oppo: 7 actor ranks + the scorer rank; sequential: 8 ranks

``--baseline-ranks M`` gives the modes that do not stream M processes instead (M = 7 above:
the same run as oppo's 7 actor ranks, on the same machine).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

from .. import bench
from ..config import ConfigError, load_config
from .argtypes import output_file_in_new_folders, seed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oppo-bench",
        description="Compare PPO schedules (sequential baseline vs OPPO's overlaps) on one workload.")
    parser.add_argument("--config", metavar="FILE",
                        help="YAML config file (see examples/configs/); default: the built-in workload")
    parser.add_argument("--modes", required=True,
                        help=f"comma-separated modes to run; available: {', '.join(bench.MODES)}; "
                             f"MODE@NAME runs MODE with the overrides of --variant NAME")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="overrides that a --modes entry MODE@NAME adds to its run (after "
                             "the ones every mode gets), e.g. graph:generation.static_cache=true,"
                             "generation.cuda_graph=true; repeatable. Speedups stay against "
                             "plain sequential")
    parser.add_argument("--steps", type=int, required=True, help="PPO steps per mode")
    parser.add_argument("--json", required=True, dest="json_path", metavar="OUT.json",
                        type=output_file_in_new_folders, help="where to write the results")
    parser.add_argument("--plot", metavar="OUT.png", type=output_file_in_new_folders,
                        help="write PNGs: OUT.png (reward and gold against samples and time, step "
                             "time by phase) and OUT-timeline.png (one traced step per mode)")
    parser.add_argument("--peers", metavar="PEERS",
                        help=f"other systems to run on the same workload; available: "
                             f"{', '.join(bench.PEERS)}; PEER@NAME runs PEER with the overrides "
                             f"of --variant NAME, as MODE@NAME (trl@graph: TRL decoding with "
                             f"HF's static cache, compiled on a GPU)")
    parser.add_argument("--table", metavar="OUT.md", type=output_file_in_new_folders,
                        help="also write the results as a markdown table")
    parser.add_argument("--seed", type=seed, default=0,
                        help="seed shared by every mode (default 0)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="first steps left out of the timing (default 2)")
    parser.add_argument("--workdir", metavar="DIR", help="keeps each mode's run directory (default <json>.runs/)")
    parser.add_argument("--ranks", type=int, default=1, metavar="N",
                        help="processes per mode (default 1); N > 1 starts them with DeepSpeed's "
                             "launcher on this machine, one per GPU. With oppo.placement=stage the "
                             "streaming modes use one of them as the scorer rank")
    parser.add_argument("--baseline-ranks", type=int, metavar="M",
                        help="processes for the modes that do not stream (sequential, inter); "
                             "default: --ranks. With oppo.placement=stage and --ranks N, M = N - 1 "
                             "trains them on as many actor ranks as the stage modes have: every "
                             "mode the same run (batch, tokens) on the same machine")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run the whole benchmark N times round-robin (every mode and "
                             "peer once per round, the order rotated by one place each round: "
                             "round 2 starts with the second run of --modes then --peers) and "
                             "report medians over the rounds; a speedup is the median of the "
                             "rounds' own speedups (default 1)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides applied to every mode, e.g. ppo.batch_size=32; "
                             "oppo.overcommit=N sets Delta for inter and oppo only, and "
                             "oppo.streaming is each mode's own (refused)")
    return parser


def check_inputs(args, modes: list[str], workdir: str) -> None:
    """Everything that can be checked before the first (possibly long) run starts."""
    if args.steps < 1:
        raise bench.BenchError("--steps must be >= 1", code=2)
    if args.warmup < 0:
        raise bench.BenchError("--warmup must be >= 0", code=2)
    if args.ranks < 1:
        raise bench.BenchError(f"--ranks must be >= 1, got {args.ranks}", code=2)
    if args.repeat < 1:
        raise bench.BenchError(f"--repeat must be >= 1, got {args.repeat}", code=2)
    if args.baseline_ranks is not None and args.baseline_ranks < 1:
        raise bench.BenchError(f"--baseline-ranks must be >= 1, got {args.baseline_ranks}",
                               code=2)
    if args.ranks > 1 and args.peers:
        raise bench.BenchError("--peers runs one process (TRL's PPO here is single-process); "
                               "leave --ranks at 1 to compare with a peer", code=2)
    bench.check_user_overrides(args.overrides)
    for mode in modes:
        overrides = bench.child_overrides(mode, args.steps, args.seed, os.path.join(workdir, mode),
                                          args.overrides, variants=args.variants)
        try:
            cfg = load_config(args.config, overrides)
        except ConfigError as err:
            raise bench.BenchError(f"mode {mode!r}: {err}", code=2) from None
        if cfg.oppo.placement == "stage" and args.ranks < 2:
            raise bench.BenchError(f"mode {mode!r}: oppo.placement=stage needs a rank for the "
                                   f"scorers besides the actor ranks: --ranks 2 or more",
                                   code=2)
    for peer in bench.parse_peers(args.peers, args.variants):
        package = bench.PEER_PACKAGES[bench.base_mode(peer)]
        if importlib.util.find_spec(package) is None:
            raise bench.BenchError(f"peer {peer!r} needs {package} "
                                   f"(pip install 'oppo-ds[peer]')", code=2)
        bench.check_peer(peer, args.config, args.steps, args.seed, args.overrides,
                         variants=args.variants)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise bench.BenchError("--plot needs matplotlib (pip install 'oppo-ds[plot]')", code=2)


def run_round(args, modes: list[str], workdir: str, round_index: int, traced) -> dict:
    """Every mode and every peer once, one after another: round ``round_index`` of the
    benchmark, in ``bench.run_order`` (the list rotated by one place a round, so that the
    peers do not always run last). Speedups, the ideal bound and the peer ratios are taken
    within the round; the results keep the order of --modes and --peers."""
    peer_names = bench.parse_peers(args.peers, args.variants)
    order = bench.run_order([*((m, False) for m in modes), *((p, True) for p in peer_names)],
                            round_index)
    results, histories, traces, peers, peer_histories = {}, {}, {}, {}, {}
    rounds = f" (round {round_index} of {args.repeat})" if args.repeat > 1 else ""
    for i, (name, is_peer) in enumerate(order, 1):
        run_dir = bench.round_dir(workdir, f"peer-{name}" if is_peer else name, round_index)
        print(f"[{i}/{len(order)}] {'peer ' if is_peer else ''}{name}{rounds}: {args.steps} "
              f"steps, log {run_dir}/stdout.log", file=sys.stderr, flush=True)
        if is_peer:
            rows = bench.run_peer(name, args.config, args.steps, args.seed, args.overrides,
                                  run_dir, variants=args.variants)
            peers[name] = bench.summarize_mode(rows, args.warmup, hidden_default=0.0)
            peer_histories[f"{name} (peer)"] = rows
            continue
        overrides = bench.child_overrides(name, args.steps, args.seed, run_dir, args.overrides,
                                          trace_step=traced, variants=args.variants)
        start = time.perf_counter()
        histories[name] = bench.run_mode(name, args.config, overrides, run_dir,
                                         ranks=bench.mode_ranks(name, args.ranks,
                                                                args.baseline_ranks))
        process_s = time.perf_counter() - start
        trace = bench.read_trace(run_dir, traced) if traced else None
        if trace is not None:
            traces[name] = trace
        hidden_default = None if bench.MODES[bench.base_mode(name)].streams else 0.0
        results[name] = bench.summarize_mode(histories[name], args.warmup, hidden_default)
        bench.add_process_time(results[name], histories[name], process_s)
    results = {mode: results[mode] for mode in modes}
    histories = {mode: histories[mode] for mode in modes}
    traces = {mode: traces[mode] for mode in modes if mode in traces}
    peers = {peer: peers[peer] for peer in peer_names}
    peer_histories = {f"{peer} (peer)": peer_histories[f"{peer} (peer)"] for peer in peer_names}
    bench.add_speedups(results)
    base = results.get("sequential", {}).get("samples_per_s")
    for fields in peers.values():
        fields["speedup"] = fields["samples_per_s"] / base if base and fields["samples_per_s"] else None
    # the bound comes from the baseline's own phases: without a sequential run there is none
    bench.add_ideal(results, bench.ideal_step_time(histories["sequential"], args.warmup)
                    if "sequential" in histories else None)
    ratios = {f"{mode} / {peer} {unit}": results[mode][key] / p[key]
              for key, unit in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s"))
              for peer, p in peers.items() for mode in results
              if mode != "sequential" and results[mode].get(key) and p.get(key)}
    return {"modes": results, "peers": peers, "ratios": ratios, "histories": histories,
            "peer_histories": peer_histories, "traces": traces}


def run(args) -> dict:
    args.variants = bench.parse_variants(args.variant)
    modes = bench.parse_modes(args.modes, args.variants)
    json_path = os.path.abspath(args.json_path)
    workdir = os.path.abspath(args.workdir or os.path.splitext(json_path)[0] + ".runs")
    check_inputs(args, modes, workdir)
    machine = bench.machine_info()  # before the runs: the load average they started under
    traced = bench.trace_step(args.steps, args.warmup) if args.plot else None
    # round-robin: every mode once per round, so that a drift of the machine's speed during
    # the benchmark reaches every mode alike and each round's speedups pair runs close in time;
    # the order rotates from round to round (bench.run_order), so no run is always last
    rounds = [run_round(args, modes, workdir, k, traced) for k in range(1, args.repeat + 1)]
    first = rounds[0]
    if args.repeat > 1:
        results = bench.combine_rounds([r["modes"] for r in rounds])
        peers = bench.combine_rounds([r["peers"] for r in rounds]) if first["peers"] else {}
        ratios = {name: statistics.median(r["ratios"][name] for r in rounds)
                  for name in first["ratios"]}
    else:
        results, peers, ratios = first["modes"], first["peers"], first["ratios"]
    histories, peer_histories, traces = first["histories"], first["peer_histories"], first["traces"]
    report = {"config": args.config, "steps": args.steps, "seed": args.seed, "ranks": args.ranks,
              "baseline_ranks": bench.mode_ranks("sequential", args.ranks, args.baseline_ranks),
              "repeat": args.repeat, "overrides": list(args.overrides),
              # the variants some run used: a script may define more than its --modes name
              "variants": {name: overrides for name, overrides in args.variants.items()
                           if any(bench.variant_of(run) == name for run in
                                  [*modes, *bench.parse_peers(args.peers, args.variants)])},
              "workdir": workdir,
              "machine": machine, "modes": results, "peers": peers, "ratios": ratios}
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    print(bench.format_table({**results, **{f"{p} (peer)": f for p, f in peers.items()}}))
    if args.repeat > 1:
        print(bench.format_rounds(results))
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x")
    print(f"results: {json_path}")
    if args.table:
        os.makedirs(os.path.dirname(os.path.abspath(args.table)), exist_ok=True)
        with open(args.table, "w") as f:
            f.write(bench.format_markdown(report))
        print(f"table: {os.path.abspath(args.table)}")
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        bench.plot({**histories, **peer_histories},
                   {**results, **{f"{p} (peer)": f for p, f in peers.items()}}, args.plot)
        print(f"plot: {os.path.abspath(args.plot)}")
        if traces:
            bench.plot_timeline(traces, bench.timeline_path(args.plot))
            print(f"timeline: {os.path.abspath(bench.timeline_path(args.plot))}")
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except bench.BenchError as err:
        print(f"oppo-bench: error: {err}", file=sys.stderr)
        return err.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
