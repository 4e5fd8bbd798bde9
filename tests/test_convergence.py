"""Tier 0: the convergence report (band of the baseline's seeds, share of steps inside it,
deferred sequences finishing within one extra step) on hand-made metrics files."""
import json

import pytest

from oppo_ds.cli import convergence
from oppo_ds.telemetry import deferral_summary


def test_smooth_and_band_hand_values():
    assert convergence.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert convergence.smooth([2.0, 4.0], 5) == [2.0, 3.0]
    assert convergence.band([[1.0, 5.0, 2.0], [3.0, 4.0]]) == ([1.0, 4.0], [3.0, 5.0])


def test_deferral_share():
    rows = [{"pool/deferrals": [0, 1, 0, 2]}, {"pool/deferrals": [1, 1, 0, 0]}]
    share = deferral_summary(rows)
    assert share == {"trained": 8, "deferred": 4, "deferred_share": 0.5,
                     "within_one_extra_step": 0.75, "max_deferrals": 2}
    assert deferral_summary([{"reward/mean": 1.0}]) is None


def _write(root, seed, mode, rewards, deferrals=None):
    path = root / f"seed{seed}.runs" / mode
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for i, r in enumerate(rewards):
            row = {"step": i + 1, "samples": 4, "reward/mean": r, "gold/mean": r / 10}
            if deferrals is not None:
                row["pool/deferrals"] = deferrals
            f.write(json.dumps(row) + "\n")


def test_report_and_plot(tmp_path):
    # baseline seeds span [0, 2] at every step; oppo seed 0 inside, seed 1 above from step 3
    for seed, (base, fast) in enumerate([([0.0] * 4, [1.0] * 4), ([2.0] * 4, [1.0, 1.0, 9.0, 9.0])]):
        _write(tmp_path, seed, "sequential", base)
        _write(tmp_path, seed, "oppo", fast, deferrals=[0, 1])
    out = tmp_path / "c.json"
    png = tmp_path / "c.png"
    code = convergence.main([str(tmp_path / "seed0.runs"), str(tmp_path / "seed1.runs"), "--window", "1",
                             "--json", str(out), "--plot", str(png)])
    assert code == 0
    report = json.loads(out.read_text())
    oppo = report["modes"]["oppo"]
    assert [s["inside_band"] for s in oppo["reward/mean"]] == [1.0, 0.5]
    assert [s["final"] for s in oppo["gold/mean"]] == [pytest.approx(0.1), pytest.approx(0.9)]
    assert oppo["deferrals"][0]["within_one_extra_step"] == 1.0
    # seed 1 paired with sequential seed 1 (constant 2.0, no spread): last mean 9 vs 2
    assert oppo["reward/mean"][1]["last_mean"] == 9.0
    assert oppo["reward/mean"][1]["baseline_last_mean"] == 2.0
    assert oppo["reward/mean"][1]["diff_in_baseline_std"] is None
    assert report["seeds"] == 2
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="no 'intra' runs"):
        convergence.main([str(tmp_path / "seed0.runs"), "--baseline", "intra"])


def test_runs_that_would_pair_other_seeds_or_steps_are_refused(tmp_path):
    """The report pairs each seed's run with the baseline run of the same seed, step by step:
    a mode missing from one directory paired every later seed with another seed's baseline,
    and a run cut short (a failed mode keeps its directory) compared its last steps with the
    baseline's last, other steps. Both are refused, naming the directory. The rounds after the
    first of `oppo-bench --repeat` repeat the same run: not read as modes."""
    for seed in (0, 1):
        _write(tmp_path, seed, "sequential", [1.0] * 6)
    _write(tmp_path, 1, "oppo", [1.0] * 6)
    _write(tmp_path, 1, "oppo.round2", [1.0] * 6)
    dirs = [str(tmp_path / "seed0.runs"), str(tmp_path / "seed1.runs")]
    with pytest.raises(SystemExit, match=r"seed0\.runs holds no run of oppo \(in .*seed1\.runs\)"):
        convergence.read_runs(dirs)
    _write(tmp_path, 0, "oppo", [1.0] * 4)
    with pytest.raises(SystemExit, match=r"seed0\.runs/oppo has steps 1\.\.4 \(4 rows\), .*"
                                         r"seed0\.runs/sequential steps 1\.\.6 \(6 rows\): "
                                         r"a run cut short"):
        convergence.read_runs(dirs)
    (tmp_path / "seed0.runs" / "oppo" / "metrics.jsonl").unlink()
    (tmp_path / "seed0.runs" / "oppo").rmdir()
    _write(tmp_path, 0, "oppo", [1.0] * 6)
    runs = convergence.read_runs(dirs)
    assert sorted(runs) == ["oppo", "sequential"] and all(len(v) == 2 for v in runs.values())
