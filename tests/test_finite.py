"""Tier 1: a NaN or inf from a model or an update stops the run on every rank, with one line
naming what and where, before anything is trained on it or saved (oppo_ds/finite.py). Before
this a NaN reward trained the actor into NaN weights at step 1, saved them in the checkpoint
and the HF export, and the run died at step 2 in ``torch.multinomial`` ("probability tensor
contains either `inf`, `nan` or element < 0")."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from _builders import single_process_env, spawn_gloo, tiny_reward_dir, tiny_run_overrides
from oppo_ds.engines.deepspeed_engine import find_free_port
from oppo_ds.experience import Experience
from oppo_ds.finite import NonFiniteError, check_experience, check_update
from oppo_ds.rollout.generate import SamplingParams, sample_tokens

MODELS = {"actor": "/ckpt/sft", "reference": "/ckpt/sft", "reward": "/ckpt/rm", "critic": "/ckpt/rm"}


def _experience(rows: int = 3, width: int = 4, seed: int = 0) -> Experience:
    """Finite experience; the last row's response is one token shorter (padding after it)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, width)
    mask[-1, -1] = 0
    x = lambda: torch.randn(rows, width, generator=g)  # noqa: E731
    return Experience(prompt_keys=[str(i) for i in range(rows)],
                      prompt_ids=torch.zeros(rows, 2, dtype=torch.long), prompt_mask=torch.ones(rows, 2),
                      response_ids=torch.zeros(rows, width, dtype=torch.long), response_mask=mask,
                      behaviour_logprobs=-x().abs(), old_logprobs=-x().abs(), ref_logprobs=-x().abs(),
                      old_values=x(), scores=torch.randn(rows, generator=g), gold=None,
                      rewards=x(), advantages=x(), returns=x())


def test_finite_experience_passes_and_padding_is_not_looked_at():
    exp = _experience()
    exp.ref_logprobs[-1, -1] = float("-inf")  # a padded position: whatever a scorer left there
    exp.old_values[-1, -1] = float("nan")
    check_experience(exp, MODELS, "fp32")


def test_a_models_nan_names_the_model_its_path_and_the_count():
    exp = _experience()
    exp.scores[1] = float("nan")
    exp.ref_logprobs[0, :2] = float("-inf")
    with pytest.raises(NonFiniteError) as err:
        check_experience(exp, MODELS, "fp16")
    msg = str(err.value)
    assert msg.startswith("the reward model (model.reward: /ckpt/rm) gave nan scores for 1 of 3 "
                          "responses; the reference model (model.reference: /ckpt/sft) gave inf "
                          "log-probs for 2 of 11 response tokens. Nothing of this step was trained on. "
                          "fp16 overflows easily (system.dtype=bf16 keeps fp32's range); else: a "
                          "checkpoint that holds NaN or inf, or, when earlier steps were finite, an "
                          "update too large (lower ppo.actor_lr / ppo.critic_lr, keep ppo.grad_clip on)"), msg


def test_overflow_in_gae_names_the_magnitudes_that_caused_it():
    exp = _experience()
    exp.old_values[0, 0] = 3e38  # finite, but GAE and whitening of it are not
    exp.advantages[:] = float("nan")
    with pytest.raises(NonFiniteError) as err:
        check_experience(exp, MODELS, "fp32")
    msg = str(err.value)
    assert msg.startswith("nan advantages for 11 of 11 response tokens: every score, log-prob and "
                          "value is finite, but the largest |score| is "), msg
    assert "the largest |value| 3e+38" in msg and "ppo.reward_clip" in msg
    assert "kl_estimator" not in msg
    exp.rewards[1, 2] = float("inf")  # k3's exp of a large log-ratio
    with pytest.raises(NonFiniteError, match=r"^inf rewards for 1 of 11 response tokens and nan "
                                             r"advantages .* ppo.kl_estimator k3"):
        check_experience(exp, MODELS, "fp32")


def _one_rank_has_a_nan(rank, world, out):
    exp = _experience(seed=rank)
    if rank == 1:
        exp.old_values[0, 1] = float("inf")
    try:
        check_experience(exp, MODELS, "bf16")
        out.put(("passed", rank, ""))
    except NonFiniteError as err:
        out.put(("stopped", rank, str(err)))


def test_every_rank_stops_when_one_ranks_experience_is_not_finite():
    got = sorted(spawn_gloo(_one_rank_has_a_nan, 2, join_s=120))
    assert [(kind, rank) for kind, rank, _ in got] == [("stopped", 0), ("stopped", 1)]
    assert all("the critic (model.critic: /ckpt/rm) gave inf values for 1 of 22 response tokens"
               in msg for _, _, msg in got)


@pytest.mark.parametrize("dtype, metrics, stops", [
    ("fp32", {"loss/policy": 0.1, "loss/value": 2.0, "grad_norm/actor": 3.0}, False),
    ("fp32", {"loss/policy": float("nan"), "loss/value": 2.0}, True),
    ("bf16", {"loss/policy": 0.1, "loss/value": 2.0, "grad_norm/critic": float("inf")}, True),
    # fp16: an inf gradient is loss scaling's, DeepSpeed skips that update; an inf loss is not
    ("fp16", {"loss/policy": 0.1, "loss/value": 2.0, "grad_norm/actor": float("inf")}, False),
    ("fp16", {"loss/policy": 0.1, "loss/value": float("inf")}, True),
])
def test_a_non_finite_loss_or_gradient_norm_stops(dtype, metrics, stops):
    if not stops:
        check_update(metrics, dtype)
        return
    with pytest.raises(NonFiniteError, match="the update gave .*=(nan|inf) from finite experience: "
                                             "no checkpoint holds the weights it made"):
        check_update(metrics, dtype)


