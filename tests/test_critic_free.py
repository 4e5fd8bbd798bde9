"""Tier 1: the critic-free estimators (ppo.advantage_estimator) on the built-in workload with
real DeepSpeed engines: no critic is built, checkpointed or exported; a step's advantages are
its responses' scores against their prompt's other responses, by hand; under the rollout pool
a step trains on whole groups, nothing is lost or trained twice, and a resumed run continues
exactly."""
from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch

from oppo_ds.telemetry import read_history
from test_trainer import _metrics_by_step, run

pytestmark = pytest.mark.usefixtures("torch_one_thread")

N = 4  # responses per prompt; ppo.batch_size 8 in test_trainer.SMALL: two prompts a step
RLOO = ("ppo.advantage_estimator=rloo", f"data.samples_per_prompt={N}")


def _record_experience(monkeypatch):
    """Every step's experience, kept after its advantages were computed."""
    from oppo_ds import ppo_update

    seen = []
    real = ppo_update.PPOUpdate.compute_advantages

    def compute_advantages(self, exp):
        real(self, exp)
        seen.append(exp)
    monkeypatch.setattr(ppo_update.PPOUpdate, "compute_advantages", compute_advantages)
    return seen


def _prompt_of(key: str) -> str:
    return key.rsplit("#", 1)[0]


def _assert_whole_groups(exp, n=N):
    """Each label of exp.groups marks n rows, the responses #0..#n-1 to one prompt."""
    rows = defaultdict(list)
    for label, key in zip(exp.groups.tolist(), exp.prompt_keys):
        rows[label].append(key)
    assert all(len(keys) == n for keys in rows.values()), rows
    for keys in rows.values():
        assert len({_prompt_of(k) for k in keys}) == 1
        assert sorted(k.rsplit("#", 1)[1] for k in keys) == [str(k) for k in range(n)]


def test_rloo_advantages_by_hand_and_no_critic_anywhere(cache_dir, tmp_path, monkeypatch):
    """KL off, scores unclipped, no whitening, gamma 1: every token of a response has the
    advantage score - mean(the other 3 responses' scores), to float rounding (1e-5)."""
    seen = _record_experience(monkeypatch)
    out = tmp_path / "rloo"
    # an earlier run's export in the same directory: a critic, and a file of its actor's that
    # this run's actor does not write (they stayed beside this run's export)
    for stale in (out / "critic" / "config.json", out / "actor" / "chat_template.jinja"):
        stale.parent.mkdir(parents=True, exist_ok=True)
        stale.write_text("{}")
    trainer, summary = run(cache_dir, out, "steps=2", *RLOO, "ppo.kl_coef=0",
                           "ppo.reward_clip=null", "ppo.whiten_advantages=false",
                           "checkpoint.every=1")
    assert trainer.critic is None and summary["steps"] == 2
    for exp in seen:
        _assert_whole_groups(exp)
        by_group = defaultdict(list)
        for i, g in enumerate(exp.groups.tolist()):
            by_group[g].append(i)
        scores = exp.scores.tolist()
        for rows in by_group.values():
            for i in rows:
                others = [scores[j] for j in rows if j != i]
                expected = scores[i] - sum(others) / len(others)
                valid = exp.response_mask[i].bool()
                assert torch.allclose(exp.advantages[i][valid], torch.full((int(valid.sum()),), expected),
                                      atol=1e-5)
                assert not exp.advantages[i][~valid].any()
        assert exp.old_values.abs().max() == 0
    history = read_history(str(out / "metrics.jsonl"))
    for r in history:
        assert "loss/policy" in r and "grad_norm/actor" in r
        assert not {"value/mean", "loss/value", "lr/critic", "grad_norm/critic"} & set(r)
    assert sorted(os.listdir(out / "checkpoints")) == ["actor", "latest", "trainer"]
    assert not os.path.exists(out / "critic") and os.path.isdir(out / "actor")
    assert not os.path.exists(out / "actor" / "chat_template.jinja")
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]


def test_group_norm_with_the_pool_trains_whole_groups_once(cache_dir, tmp_path, monkeypatch):
    """GRPO's estimator under overcommitment, streaming: each step's batch is whole groups
    (the pool takes a prompt's responses together), every row is trained on at most once and
    the ledger balances (every row drawn is trained or still in the pool)."""
    seen = _record_experience(monkeypatch)
    trainer, _ = run(cache_dir, tmp_path / "gn", "steps=5", "checkpoint.export_hf=false",
                     "ppo.advantage_estimator=group_norm", f"data.samples_per_prompt={N}",
                     "oppo.overcommit=8", "oppo.streaming=true", "oppo.chunk_size=4")
    assert trainer.pool.group_size == N
    for exp in seen:
        _assert_whole_groups(exp)
        assert exp.advantages.abs().max() > 0
    trained = trainer.pool.ledger.trained
    assert sum(trained.values()) == 5 * 8 and max(trained.values()) == 1
    trainer.pool.check()
    assert all(len(rows) == N for rows in trainer.pool.groups().values())
    history = read_history(str(tmp_path / "gn" / "metrics.jsonl"))
    deferred = [r["pool/deferred_frac"] for r in history]
    assert max(deferred) > 0  # later steps trained groups drawn before them: the pool carried work


