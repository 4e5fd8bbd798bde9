"""oppo-bench: the summary math against hand-derived values (tier 0), then whole benchmark
runs of a few tiny steps, each mode in its own process (tier 2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from oppo_ds import bench
from oppo_ds.config import load_config
from oppo_ds.cli import bench as bench_cli

ROOT = Path(__file__).resolve().parent.parent

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "examples", "configs", "tiny.yaml")
SMALL = ["workload.num_prompts=64", "workload.sft_steps=20", "workload.reward_steps=20",
         "generation.max_new_tokens=24", "ppo.batch_size=8", "ppo.mini_batch_size=4",
         "ppo.micro_batch_size=4",
         # one thread per run: with two on a small shared CPU every op waits on a busy core
         "system.torch_threads=1"]


def step(t, samples=8, reward=0.0, lengths=(4, 4), **extra):
    return {"time/step_s": t, "samples": samples, "reward/mean": reward,
            "response/lengths": list(lengths), **extra}


# ------------------------------------------------------------------ tier 0: summary math

def test_tail_waste_by_hand():
    assert bench.tail_waste([2, 4, 8, 8]) == pytest.approx(1 - 22 / 32)
    assert bench.tail_waste([5, 5, 5]) == 0.0
    assert bench.tail_waste([1, 9]) == pytest.approx(1 - 10 / 18)
    assert bench.tail_waste([]) == 0.0 and bench.tail_waste([0, 0]) == 0.0
    # a decode that ran to 6 tokens a row, past the longest counted length (4)
    assert bench.tail_waste([2, 4], slots=12) == pytest.approx(1 - 6 / 12)
    assert bench.tail_waste([2, 4], slots=3) == pytest.approx(1 - 6 / 8)  # never below rows x max


def test_summarize_mode_by_hand():
    steps = [
        step(10.0, reward=0.0, lengths=[2, 4, 8, 8], **{"time/phase/generate": 9.0, "time/phase/train": 1.0}),
        step(1.0, reward=1.0, lengths=[4, 4], **{"time/phase/generate": 0.5, "time/phase/train": 0.5}),
        step(2.0, reward=2.0, lengths=[1, 9], **{"time/phase/generate": 1.0, "time/phase/train": 1.0}),
        step(4.0, samples=16, reward=3.0, lengths=[3, 3, 3, 3],
             **{"time/phase/generate": 3.0, "time/phase/train": 1.0}),
        step(3.0, reward=4.0, lengths=[6], **{"time/phase/generate": 2.0, "time/phase/train": 1.0}),
    ]
    out = bench.summarize_mode(steps, warmup=2, hidden_default=0.0)
    assert out["steps"] == 5 and out["warmup_steps"] == 2
    assert out["step_time_s"] == 3.0                                   # median of 2, 4, 3
    assert out["samples_per_s"] == pytest.approx((8 + 16 + 8) / (2 + 4 + 3))
    assert out["reward_first"] == 2.0 and out["reward_last"] == 2.0    # fewer than 10 steps: all
    assert "gold_first" not in out
    assert out["tail_waste_frac"] == pytest.approx(((1 - 22 / 32) + 0 + (1 - 10 / 18) + 0 + 0) / 5)
    # phases of the timed steps only: generate 1+3+2 = 6, train 1+1+1 = 3
    assert out["phase_fraction"] == pytest.approx({"generate": 6 / 9, "train": 3 / 9})
    assert out["scoring_hidden_frac"] == 0.0
    assert out["decode_s"] == 2.0                                      # median of 1, 3, 2
    # streamed: the wait for the scorers after the last token is not the actor's decode
    tails = [dict(r, **{"stream/scoring_tail_s": t}) for r, t in zip(steps, (5, 5, 0.5, 0.25, 1.5))]
    assert bench.summarize_mode(tails, warmup=2)["decode_s"] == 0.5     # median of .5, 2.75, .5
    # inline: the scoring between chunks, which the actor waited for, is not its decode either
    between = [dict(r, **{"stream/scoring_between_chunks_s": 0.25}) for r in tails]
    assert bench.summarize_mode(between, warmup=2)["decode_s"] == 0.25  # .5, 2.75, .5 less .25
    assert bench.summarize_mode([step(1.0)])["decode_s"] is None       # no generate phase


def test_summarize_mode_first_and_last_ten_gold_and_hidden():
    steps = [step(1.0, reward=float(i), **{"gold/mean": 10.0 * i, "stream/scoring_hidden_frac": h})
             for i, h in zip(range(25), [0.5, 0.9] * 13)]
    out = bench.summarize_mode(steps, warmup=3)
    assert out["reward_first"] == pytest.approx(4.5)    # mean of 0..9
    assert out["reward_last"] == pytest.approx(19.5)    # mean of 15..24
    assert out["gold_first"] == pytest.approx(45.0) and out["gold_last"] == pytest.approx(195.0)
    # steps 3..24: 11 of 0.9 (odd indices) and 11 of 0.5
    assert out["scoring_hidden_frac"] == pytest.approx(0.7)
    assert out["phase_fraction"] == {}


def test_warmup_longer_than_run_keeps_the_last_step():
    out = bench.summarize_mode([step(5.0), step(1.0)], warmup=2)
    assert out["warmup_steps"] == 1 and out["step_time_s"] == 1.0 and out["samples_per_s"] == 8.0
    assert bench.summarize_mode([step(5.0)], warmup=2)["step_time_s"] == 5.0
    assert bench.summarize_mode([step(5.0)])["scoring_hidden_frac"] is None  # not streamed, not known


def test_tokens_per_s_counts_the_trained_response_tokens_of_the_timed_steps():
    """samples/s counts responses, whatever their length: a schedule that trains the short
    ones first gains it over a few steps. tokens_per_s: the timed steps' trained response
    tokens (response/lengths) over the same time; None when a timed step has no lengths."""
    steps = [step(10.0, lengths=[100] * 8), step(2.0, lengths=[1, 9]),
             step(4.0, samples=16, lengths=[3, 3, 3, 3]), step(3.0, lengths=[6])]
    out = bench.summarize_mode(steps, warmup=1)
    assert out["samples_per_s"] == pytest.approx((8 + 16 + 8) / 9)
    assert out["tokens_per_s"] == pytest.approx((10 + 12 + 6) / 9)
    # the same samples/s, a third of the tokens
    short = [step(1.0, lengths=[2] * 8), step(1.0, lengths=[2] * 8)]
    long = [step(1.0, lengths=[6] * 8), step(1.0, lengths=[6] * 8)]
    assert bench.summarize_mode(short, 0)["samples_per_s"] == \
        bench.summarize_mode(long, 0)["samples_per_s"]
    assert bench.summarize_mode(short, 0)["tokens_per_s"] == pytest.approx(16.0)
    assert bench.summarize_mode(long, 0)["tokens_per_s"] == pytest.approx(48.0)
    unknown = [step(1.0), {"time/step_s": 1.0, "samples": 8}]
    assert bench.summarize_mode(unknown, warmup=0)["tokens_per_s"] is None
    assert bench.summarize_mode(unknown, warmup=1)["tokens_per_s"] is None
    assert "tokens_per_s" in bench.ROUND_FIELDS  # a median over rounds, like samples/s
    fields = {**out, "speedup": 1.0}
    assert "tokens/s" in bench.format_table({"oppo": fields}).splitlines()[0]
    assert "3.1" in bench.format_table({"oppo": fields}).splitlines()[2]
    table = bench.format_markdown({"modes": {"oppo": fields}, "peers": {"trl": fields}})
    header, _, row, peer = table.splitlines()[2:6]
    assert header.split(" | ")[2:4] == ["samples/s", "tokens/s"]
    assert row.split(" | ")[2:4] == ["3.56", "3.1"] and peer.startswith("| trl (peer) |")


def test_run_order_rotates_a_place_a_round():
    """--repeat: each round starts one place further along --modes then --peers, so the
    peers (last in the list) do not run last in every round, nor any one mode first."""
    runs = ["sequential", "oppo", "trl (peer)"]
    assert [bench.run_order(runs, k) for k in (1, 2, 3, 4)] == [
        ["sequential", "oppo", "trl (peer)"], ["oppo", "trl (peer)", "sequential"],
        ["trl (peer)", "sequential", "oppo"], ["sequential", "oppo", "trl (peer)"]]
    assert bench.run_order([], 3) == []


def test_speedup_relative_to_sequential():
    modes = {"sequential": {"samples_per_s": 4.0}, "intra": {"samples_per_s": 6.0}}
    bench.add_speedups(modes)
    assert modes["sequential"]["speedup"] == 1.0 and modes["intra"]["speedup"] == 1.5
    alone = {"intra": {"samples_per_s": 6.0}}
    bench.add_speedups(alone)
    assert alone["intra"]["speedup"] is None


def test_combine_rounds_takes_medians_of_each_rounds_own_values():
    """Three rounds of two modes; the machine was slower in round 2 (every mode alike): each
    timing field is the median over the rounds, a speedup the median of the rounds' own
    speedups (not the ratio of the medians), phase fractions the mean; reward comes from
    round 1 (the same in every round)."""
    def summary(step_s, rate, speedup, hidden, train_frac, reward=1.0):
        return {"step_time_s": step_s, "samples_per_s": rate, "speedup": speedup,
                "scoring_hidden_frac": hidden, "ideal_step_time_s": 0.1, "of_ideal": 0.1 / step_s,
                "phase_fraction": {"generate": 1 - train_frac, "train": train_frac},
                "reward_first": reward, "tail_waste_frac": 0.5}
    rounds = [{"sequential": summary(0.4, 40.0, 1.0, 0.0, 0.2), "oppo": summary(0.2, 80.0, 2.0, 0.9, 0.4)},
              {"sequential": summary(0.8, 20.0, 1.0, 0.0, 0.4), "oppo": summary(0.5, 32.0, 1.6, 0.8, 0.6)},
              {"sequential": summary(0.5, 32.0, 1.0, 0.0, 0.3), "oppo": summary(0.2, 80.0, 2.5, 0.7, 0.5, reward=9.0)}]
    out = bench.combine_rounds(rounds)
    oppo = out["oppo"]
    assert oppo["speedup"] == 2.0  # median of 2.0, 1.6, 2.5 (the medians' ratio would be 2.5)
    assert oppo["samples_per_s"] == 80.0 and oppo["step_time_s"] == 0.2
    assert oppo["scoring_hidden_frac"] == pytest.approx(0.8)
    assert oppo["phase_fraction"] == pytest.approx({"generate": 0.5, "train": 0.5})
    assert oppo["reward_first"] == 1.0 and oppo["tail_waste_frac"] == 0.5
    assert [r["speedup"] for r in oppo["rounds"]] == [2.0, 1.6, 2.5]
    assert out["sequential"]["step_time_s"] == 0.5 and out["sequential"]["speedup"] == 1.0
    assert "1.60x" in bench.format_rounds(out) and "2.50x" in bench.format_rounds(out)
    with pytest.raises(ValueError):
        bench.combine_rounds([])


def test_round_directories():
    assert bench.round_dir("/w", "oppo", 1) == os.path.join("/w", "oppo")
    assert bench.round_dir("/w", "oppo", 3) == os.path.join("/w", "oppo.round3")


def test_ideal_step_time_hand_values():
    # step 1 is warm-up; step 2: lengths 2, 4 -> waste 1 - 6/8 = 0.25: 0.4 * 0.75 + 0.05 + 0.3
    # = 0.65; step 3: lengths 3, 3 -> no waste: 0.2 + 0.05 + 0.3 = 0.55; median 0.6
    rows = [{"time/phase/generate": 9.0, "time/phase/train": 9.0, "response/lengths": [1, 9]},
            {"time/phase/generate": 0.4, "time/phase/score": 0.2, "time/phase/advantages": 0.05,
             "time/phase/train": 0.3, "response/lengths": [2, 4]},
            {"time/phase/generate": 0.2, "time/phase/score": 0.2, "time/phase/advantages": 0.05,
             "time/phase/train": 0.3, "response/lengths": [3, 3]}]
    ideal = bench.ideal_step_time(rows, warmup=1)
    assert ideal == pytest.approx(0.6)
    modes = {"sequential": {"step_time_s": 0.8}, "oppo": {"step_time_s": 0.6}}
    bench.add_ideal(modes, ideal)
    assert modes["sequential"]["of_ideal"] == pytest.approx(0.75)
    assert modes["oppo"]["of_ideal"] == pytest.approx(1.0)
    bench.add_ideal(modes, None)
    assert modes["oppo"]["of_ideal"] is None


def test_parse_modes():
    assert bench.parse_modes("sequential, intra") == ["sequential", "intra"]
    assert bench.parse_modes("sequential,inter,oppo") == ["sequential", "inter", "oppo"]
    available = "available modes: " + ", ".join(bench.MODES)
    for text in ("warp", "sequential,warp", "", "sequential,sequential"):
        with pytest.raises(bench.BenchError) as err:
            bench.parse_modes(text)
        assert err.value.code == 2
    with pytest.raises(bench.BenchError, match="unknown mode.* warp; " + available):
        bench.parse_modes("sequential,warp")


def test_variants_add_their_overrides_to_the_modes_that_name_them():
    """--variant NAME:K=V,... and --modes MODE@NAME: the variant's overrides come after the
    user's and before what makes the mode itself (so a variant cannot turn oppo into inter);
    a comma inside a value stays; a malformed variant, an undefined one and a key a mode sets
    are refused (code 2)."""
    variants = bench.parse_variants(["graph:generation.static_cache=true, "
                                     "generation.cuda_graph=true",
                                     "two:oppo.stream_to=[reference,critic]",
                                     "graph:generation.sync_every=16"])
    assert variants == {"graph": ["generation.static_cache=true", "generation.cuda_graph=true",
                                  "generation.sync_every=16"],
                        "two": ["oppo.stream_to=[reference,critic]"]}
    assert bench.parse_modes("sequential,oppo@graph,oppo", variants) == \
        ["sequential", "oppo@graph", "oppo"]
    assert bench.base_mode("oppo@graph") == "oppo"
    got = bench.child_overrides("inter@two", 3, 0, "/r", ["ppo.kl_coef=0.1"], variants=variants)
    plain = bench.child_overrides("inter", 3, 0, "/r", ["ppo.kl_coef=0.1"])
    cut = plain.index("ppo.kl_coef=0.1") + 1
    assert got == plain[:cut] + ["oppo.stream_to=[reference,critic]"] + plain[cut:]
    assert got[-2:] == ["oppo.streaming=false", "oppo.placement=inline"]  # the mode's own last
    for bad, message in ((["graph"], "expected NAME:KEY=VALUE"), (["a b:x=1"], "expected NAME"),
                         (["g:generation.sync_every"], "is not KEY=VALUE"),
                         (["g:oppo.streaming=true"], "set by each mode")):
        with pytest.raises(bench.BenchError, match=message) as err:
            bench.parse_variants(bad)
        assert err.value.code == 2
    with pytest.raises(bench.BenchError,
                       match=r"oppo@fast: no such --variant \(defined: graph, two\)"):
        bench.parse_modes("sequential,oppo@fast", variants)
    with pytest.raises(bench.BenchError, match="unknown mode"):
        bench.parse_modes("warp@graph", variants)


def test_format_table_shows_every_mode():
    fields = {"step_time_s": 0.5, "samples_per_s": 16.0, "speedup": 1.0, "scoring_hidden_frac": 0.0,
              "tail_waste_frac": 0.25, "reward_first": 0.1, "reward_last": 0.3}
    text = bench.format_table({"sequential": fields, "intra": {**fields, "speedup": None}})
    assert "sequential" in text and "intra" in text and "0.100 -> 0.300" in text and "25.0%" in text


# ------------------------------------------------------------------ tier 2: real runs

def bench_cmd(*args):
    return [sys.executable, "-m", "oppo_ds.cli.bench", *args]


def test_unavailable_mode_exits_2_with_one_line():
    proc = subprocess.run(bench_cmd("--config", TINY, "--modes", "warp", "--steps", "3",
                                    "--json", os.devnull), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "warp" in lines[0] and "available modes: " + ", ".join(bench.MODES) in lines[0]


def check_mode_fields(fields: dict, steps: int) -> None:
    assert fields["steps"] == steps
    assert fields["step_time_s"] > 0 and fields["samples_per_s"] > 0
    for key in ("reward_first", "reward_last", "gold_first", "gold_last"):
        assert isinstance(fields[key], float) and fields[key] == fields[key]
    assert 0.0 <= fields["scoring_hidden_frac"] <= 1.0
    assert 0.0 <= fields["tail_waste_frac"] < 1.0
    assert set(fields["phase_fraction"]) >= {"generate", "train"}
    assert sum(fields["phase_fraction"].values()) == pytest.approx(1.0)


def test_sequential_run_writes_json_table_and_plot(cache_dir, tmp_path):
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    proc = subprocess.run(bench_cmd("--config", TINY, "--modes", "sequential", "--steps", "3",
                                    "--json", str(out), "--plot", str(png), "--seed", "1",
                                    *SMALL, f"workload.cache_dir={cache_dir}"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["config"] == TINY and report["steps"] == 3 and report["seed"] == 1
    assert {"platform", "cpu_count", "cpu_model", "torch", "deepspeed",
            "cuda_device"} <= set(report["machine"])
    seq = report["modes"]["sequential"]
    check_mode_fields(seq, 3)
    assert seq["speedup"] == 1.0 and seq["scoring_hidden_frac"] == 0.0
    assert "sequential" in proc.stdout and "1.00x" in proc.stdout
    # the child process's time: its steps, and what is not a step (imports, building, exit)
    steps = [json.loads(line) for line in
             (tmp_path / "bench.runs" / "sequential" / "metrics.jsonl").read_text().splitlines()]
    assert seq["outside_steps_s"] > 0
    assert seq["process_s"] == pytest.approx(seq["outside_steps_s"]
                                             + sum(r["time/step_s"] for r in steps))
    run_dir = tmp_path / "bench.runs" / "sequential"
    assert (run_dir / "stdout.log").is_file() and (run_dir / "metrics.jsonl").is_file()
    # a timed run writes no checkpoint after its last step (at 0.5B one was 13 GB on a GPU)
    assert not (run_dir / "checkpoints").exists()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_mode_gets_its_overrides_and_own_run(cache_dir, tmp_path, monkeypatch):
    # a second mode from the table: the same schedule with a different KL coefficient, so the
    # child's saved config shows that the mode's overrides reached it
    monkeypatch.setitem(bench.MODES, "strongkl", bench.Mode(streams=False, overcommits=False,
                                                            extra=("ppo.kl_coef=0.7",)))
    out = tmp_path / "b.json"
    code = bench_cli.main(["--config", TINY, "--modes", "strongkl,sequential", "--steps", "2",
                           "--json", str(out), "--workdir", str(tmp_path / "runs"),
                           *SMALL, f"workload.cache_dir={cache_dir}"])
    assert code == 0
    modes = json.loads(out.read_text())["modes"]
    assert list(modes) == ["strongkl", "sequential"]
    for fields in modes.values():
        check_mode_fields(fields, 2)
    assert modes["strongkl"]["speedup"] == pytest.approx(
        modes["strongkl"]["samples_per_s"] / modes["sequential"]["samples_per_s"])

    kl = {m: yaml.safe_load((tmp_path / "runs" / m / "config.yaml").read_text())["ppo"]["kl_coef"]
          for m in modes}
    assert kl == {"strongkl": 0.7, "sequential": 0.2}


def test_failing_mode_names_mode_and_log(cache_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(bench.MODES, "broken", bench.Mode(
        streams=False, overcommits=False, extra=(f"data.prompts={tmp_path / 'missing.jsonl'}",)))
    code = bench_cli.main(["--config", TINY, "--modes", "broken", "--steps", "2",
                           "--json", str(tmp_path / "b.json"), *SMALL, f"workload.cache_dir={cache_dir}"])
    err = capsys.readouterr().err
    log = tmp_path / "b.runs" / "broken" / "stdout.log"
    assert code != 0 and not (tmp_path / "b.json").exists()
    assert "'broken' failed" in err and str(log) in err and "missing.jsonl" in err


def test_every_mode_on_the_builtin_default(cache_dir, tmp_path):
    """No --config: the built-in workload's defaults, as DESIGN.md promises; every mode, and
    the plots (the timeline from each mode's traced step)."""
    out = tmp_path / "b.json"
    png = tmp_path / "b.png"
    code = bench_cli.main(["--modes", "sequential,intra,inter,oppo", "--steps", "3",
                           "--json", str(out), "--plot", str(png), *SMALL,
                           f"workload.cache_dir={cache_dir}"])
    assert code == 0
    modes = json.loads(out.read_text())["modes"]
    for mode in ("intra", "inter", "oppo"):
        check_mode_fields(modes[mode], 3)
        assert modes[mode]["speedup"] > 0
    assert 0.0 < modes["intra"]["scoring_hidden_frac"] <= 1.0
    assert 0.0 < modes["oppo"]["scoring_hidden_frac"] <= 1.0
    assert modes["sequential"]["scoring_hidden_frac"] == 0.0 == modes["inter"]["scoring_hidden_frac"]
    # the bound comes from the sequential run and every mode is compared with it
    assert all(m["ideal_step_time_s"] == modes["sequential"]["ideal_step_time_s"] > 0 for m in modes.values())
    assert all(0 < m["of_ideal"] for m in modes.values())
    # streaming changes when scoring happens, not what is sampled or scored; overcommitment
    # changes which responses a step trains on, and both pool modes sample the same ones
    assert modes["intra"]["reward_first"] == pytest.approx(modes["sequential"]["reward_first"], abs=1e-4)
    assert modes["oppo"]["reward_first"] == pytest.approx(modes["inter"]["reward_first"], abs=1e-4)

    configs = {m: yaml.safe_load((tmp_path / "b.runs" / m / "config.yaml").read_text())["oppo"]
               for m in modes}
    assert {m: (c["streaming"], c["overcommit"]) for m, c in configs.items()} == {
        "sequential": (False, 0), "intra": (True, 0), "inter": (False, "auto"), "oppo": (True, "auto")}

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "b-timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lanes = {m: bench.timeline_lanes(bench.read_trace(str(tmp_path / "b.runs" / m), 3)) for m in modes}
    for m in ("sequential", "inter"):  # scoring after decoding, in one batch
        assert lanes[m]["actor decode"] and lanes[m]["scoring (batched)"] and not lanes[m]["reward"]
    for m in ("intra", "oppo"):  # every scorer on its own lane, while the actor decodes
        assert all(lanes[m][k] for k in ("actor decode", "reward", "reference", "critic", "training"))
        first_prefill = min(start for start, _ in lanes[m]["reward"])
        last_decode = max(start + dur for start, dur in lanes[m]["actor decode"])
        assert first_prefill < last_decode


def test_unknown_peer_is_refused():
    with pytest.raises(bench.BenchError, match="unknown peer.* verl; available peers: trl"):
        bench.parse_peers("trl,verl")
    assert bench.parse_peers(None) == [] and bench.parse_peers("trl") == ["trl"]


def test_a_peer_takes_a_variant_as_a_mode_does():
    """--peers trl@graph: TRL with the overrides of --variant graph after the user's (the
    same decode as oppo@graph); an undefined variant or a peer listed twice is refused."""
    variants = {"graph": ["generation.static_cache=true", "generation.cuda_graph=true"]}
    assert bench.parse_peers("trl, trl@graph", variants) == ["trl", "trl@graph"]
    assert bench.peer_overrides("trl@graph", ["ppo.batch_size=8"], variants) == \
        ["ppo.batch_size=8", "generation.static_cache=true", "generation.cuda_graph=true"]
    assert bench.peer_overrides("trl", ["ppo.batch_size=8"], variants) == ["ppo.batch_size=8"]
    with pytest.raises(bench.BenchError, match=r"trl@fast: no such --variant \(defined: graph\)"):
        bench.parse_peers("trl@fast", variants)
    with pytest.raises(bench.BenchError, match="unknown peer.* verl@graph"):
        bench.parse_peers("verl@graph", variants)
    with pytest.raises(bench.BenchError, match="peer listed twice"):
        bench.parse_peers("trl@graph,trl@graph", variants)


def _refused_before_the_modes(tmp_path, capsys, args: list) -> str:
    """oppo-bench with ``args`` (2 steps, a JSON under ``tmp_path``) and a TRL peer it
    refuses up front: exit 2 with one line on stderr, which it returns."""
    pytest.importorskip("trl")
    code = bench_cli.main(["--steps", "2", "--json", str(tmp_path / "x.json"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    return err


def test_a_peer_variant_it_cannot_honour_is_refused_before_the_modes(tmp_path, capsys):
    """trl@graph on a machine without a GPU: transformers compiles the static-cache forward
    (its CUDA graphs) on CUDA only, so the peer refuses generation.cuda_graph up front, as
    our trainer does, naming the key."""
    err = _refused_before_the_modes(tmp_path, capsys, [
        "--modes", "sequential@graph", "--peers", "trl@graph", "--variant",
        "graph:generation.static_cache=true,generation.cuda_graph=true"])
    assert "peer 'trl@graph': generation.cuda_graph=true: the peer's counterpart is " \
           "transformers' compile" in err
    assert not os.listdir(tmp_path)  # refused before anything ran


def test_child_env_drops_rendezvous_variables_of_one_process_runs():
    env = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "1", "PATH": "/bin"}
    assert bench.child_env(1, env) == {"PATH": "/bin"}
    # several processes share the cores: each gets its share of threads, unless set
    assert bench.child_env(2, env, cores=2) == {**env, "OMP_NUM_THREADS": "1"}
    assert bench.child_env(8, env, cores=16)["OMP_NUM_THREADS"] == "2"
    assert bench.child_env(4, env, cores=2)["OMP_NUM_THREADS"] == "1"
    assert bench.child_env(2, {**env, "OMP_NUM_THREADS": "3"}, cores=2)["OMP_NUM_THREADS"] == "3"


def test_trl_peer_beside_our_modes_and_markdown_table(cache_dir, tmp_path, monkeypatch):
    """--peers trl runs TRL 1.12's PPO on the same workload in its own process; its fields
    are a mode's, and the JSON carries it under peers.trl with our modes' ratio to it.
    trl@static: the same peer with --variant static's overrides (HF's static cache, the
    same tokens in fp32)."""
    # left behind by an in-process run (DeepSpeed needs it after its group exists): the
    # children must not take it for a launcher's
    monkeypatch.setenv("LOCAL_RANK", "0")
    out, md = tmp_path / "b.json", tmp_path / "b.md"
    png = tmp_path / "b.png"
    code = bench_cli.main(["--modes", "sequential,oppo", "--peers", "trl,trl@static",
                           "--variant", "static:generation.static_cache=true", "--steps", "3",
                           "--json", str(out), "--table", str(md), "--plot", str(png), *SMALL,
                           f"workload.cache_dir={cache_dir}"])
    assert code == 0
    report = json.loads(out.read_text())
    assert list(report["peers"]) == ["trl", "trl@static"]
    assert report["variants"] == {"static": ["generation.static_cache=true"]}
    trl = report["peers"]["trl"]
    check_mode_fields(trl, 3)
    assert trl["speedup"] == pytest.approx(trl["samples_per_s"] / report["modes"]["sequential"]["samples_per_s"])
    for unit, key in (("samples/s", "samples_per_s"), ("tokens/s", "tokens_per_s")):
        ratio = report["ratios"][f"oppo / trl {unit}"]
        assert ratio == pytest.approx(report["modes"]["oppo"][key] / trl[key])
    assert "oppo / trl@static samples/s" in report["ratios"]
    runs = tmp_path / "b.runs"
    static = json.loads((runs / "peer-trl@static" / "peer.json").read_text())
    assert static["policy_generation_config"]["cache_implementation"] == "static"
    plain = json.loads((runs / "peer-trl" / "peer.json").read_text())
    assert plain["policy_generation_config"] == {}
    first = {p: json.loads((runs / f"peer-{p}" / "metrics.jsonl").read_text().splitlines()[0])
             for p in ("trl", "trl@static")}
    assert first["trl"]["response/lengths"] == first["trl@static"]["response/lengths"]
    table = md.read_text()
    assert "| trl (peer) |" in table and "| oppo |" in table and "oppo / trl samples/s" in table
    assert "| trl@static (peer) |" in table and "`@static`: generation.static_cache=true." in table
    # the processor named beside the CPU count (where the system names it: not every Linux's
    # /proc/cpuinfo does): what the default decode's speed hangs on
    machine = report["machine"]
    named = f" ({machine['cpu_model']})" if machine["cpu_model"] else ""
    assert f"{machine['cpu_count']} CPUs{named}, GPU:" in table.splitlines()[0]
    assert (tmp_path / "b.runs" / "peer-trl" / "metrics.jsonl").is_file()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the peer's curves drawn with ours


def test_every_mode_sets_both_techniques():
    """A config that switches a technique on (llama3_70b.yaml overcommits) must not leak it
    into a mode that compares against it, and a user's Delta must reach the overcommitting
    modes only: on the first H100 run ``oppo.overcommit=16`` given for oppo also made
    ``intra`` overcommit. The resolved configs say what each mode runs."""
    expected = {"sequential": (False, 0), "intra": (True, 0), "inter": (False, 8),
                "oppo": (True, 8)}
    short = ["ppo.warmup_steps=0"]  # its 20 warm-up updates do not fit 2 steps: refused
    for user, auto_delta in (([], "auto"), (["oppo.overcommit=8"], 8)):  # at most B (8)
        for name, (streams, delta) in expected.items():
            cfg = load_config(str(ROOT / "examples" / "configs" / "llama3_70b.yaml"),
                              bench.child_overrides(name, 2, 0, "/tmp/r", user + short))
            assert cfg.oppo.streaming is streams, (name, user)
            assert cfg.oppo.overcommit == (delta and auto_delta), (name, user)
            if streams:
                assert cfg.oppo.chunk_size == "auto", name


def test_a_user_override_of_streaming_is_refused(tmp_path, capsys):
    """``oppo.streaming`` selects the mode; set by the user it would make sequential and intra
    the same run under two names."""
    code = bench_cli.main(["--modes", "sequential,intra", "--steps", "2", "--json",
                           str(tmp_path / "x.json"), "oppo.streaming=true"])
    err = capsys.readouterr().err
    assert code == 2 and "oppo.streaming is set by each mode" in err and "--modes" in err
    assert not (tmp_path / "x.runs").exists()


def test_launch_command_and_overrides_for_several_ranks():
    """One process: ``python -m``; N: DeepSpeed's launcher on a free port. A mode that does
    not stream is set to the inline placement after the user's overrides, so that
    ``oppo.placement=stage`` (for the streaming modes) leaves it a valid run on all ranks."""
    one = bench.launch_command("oppo_ds.train", ["steps=2"])
    assert one == [sys.executable, "-m", "oppo_ds.train", "steps=2"]
    three = bench.launch_command("oppo_ds.train", ["steps=2"], ranks=3)
    assert three[:5] == [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "3"]
    assert three[5] == "--master_port" and int(three[6]) > 0
    assert three[7:] == ["--module", "oppo_ds.train", "steps=2"]
    with pytest.raises(bench.BenchError, match="--ranks must be >= 1"):
        bench.launch_command("oppo_ds.train", [], ranks=0)
    user = ["oppo.placement=stage"]
    seq = bench.child_overrides("sequential", 2, 0, "/tmp/r", user)
    assert seq[-1] == "oppo.placement=inline" and "oppo.placement=stage" in seq
    oppo = bench.child_overrides("oppo", 2, 0, "/tmp/r", user)
    assert "oppo.placement=stage" in oppo and "oppo.placement=inline" not in oppo


def test_stage_modes_need_several_ranks_and_peers_one(tmp_path, capsys):
    out = str(tmp_path / "x.json")
    code = bench_cli.main(["--modes", "sequential,intra", "--steps", "2", "--json", out,
                           "oppo.placement=stage"])
    assert code == 2 and "mode 'intra': oppo.placement=stage needs" in capsys.readouterr().err
    code = bench_cli.main(["--modes", "sequential", "--steps", "2", "--json", out,
                           "--ranks", "2", "--peers", "trl"])
    assert code == 2 and "--peers runs one process" in capsys.readouterr().err
    assert not os.listdir(tmp_path)  # refused before anything ran


def test_a_workload_the_peer_cannot_run_is_refused_before_the_modes(tmp_path, capsys):
    """TRL's PPO samples one response a prompt: a group setting is refused up front (exit 2,
    one line naming the key), not after every mode has run and without a JSON."""
    err = _refused_before_the_modes(tmp_path, capsys, [
        "--modes", "sequential", "--peers", "trl", "ppo.advantage_estimator=rloo",
        "data.samples_per_prompt=2"])
    assert "peer 'trl': ppo.advantage_estimator=rloo: TRL's PPO estimates advantages" in err
    assert not os.listdir(tmp_path)  # refused before anything ran


def test_stage_modes_beside_data_parallel_ones_on_two_ranks(cache_dir, tmp_path):
    """``--ranks 2 oppo.placement=stage``: sequential trains on both ranks (data parallel),
    intra on one actor rank with the other scoring; both finish and report samples/s over
    the ranks that trained."""
    out = tmp_path / "b.json"
    proc = subprocess.run(bench_cmd("--config", TINY, "--modes", "sequential,intra", "--steps", "2",
                                    "--ranks", "2", "--json", str(out), *SMALL,
                                    f"workload.cache_dir={cache_dir}", "oppo.placement=stage",
                                    "logging.tensorboard=false"),
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ranks"] == 2
    runs = tmp_path / "b.runs"
    summaries = {m: json.loads((runs / m / "summary.json").read_text()) for m in ("sequential", "intra")}
    assert summaries["sequential"]["world_size"] == 2 and summaries["intra"]["world_size"] == 1
    assert summaries["sequential"]["samples"] == 2 * 2 * 8 and summaries["intra"]["samples"] == 2 * 8
    for mode, fields in report["modes"].items():
        check_mode_fields(fields, 2)
    assert report["modes"]["intra"]["scoring_hidden_frac"] > 0
    log = (runs / "intra" / "stdout.log").read_text()
    assert "deepspeed.launcher.runner" in log.splitlines()[0]
    assert "scorer rank 1: served 2 rollouts" in log


def test_baseline_ranks_give_the_modes_that_do_not_stream_their_own_count(cache_dir, tmp_path,
                                                                          capsys):
    """``--baseline-ranks M``: sequential and inter run as M processes, the streaming modes
    as --ranks (the stage's actor ranks plus its scorer rank); the JSON and the table say
    so. M = 1 here: sequential in one process, no launcher."""
    assert [bench.mode_ranks(m, 8, 7) for m in ("sequential", "intra", "inter", "oppo")] == \
        [7, 8, 7, 8]
    assert bench.mode_ranks("sequential", 8) == 8
    out = str(tmp_path / "x.json")
    assert bench_cli.main(["--modes", "sequential", "--steps", "2", "--json", out,
                           "--baseline-ranks", "0"]) == 2
    assert "--baseline-ranks must be >= 1" in capsys.readouterr().err
    md = tmp_path / "b.md"
    code = bench_cli.main(["--config", TINY, "--modes", "sequential", "--steps", "2", "--ranks",
                           "2", "--baseline-ranks", "1", "--json", out, "--table", str(md),
                           *SMALL, f"workload.cache_dir={cache_dir}", "logging.tensorboard=false"])
    assert code == 0
    report = json.loads(open(out).read())
    assert report["ranks"] == 2 and report["baseline_ranks"] == 1
    summary = json.loads((tmp_path / "x.runs" / "sequential" / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["samples"] == 2 * 8
    log = (tmp_path / "x.runs" / "sequential" / "stdout.log").read_text()
    assert "deepspeed.launcher.runner" not in log.splitlines()[0]
    assert "2 processes per streaming mode, 1 per mode that does not stream" in md.read_text()


def test_repeat_runs_the_modes_round_robin(cache_dir, tmp_path, capsys):
    """--repeat 2: every mode twice, in rounds (round 2 in name.round2), each round's speedup
    against its own sequential run, the medians in the JSON and the table."""
    out, md = tmp_path / "b.json", tmp_path / "b.md"
    code = bench_cli.main(["--config", TINY, "--modes", "sequential,inter", "--steps", "2",
                           "--repeat", "2", "--json", str(out), "--table", str(md), *SMALL,
                           f"workload.cache_dir={cache_dir}"])
    assert code == 0
    err = capsys.readouterr().err
    # round 2 rotated: inter first, so that neither always runs last
    assert err.index("sequential (round 1 of 2)") < err.index("inter (round 1 of 2)") \
        < err.index("inter (round 2 of 2)") < err.index("sequential (round 2 of 2)")
    report = json.loads(out.read_text())
    assert report["repeat"] == 2 and list(report["modes"]) == ["sequential", "inter"]
    for name in ("sequential", "inter"):
        for d in (name, f"{name}.round2"):
            assert (tmp_path / "b.runs" / d / "metrics.jsonl").is_file()
    inter = report["modes"]["inter"]
    assert len(inter["rounds"]) == 2
    per_round = [r["speedup"] for r in inter["rounds"]]
    assert inter["speedup"] == pytest.approx(sum(per_round) / 2)  # the median of two
    assert all(r["speedup"] == 1.0 for r in report["modes"]["sequential"]["rounds"])
    assert "2 rounds round-robin" in md.read_text() and "Speedup per round" in md.read_text()


def test_a_variant_runs_beside_the_plain_mode_against_the_same_baseline(cache_dir, tmp_path):
    """sequential and sequential@static (the decode at one shape: the same tokens in fp32)
    in one benchmark: each its own run with its own config, the variant's speedup against
    plain sequential, the same first rollout, the variants in the JSON and the table (the
    ones a run used: a variant defined and not named in --modes is left out of both)."""
    out, md = tmp_path / "b.json", tmp_path / "b.md"
    code = bench_cli.main(["--config", TINY, "--modes", "sequential,sequential@static",
                           "--variant", "static:generation.static_cache=true",
                           "--variant", "unused:generation.sync_every=4", "--steps", "2",
                           "--json", str(out), "--table", str(md), *SMALL,
                           f"workload.cache_dir={cache_dir}"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["variants"] == {"static": ["generation.static_cache=true"]}
    modes = report["modes"]
    assert list(modes) == ["sequential", "sequential@static"]
    runs = tmp_path / "b.runs"
    static = {m: yaml.safe_load((runs / m / "config.yaml").read_text())["generation"]
              ["static_cache"] for m in modes}
    assert static == {"sequential": False, "sequential@static": True}
    variant = modes["sequential@static"]
    assert variant["speedup"] == pytest.approx(variant["samples_per_s"]
                                               / modes["sequential"]["samples_per_s"])
    assert variant["scoring_hidden_frac"] == 0.0  # a sequential schedule hides nothing
    first = {m: json.loads((runs / m / "metrics.jsonl").read_text().splitlines()[0])
             for m in modes}
    assert first["sequential"]["response/lengths"] == first["sequential@static"]["response/lengths"]
    assert first["sequential"]["reward/mean"] == pytest.approx(
        first["sequential@static"]["reward/mean"], abs=1e-5)
    assert "`@static`: generation.static_cache=true." in md.read_text()
    assert "unused" not in md.read_text()


def test_json_path_is_checked_before_any_mode_runs(tmp_path, capsys):
    """--json naming a directory failed with IsADirectoryError only after every mode ran,
    their results lost; a folder still missing is made, as before."""
    (tmp_path / "afile").write_text("")
    for target, words in ((tmp_path, f"{tmp_path} is a directory: name the file to write in it"),
                          (tmp_path / "afile" / "b.json", f"cannot write {tmp_path}/afile/b.json: "
                                                          f"its folder {tmp_path}/afile is not a "
                                                          "directory")):
        with pytest.raises(SystemExit) as exit_info:
            bench_cli.main(["--modes", "sequential", "--steps", "2", "--json", str(target)])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"oppo-bench: error: argument --json: {words}")
    assert sorted(os.listdir(tmp_path)) == ["afile"]  # no run started
    args = bench_cli.build_parser().parse_args(["--modes", "sequential", "--steps", "2",
                                                "--json", str(tmp_path / "new" / "b.json")])
    assert args.json_path == str(tmp_path / "new" / "b.json")


def test_repeat_must_be_positive(tmp_path, capsys):
    code = bench_cli.main(["--modes", "sequential", "--steps", "2", "--repeat", "0",
                           "--json", str(tmp_path / "b.json")])
    assert code == 2 and "--repeat must be >= 1" in capsys.readouterr().err