def test_sampling_from_nan_logits_says_what_it_is():
    logits = torch.randn(4, 10)
    logits[2] = float("nan")
    params = SamplingParams(max_new_tokens=4, eos_token_ids=(0,), pad_token_id=0, temperature=1.0)
    with pytest.raises(NonFiniteError, match="the actor's next-token distribution is nan or inf for "
                                             "1 of 4 responses while sampling"):
        sample_tokens(logits, params, torch.Generator().manual_seed(0))


def test_the_gpu_sampling_path_carries_nan_to_the_steps_check():
    """With logits on a GPU and the trainer's CPU generator, tokens come from
    ``inverse_cdf_sample`` (not checked per token: a host sync): NaN rows still give token ids
    inside the vocabulary, so the decode goes on and its NaN log-probs reach the experience
    check, rather than an out-of-range id reaching the embedding (a device-side assert)."""
    from oppo_ds.rollout.generate import inverse_cdf_sample

    probs = torch.full((3, 7), float("nan"))
    tokens = inverse_cdf_sample(probs, torch.rand(3, generator=torch.Generator().manual_seed(0)))
    assert ((tokens >= 0) & (tokens < 7)).all()


# --------------------------------------------------------------------- through oppo-train

def _train(args, launcher: list[str] | None = None):
    cmd = (launcher or [sys.executable, "-m"]) + ["oppo_ds.train", *args]
    return subprocess.run(cmd, env=single_process_env(), text=True, capture_output=True, timeout=600)


def _nan_reward(root) -> str:
    """The tests' tiny reward model with a NaN head."""
    path = os.path.join(str(root), "nan-reward")
    shutil.copytree(tiny_reward_dir(root), path)
    weights = os.path.join(path, "model.safetensors")  # a sequence classifier: score.weight
    state = load_file(weights)
    state["score.weight"] = torch.full_like(state["score.weight"], float("nan"))
    save_file(state, weights, metadata={"format": "pt"})
    return path


def test_a_nan_reward_stops_at_step_1_with_nothing_saved(tmp_path):
    reward = _nan_reward(tmp_path)
    proc = _train(tiny_run_overrides(tmp_path, steps=3) + [f"model.reward={reward}", "checkpoint.every=1",
                                                           "checkpoint.export_hf=true"])
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("oppo-train: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith(f"oppo-train: error: step 1: the reward model (model.reward: {reward}) "
                                f"gave nan scores for 4 of 4 responses; the critic (model.critic: "
                                f"{reward}) gave nan values for "), errors[0]
    assert errors[0].endswith("; no checkpoint was written"), errors[0]
    assert "Traceback" not in proc.stderr
    run = tmp_path / "run"
    assert not (run / "checkpoints").exists() and not (run / "hf").exists()
    assert (run / "metrics.jsonl").read_text() == ""  # the step that stopped is not logged
    assert json.loads((run / "summary.json").read_text())["steps"] == 0


def test_an_exploding_update_stops_at_the_next_step_and_names_the_checkpoints(tmp_path):
    """A learning rate far too large: step 1's update is finite, its weights make the actor's
    logits NaN at step 2; the run names step 2 and the checkpoints there are to go back to."""
    proc = _train(tiny_run_overrides(tmp_path, steps=3) + ["checkpoint.every=1", "ppo.actor_lr=1e10"])
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = proc.stderr.splitlines()[-1]
    ckpt = tmp_path / "run" / "checkpoints"
    assert line == ("oppo-train: error: step 2: the actor's next-token distribution is nan or inf for "
                    f"{line.split('for ')[1].split(' of ')[0]} of 4 responses while sampling: its logits "
                    "are not finite: weights that hold NaN or inf, an overflow in fp16 (system.dtype=bf16 "
                    "keeps fp32's range), or, when earlier steps were finite, an update too large (lower "
                    "ppo.actor_lr / ppo.critic_lr, keep ppo.grad_clip on); "
                    f"checkpoints under {ckpt}: step1 (the same command resumes from the latest; "
                    "checkpoint.resume=TAG from another)"), proc.stderr[-2000:]
    assert (ckpt / "latest").read_text() == "step1"
    step1 = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())  # one row: step 1
    assert step1["step"] == 1 and step1["grad_norm/actor"] > 0 and step1["grad_norm/critic"] > 0


def test_the_stage_placement_stops_its_scorer_rank_too(tmp_path):
    """Actor ranks 0-1 stop on the NaN the scorer rank's reward model sent; they shut the
    stage down, so the scorer rank ends as well instead of failing on a closed link."""
    reward = _nan_reward(tmp_path)
    launcher = shutil.which("deepspeed", path=os.path.dirname(sys.executable))
    proc = _train(tiny_run_overrides(tmp_path, steps=2)
                  + [f"model.reward={reward}", "oppo.streaming=true", "oppo.placement=stage",
                     "system.torch_threads=1"],
                  launcher=[launcher, "--num_gpus", "3", "--master_port", str(find_free_port()), "--module"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert out.count("oppo-train: error: step 1: the reward model") == 1, out[-4000:]
    assert "gave nan scores for 8 of 8 responses" in out  # both actor ranks' rows
    assert "Connection closed by peer" not in out and "Traceback" not in out, out[-4000:]