def test_auto_delta_moves_whole_prompts(cache_dir, tmp_path, monkeypatch):
    """overcommit: auto under a group baseline: Delta moves a prompt (N rows) at a time, so
    every step's pool holds exactly B + Delta rows, the number the metrics log (a Delta
    between multiples of N used to start the next multiple's pool while the log named the
    smaller one)."""
    from oppo_ds.rollout.pool import RolloutPool

    sizes = []
    real = RolloutPool.top_up

    def top_up(self, prompts, size):
        real(self, prompts, size)
        sizes.append(len(self.entries))
    monkeypatch.setattr(RolloutPool, "top_up", top_up)
    trainer, _ = run(cache_dir, tmp_path / "auto", "steps=7", "checkpoint.export_hf=false",
                     "ppo.advantage_estimator=rloo", f"data.samples_per_prompt={N}",
                     "oppo.overcommit=auto", "oppo.delta_max=8", "oppo.delta_window=2")
    history = read_history(str(tmp_path / "auto" / "metrics.jsonl"))
    deltas = [r["pool/delta"] for r in history]
    assert deltas[0] == 8 and all(d in (0, 4, 8) for d in deltas)
    assert len(set(deltas)) > 1  # three windows closed: Delta moved
    # whatever the pool carried, it was topped up to exactly B + Delta rows (whole prompts)
    assert sizes == [8 + d for d in deltas]
    trainer.pool.check()
    assert trainer.delta_ctl.step_size == N


def test_critic_free_pool_resume_continues_exactly(cache_dir, tmp_path):
    """Killed after its step-2 checkpoint and resumed, a group_norm run with deferred groups
    in its pool gives the same steps 3-4 as an uninterrupted run (1e-6, as the PPO resume)."""
    over = ("steps=4", "checkpoint.every=2", "checkpoint.export_hf=false",
            "ppo.advantage_estimator=group_norm", f"data.samples_per_prompt={N}",
            "oppo.overcommit=8")
    full, _ = run(cache_dir, tmp_path / "full", *over)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cache_dir, tmp_path / "cut", *over, crash_after=3)
    resumed, _ = run(cache_dir, tmp_path / "cut", *over)
    a, b = _metrics_by_step(tmp_path / "full" / "metrics.jsonl"), _metrics_by_step(tmp_path / "cut" / "metrics.jsonl")
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert b[step]["response/lengths"] == a[step]["response/lengths"]
        for key in ("reward/mean", "gold/mean", "kl/mean", "loss/policy", "policy/clip_frac",
                    "pool/stale_token_frac"):
            assert b[step][key] == pytest.approx(a[step][key], abs=1e-6), (step, key)
    assert [e.tokens for e in resumed.pool.entries] == [e.tokens for e in full.pool.entries]
    assert [e.group for e in resumed.pool.entries] == [e.group for e in full.pool.entries]
    assert resumed.pool.ledger.state_dict() == full.pool.ledger.state_dict()


def test_a_group_pool_does_not_resume_with_other_groups(cache_dir, tmp_path):
    """A pool holding deferred groups of 4 resumed with data.samples_per_prompt 2 would count
    and take them in groups of 2: a step trained 20 rows at B 16 before this was refused."""
    from oppo_ds.config import ConfigError

    over = ("checkpoint.every=1", "checkpoint.export_hf=false", "oppo.overcommit=8",
            "ppo.advantage_estimator=group_norm")
    trainer, _ = run(cache_dir, tmp_path / "g", "steps=1", f"data.samples_per_prompt={N}", *over)
    assert len(trainer.pool) > 0
    with pytest.raises(ConfigError, match=r"^data.samples_per_prompt: 2, but checkpoint step1 "
                                          r"holds \d+ deferred sequence\(s\) in groups of 4"):
        run(cache_dir, tmp_path / "g", "steps=2", "data.samples_per_prompt=2", *over)
    run(cache_dir, tmp_path / "g", "steps=2", f"data.samples_per_prompt={N}", *over)


def test_a_ppo_checkpoint_does_not_resume_critic_free(cache_dir, tmp_path):
    from oppo_ds.config import ConfigError

    out = tmp_path / "ppo"
    run(cache_dir, out, "steps=1", "checkpoint.every=1", "checkpoint.export_hf=false")
    with pytest.raises(ConfigError, match="ppo.advantage_estimator") as err:
        run(cache_dir, out, "steps=2", *RLOO, "checkpoint.export_hf=false")
    assert "rloo, but checkpoint step1 was written with gae" in str(err.value)


def test_two_ranks_zero3_group_pool_stop_together(tmp_path):
    """ZeRO-3 on 2 ranks, GRPO's estimator, the group pool and streaming: each rank takes
    whole groups of its own prompts, both stop decoding at the same token (the trainer fails
    on differing stop-check counts), and each rank's ledger balances."""
    from oppo_ds.rollout.pool import RolloutPool
    from test_distributed import launch

    out = tmp_path / "run"
    launch(out, tmp_path / "cache", "steps=3", "system.zero_stage=3", "checkpoint.every=3",
           "checkpoint.export_hf=false", "ppo.advantage_estimator=group_norm",
           "data.samples_per_prompt=2", "oppo.overcommit=2", "oppo.streaming=true",
           "oppo.chunk_size=4")
    for rank in (0, 1):
        state = torch.load(out / "checkpoints" / "trainer" / "step3" / f"rank{rank}.pt",
                           weights_only=False)
        pool = RolloutPool(batch_size=4, max_defer_steps=2, group_size=2)
        pool.load_state_dict(state["pool"])
        pool.check()
        assert sum(pool.ledger.trained.values()) == 3 * 4
        trained = {k for k, n in pool.ledger.trained.items() if n}
        # whole prompts: both responses of every prompt trained, or both still in the pool
        assert {_prompt_of(k) for k in trained}.isdisjoint({_prompt_of(e.key) for e in pool.entries})
        assert all(len(rows) == 2 for rows in pool.groups().values())
    history = read_history(str(out / "metrics.jsonl"))
    assert all(r["pool/sync_calls"] >= 1 and len(r["pool/deferrals"]) == 2 * 4 for r in history)
