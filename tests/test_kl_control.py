"""The adaptive KL coefficient (ppo.kl_target): the controller's rule by hand, its settings'
errors, and real runs on the built-in workload: the coefficient the rewards are shaped with
is the one logged and follows the rule from the logged KL, and a resumed run continues it."""
from __future__ import annotations

import logging

import pytest

from oppo_ds.algo import adaptive_kl_coef
from oppo_ds.config import ConfigError, load_config
from oppo_ds.telemetry import read_history
from test_trainer import run


def test_the_rule_by_hand():
    # 256 responses over a horizon of 10000: at most 0.2 * 0.0256 of the coefficient per step
    assert adaptive_kl_coef(0.1, 9.0, 6.0, 256, 10000) == pytest.approx(0.1 * 1.00512, abs=1e-15)
    assert adaptive_kl_coef(0.1, 5.4, 6.0, 256, 10000) == pytest.approx(0.1 * 0.99744, abs=1e-15)
    assert adaptive_kl_coef(0.1, 6.0, 6.0, 256, 10000) == 0.1
    # a negative k1 estimate is far below any target: the clipped error shrinks it
    assert adaptive_kl_coef(0.1, -3.0, 6.0, 100, 100) == pytest.approx(0.08, abs=1e-15)
    assert adaptive_kl_coef(0.1, 100.0, 6.0, 100, 100) == pytest.approx(0.12, abs=1e-15)
    assert adaptive_kl_coef(0.1, 6.6, 6.0, 50, 100, max_error=0.05) == pytest.approx(0.1025, abs=1e-15)
    for target, horizon in ((0.0, 10), (6.0, 0)):
        with pytest.raises(ValueError, match="target > 0 and horizon > 0"):
            adaptive_kl_coef(0.1, 1.0, target, 8, horizon)


@pytest.mark.parametrize("overrides, key, words", [
    (["ppo.kl_target=0"], "ppo.kl_target", "must be > 0 or null"),
    (["ppo.kl_horizon=0"], "ppo.kl_horizon", "must be >= 1"),
    (["ppo.kl_target=6", "ppo.kl_coef=0"], "ppo.kl_coef", "from 0 it would stay 0"),
])
def test_bad_settings_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        load_config(None, overrides)
    assert words in str(err.value)


ADAPTIVE = ("ppo.kl_coef=0.05", "ppo.kl_target=0.5", "ppo.kl_horizon=20")


def test_the_rewards_use_the_logged_coefficient_and_it_follows_the_rule(cache_dir, tmp_path, monkeypatch):
    """Every step's rewards are shaped with kl/coef, and the next step's coefficient is the
    rule applied to this step's kl/mean and its 8 responses (1e-12: the same float64 arithmetic)."""
    import oppo_ds.ppo_update as update_module

    used = []
    real = update_module.kl_shaped_rewards

    def recording(*args, **kwargs):
        used.append(kwargs["kl_coef"])
        return real(*args, **kwargs)
    monkeypatch.setattr(update_module, "kl_shaped_rewards", recording)
    run(cache_dir, tmp_path / "run", "steps=5", *ADAPTIVE)
    rows = read_history(str(tmp_path / "run" / "metrics.jsonl"))
    coefs = [r["kl/coef"] for r in rows]
    assert coefs == used and coefs[0] == 0.05
    for row, following in zip(rows, coefs[1:]):
        assert following == pytest.approx(
            adaptive_kl_coef(row["kl/coef"], row["kl/mean"], 0.5, 8, 20), abs=1e-12)
    assert len(set(coefs)) == 5  # 8 responses over a horizon of 20: it moves every step

    monkeypatch.setattr(update_module, "kl_shaped_rewards", real)
    run(cache_dir, tmp_path / "fixed", "steps=2", "ppo.kl_coef=0.05")
    assert [r["kl/coef"] for r in read_history(str(tmp_path / "fixed" / "metrics.jsonl"))] == [0.05, 0.05]


def test_a_resumed_run_continues_the_coefficient(cache_dir, tmp_path, caplog):
    """Killed after step 3 with a checkpoint at step 2: the resumed run's coefficients and KL
    equal the uninterrupted run's (1e-6, as the other resume tests). A checkpoint written
    without ppo.kl_target starts the coefficient from ppo.kl_coef, and says so."""
    every = ("steps=4", "checkpoint.every=2", *ADAPTIVE)
    run(cache_dir, tmp_path / "full", *every)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cache_dir, tmp_path / "cut", *every, crash_after=3)
    run(cache_dir, tmp_path / "cut", *every)
    full = read_history(str(tmp_path / "full" / "metrics.jsonl"))
    cut = [r for r in read_history(str(tmp_path / "cut" / "metrics.jsonl")) if r["step"] > 2]
    assert [r["step"] for r in cut][-2:] == [3, 4]
    for key in ("kl/coef", "kl/mean", "reward/mean"):
        assert [r[key] for r in cut[-2:]] == pytest.approx([r[key] for r in full[2:]], abs=1e-6), key
    assert full[2]["kl/coef"] != 0.05

    run(cache_dir, tmp_path / "was_fixed", "steps=2", "checkpoint.every=2")
    with caplog.at_level(logging.INFO, logger="oppo_ds.resume"):
        run(cache_dir, tmp_path / "was_fixed", "steps=3", *ADAPTIVE)
    assert "holds no adaptive KL coefficient (written without ppo.kl_target)" in caplog.text
    rows = read_history(str(tmp_path / "was_fixed" / "metrics.jsonl"))
    assert rows[-1]["step"] == 3 and rows[-1]["kl/coef"] == 0.05


@pytest.mark.parametrize("schedule", [(), ("oppo.streaming=true", "oppo.overcommit=4", "ppo.kl_penalty=loss",
                                           "ppo.kl_estimator=k3")], ids=["sequential", "oppo-kl-in-loss"])
def test_with_the_kl_off_no_reference_is_built_and_training_is_the_same(cache_dir, tmp_path, monkeypatch,
                                                                       schedule):
    """ppo.kl_coef=0 (OpenRLHF's --init_kl_coef 0): no reference model is built or run, kl/mean
    and loss/kl are not logged, and the run is the one a reference scored at weight 0 gave
    before (forced here by patching PPOConfig.uses_reference): rewards, losses, gradient norms
    and responses equal to the last digit over 3 steps, sequentially and under full OPPO with
    the KL in the loss (the reference streamed there)."""
    from oppo_ds.config import PPOConfig

    common = ("steps=3", "checkpoint.export_hf=false", "ppo.kl_coef=0", *schedule)
    trainer, _ = run(cache_dir, tmp_path / "off", *common)
    assert trainer.reference is None and "reference" not in trainer.cfg.oppo.stream_to
    with monkeypatch.context() as patch:
        patch.setattr(PPOConfig, "uses_reference", property(lambda self: True))
        forced, _ = run(cache_dir, tmp_path / "forced", *common)
    assert forced.reference is not None
    if schedule:
        assert "reference" in forced.cfg.oppo.stream_to
    off, with_ref = (read_history(str(tmp_path / d / "metrics.jsonl")) for d in ("off", "forced"))
    assert len(off) == len(with_ref) == 3
    for a, b in zip(off, with_ref):
        assert "kl/mean" not in a and "loss/kl" not in a and "kl/mean" in b
        for key in ("reward/mean", "gold/mean", "response/lengths", "loss/policy", "loss/value",
                    "grad_norm/actor", "grad_norm/critic", "policy/entropy", "value/mean"):
            assert a[key] == b[key], key
