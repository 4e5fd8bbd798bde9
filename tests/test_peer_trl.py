"""The TRL 1.12 PPO peer (oppo_ds.peers.trl_peer) on the built-in workload, tiny settings.

TRL is an optional extra (`pip install 'oppo-ds[peer]'`); the tests that run it are skipped
without it, the CLI's answer to a missing TRL is tested either way.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
import torch

from oppo_ds.config import load_config
from oppo_ds.peers import trl_peer

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                               reason="trl not installed (pip install 'oppo-ds[peer]')")

# tests/test_trainer.py's SMALL workload
SMALL = ["workload.num_prompts=64", "workload.sft_steps=20", "workload.reward_steps=20",
         "generation.max_new_tokens=24", "ppo.batch_size=8", "ppo.mini_batch_size=4",
         "ppo.micro_batch_size=4"]


@pytest.fixture(autouse=True, scope="module")
def _no_rendezvous_left_behind():
    """TRL's trainer, run in this process, sets RANK, WORLD_SIZE, MASTER_PORT (accelerate's
    state) and leaves them: an `oppo-train` a later test starts would inherit a rendezvous
    without MASTER_ADDR, and DeepSpeed would fall back to MPI discovery (no mpi4py: a
    traceback). Put the environment back as it was."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {key: os.environ.get(key) for key in keys}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _sequences(tokenizer, prompts_path: str):
    """Four real prompts of the built-in task (left-padded) with responses of letters of
    different lengths (right-padded): three end at EOS, the longest fills the width without."""
    from oppo_ds import workload as wl
    from oppo_ds.data import encode_prompts, left_pad
    from oppo_ds.datafiles import read_prompt_rows

    prompts = encode_prompts(read_prompt_rows(prompts_path)[:4], tokenizer, 32).prompts
    prompt_ids, prompt_mask = left_pad([p.input_ids for p in prompts], tokenizer.pad_token_id)
    letters = tokenizer.convert_tokens_to_ids(list(wl.LETTERS))
    rows = [letters[:1] + [wl.EOS_ID], letters[3:8] + [wl.EOS_ID], letters[5:16] + [wl.EOS_ID],
            letters[2:17]]
    width = max(len(r) for r in rows)
    response_ids = torch.full((4, width), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(4, width)
    for i, r in enumerate(rows):
        response_ids[i, :len(r)] = torch.tensor(r)
        response_mask[i, :len(r)] = 1.0
    return prompt_ids, prompt_mask, response_ids, response_mask


@needs_trl
def test_sequence_classifier_scores_like_our_reward_model(cache_dir, torch_one_thread):
    """TRL's get_reward on the converted model gives our reward-model score (at the last
    response token) and, per token, our value-head values, on real sequences."""
    from oppo_ds.experience import response_values, sequence_scores
    from oppo_ds.models import build_value_model, load_tokenizer
    from oppo_ds.sources import resolve_sources

    _, _, module, _ = trl_peer._import_trl()
    src = resolve_sources(load_config(None, SMALL + [f"workload.cache_dir={cache_dir}"]), rank=0)
    tokenizer = load_tokenizer(src.tokenizer)
    ours = build_value_model(src.reward, require_head=True).eval()
    theirs = trl_peer.to_sequence_classifier(ours)
    assert type(theirs).__name__ == "LlamaForSequenceClassification"
    prompt_ids, prompt_mask, response_ids, response_mask = _sequences(tokenizer, src.prompts)
    context = prompt_ids.shape[1]
    with torch.no_grad():
        logits, trl_scores, _ = module.get_reward(theirs, torch.cat([prompt_ids, response_ids], 1),
                                                  tokenizer.pad_token_id, context)
        our_scores = sequence_scores(ours, prompt_ids, prompt_mask, response_ids, response_mask)
        our_values = response_values(ours, prompt_ids, prompt_mask, response_ids, response_mask)
    assert len({round(x, 3) for x in our_scores.tolist()}) == 4  # real, different scores
    torch.testing.assert_close(trl_scores.float(), our_scores, atol=1e-5, rtol=0)
    trl_values = logits[:, context - 1:-1, 0].float()
    valid = response_mask.bool()
    torch.testing.assert_close(trl_values[valid], our_values[valid], atol=1e-5, rtol=0)


@needs_trl
def test_two_step_run_writes_our_metrics(cache_dir, tmp_path, torch_one_thread):
    _, _, module, _ = trl_peer._import_trl()
    originals = (module.batch_generation, module.get_reward, module.forward, module.gc)
    out = tmp_path / "trl"
    rows = trl_peer.run_trl_peer(None, SMALL + [f"workload.cache_dir={cache_dir}"], 2, 0, str(out))
    assert (module.batch_generation, module.get_reward, module.forward, module.gc) == originals

    written = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert written == rows and [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["samples"] == 8
        assert len(row["response/lengths"]) == 8
        assert all(1 <= n <= 24 for n in row["response/lengths"])
        assert math.isfinite(row["reward/mean"])
        assert row["reward/mean"] == pytest.approx(row["trl/objective/scores"], abs=1e-5)
        assert -1.0 <= row["gold/mean"] <= 1.0
        assert 0.0 <= row["rollout/tail_waste_frac"] < 1.0
        phases = [row[f"time/phase/{p}"] for p in ("generate", "score", "advantages", "train", "gc")]
        assert all(t > 0 for t in phases)
        assert sum(phases) <= row["time/step_s"]
        for key in ("kl/mean", "loss/policy", "loss/value", "lr/actor"):
            assert math.isfinite(row[key]), key

    from oppo_ds.bench import summarize_mode

    summary = summarize_mode(rows, warmup=1)
    assert summary["samples_per_s"] > 0 and summary["gold_first"] is not None
    peer = json.loads((out / "peer.json").read_text())
    assert peer["trl_version"] == trl_peer.TRL_VERSION
    assert peer["ppo_config"]["num_mini_batches"] == 2 and peer["ppo_config"]["response_length"] == 24


def test_tail_waste_counts_what_generate_decoded_past_a_sampled_pad(tmp_path):
    """A row that sampled the pad id is one token long as TRL counts it, but generate decoded
    it to the batch's width: the waste is against the 2 x 5 slots decoded, not 2 x 3."""
    pad = 0
    recorder = trl_peer._StepRecorder(
        tokenizer=None, pad_token_id=pad, builtin_prompts=False,
        metrics_path=str(tmp_path / "m.jsonl"),
        first_true_indices=lambda b: torch.where(b.any(1), b.int().argmax(1),
                                                 torch.full((b.shape[0],), b.shape[1])))
    recorder.step_start = 0.0
    context = 2
    rows = torch.tensor([[1, 1, 5, pad, 7, 8, 2],    # sampled pad at its 2nd token
                         [1, 1, 5, 6, 2, pad, pad]])  # ended at EOS (2), then padded
    recorder.on_scored(rows, context, torch.zeros(2), end=1.0)
    row = recorder._row(1, end=2.0)
    assert row["response/lengths"] == [1, 3]
    assert row["rollout/tail_waste_frac"] == pytest.approx(1 - 4 / 10)


def test_cli_without_trl_exits_2_with_one_line(monkeypatch, tmp_path, capsys):
    def missing():
        raise trl_peer.PeerUnavailable(f"trl is not installed: {trl_peer.INSTALL_HINT}")

    monkeypatch.setattr(trl_peer, "_import_trl", missing)
    for name in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.setenv(name, "1" if name != "TRANSFORMERS_VERBOSITY" else "error")  # main sets them
    code = trl_peer.main(["--steps", "1", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "pip install 'oppo-ds[peer]'" in err


def test_cli_refuses_a_setting_trl_lacks_with_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(trl_peer, "_import_trl", lambda: None)  # refused before TRL is needed
    for name in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.setenv(name, "1" if name != "TRANSFORMERS_VERBOSITY" else "error")
    code = trl_peer.main(["--steps", "1", "--out", str(tmp_path / "x"), "ppo.kl_penalty=loss",
                           "ppo.kl_estimator=k3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "ppo.kl_penalty='loss'" in err


def test_settings_stop_at_the_first_of_our_end_ids_and_say_so(tmp_path):
    """TRL's PPO stops a response at one token id; ours at every id of the actor's generation
    config and the tokenizer's EOS: the peer stops at the first, and says so when there are
    more (TRL is not imported: the settings are plain keyword arguments)."""
    cfg = load_config(None, [])
    one, notes = trl_peer.trl_settings(cfg, out_dir=str(tmp_path), eos_token_ids=(2,), use_cpu=True)
    assert one["stop_token_id"] == 2 and not [n for n in notes if "stop_token_id" in n]
    two, notes = trl_peer.trl_settings(cfg, out_dir=str(tmp_path), eos_token_ids=(7, 2), use_cpu=True)
    assert two["stop_token_id"] == 7
    assert "responses end at token ids [7, 2] in oppo-ds; TRL stops at one (stop_token_id=7)" in notes
    none, _ = trl_peer.trl_settings(cfg, out_dir=str(tmp_path), eos_token_ids=(), use_cpu=True)
    assert none["stop_token_id"] is None


def test_settings_name_what_trl_has_no_counterpart_for(tmp_path):
    """PPO-ptx, the weight average, the held-out evaluation, the adaptive KL coefficient and
    the critic's warm-up have none in TRL's PPO: each is a note; the missing-EOS penalty is
    passed on."""
    cfg = load_config(None, ["data.ptx=t.jsonl", "ppo.ptx_coef=0.5", "model.actor_ema=true",
                             "eval.prompts=builtin", "ppo.missing_eos_penalty=1.5", "ppo.kl_target=6",
                             "ppo.freeze_actor_steps=5", "ppo.dual_clip=3",
                             "model.reward_normalize=true"])
    settings, notes = trl_peer.trl_settings(cfg, out_dir=str(tmp_path), eos_token_ids=(2,), use_cpu=True)
    assert settings["missing_eos_penalty"] == 1.5
    text = "\n".join(notes)
    for words in ("ppo.ptx_coef=0.5: TRL's PPO has no pretraining loss",
                  "model.actor_ema=true: TRL's PPO keeps no average",
                  "eval.prompts: the peer runs no held-out evaluation",
                  "ppo.missing_eos_penalty: TRL takes it off the unclipped score",
                  "ppo.kl_target=6.0: TRL 1.12's PPO keeps its KL coefficient fixed",
                  "ppo.freeze_actor_steps=5: TRL's PPO trains the policy from the first step",
                  "ppo.clip_eps_high=None, dual_clip=3.0: TRL's PPO clips the ratio at 1 +- "
                  "cliprange=0.2 only",
                  "model.reward_normalize=true: TRL's PPO scores with the reward model as it is"):
        assert words in text
    plain, notes = trl_peer.trl_settings(load_config(None, []), out_dir=str(tmp_path),
                                         eos_token_ids=(2,), use_cpu=True)
    assert plain["whiten_rewards"] is False and settings["whiten_rewards"] is False
    whiten, _ = trl_peer.trl_settings(load_config(None, ["ppo.whiten_rewards=true"]),
                                      out_dir=str(tmp_path), eos_token_ids=(2,), use_cpu=True)
    assert whiten["whiten_rewards"] is True  # the same option in both
    in_loss = load_config(None, ["ppo.kl_penalty=loss", "ppo.kl_estimator=k3"])
    with pytest.raises(ValueError, match="TRL's PPO takes the KL off the rewards only"):
        trl_peer.trl_settings(in_loss, out_dir=str(tmp_path), eos_token_ids=(2,), use_cpu=True)
    grpo_loss = load_config(None, ["ppo.loss_agg_mode=seq_mean_token_mean"])
    with pytest.raises(ValueError, match="TRL's PPO averages the policy loss over a mini-batch's tokens"):
        trl_peer.trl_settings(grpo_loss, out_dir=str(tmp_path), eos_token_ids=(2,), use_cpu=True)
    with pytest.raises(ValueError, match="TRL's PPO takes the policy ratio per token"):
        trl_peer.trl_settings(load_config(None, ["ppo.importance_sampling_level=sequence"]),
                              out_dir=str(tmp_path), eos_token_ids=(2,), use_cpu=True)
    with pytest.raises(ValueError, match="TRL's PPO has no overlong reward shaping"):
        trl_peer.trl_settings(load_config(None, ["ppo.overlong_buffer_len=64"]), out_dir=str(tmp_path),
                              eos_token_ids=(2,), use_cpu=True)
    with pytest.raises(ValueError, match="its GRPOTrainer takes reward functions"):
        trl_peer.trl_settings(load_config(None, ["model.reward_function=oppo_ds.workload:gold_reward"]),
                              out_dir=str(tmp_path), eos_token_ids=(2,), use_cpu=True)
    with pytest.raises(ValueError, match="TRL's PPO trains on truncated responses"):
        trl_peer.trl_settings(load_config(None, ["ppo.mask_truncated_completions=true"]),
                              out_dir=str(tmp_path), eos_token_ids=(2,), use_cpu=True)
    with pytest.raises(ValueError, match="TRL's PPO samples one response per prompt"):
        trl_peer.trl_settings(load_config(None, ["data.samples_per_prompt=2"]), out_dir=str(tmp_path),
                              eos_token_ids=(2,), use_cpu=True)
    rloo = load_config(None, ["ppo.advantage_estimator=rloo", "data.samples_per_prompt=2"])
    with pytest.raises(ValueError, match="TRL's PPO estimates advantages with a value model"):
        trl_peer.trl_settings(rloo, out_dir=str(tmp_path), eos_token_ids=(2,), use_cpu=True)
    assert plain["missing_eos_penalty"] is None and not [n for n in notes if "ptx" in n or "eval" in n or "kl_target" in n
                                          or "freeze" in n or "dual_clip" in n
                                          or "normalize" in n]


@needs_trl
def test_length_oracle_run_ends_each_response_at_its_prompts_target(tmp_path, torch_one_thread):
    """Under `workload.kind: length_oracle` (random-weight models of a real shape, speed only)
    our decode ends each row at its prompt's target length; the peer's HF generate would run
    every row to max_new_tokens. The peer ends each row at the same target, and stops the
    decode when the batch's longest target is reached, as ours: the same work per step."""
    from oppo_ds import workload as wl
    from oppo_ds.sources import oracle_vocab

    settings = ["workload.kind=length_oracle", "model.builtin_arch=tiny-qwen2",
                "generation.max_new_tokens=48", "ppo.batch_size=8", "ppo.mini_batch_size=4",
                "ppo.micro_batch_size=4"]
    rows = trl_peer.run_trl_peer(None, settings, 2, 0, str(tmp_path / "trl"))

    cfg = load_config(None, [*settings, "steps=2", "seed=0"])
    prompts = wl.run_oracle_prompts(cfg, oracle_vocab("tiny-qwen2"))
    target = {tuple(p.input_ids): p.target_len for p in prompts}
    order = trl_peer._ordered_prompt_ids(prompts, cfg)  # step k's prompts, as ours takes them
    for step, row in enumerate(rows):
        expected = [target[tuple(ids)] for ids in order[step * 8:(step + 1) * 8]]
        assert row["response/lengths"] == expected
        # the decode stopped at the batch's longest target: 8 rows of max(expected) slots
        idle = 1 - sum(expected) / (8 * max(expected))
        assert row["rollout/tail_waste_frac"] == pytest.approx(idle)
    assert min(max(r["response/lengths"]) for r in rows) < 48  # a step ended before the limit


def test_settings_train_bf16_models_in_bf16_and_say_how():
    """A bf16 config: the peer builds its models in bf16 and TRL trains with bf16=True (as a
    TRL user on a GPU does), noting that TRL keeps no fp32 master weights; fp16 stays fp32."""
    bf16 = load_config(None, ["system.dtype=bf16"])
    settings, notes = trl_peer.trl_settings(bf16, out_dir="", eos_token_ids=(2,), use_cpu=True)
    assert trl_peer.peer_dtype(bf16) == "bf16" and settings["bf16"] is True
    assert any("the peer's models are bf16" in n for n in notes)
    fp32 = load_config(None, [])
    settings, notes = trl_peer.trl_settings(fp32, out_dir="", eos_token_ids=(2,), use_cpu=True)
    assert trl_peer.peer_dtype(fp32) == "fp32" and settings["bf16"] is False
    assert not [n for n in notes if "dtype" in n]


def test_oracle_generation_refuses_prompts_without_a_target():
    """A prompt of TRL's batch that the oracle gave no target would decode to max_new_tokens,
    unlike ours: an error, not a silently unequal comparison (left pads are not the key)."""
    queries = torch.tensor([[0, 5, 6], [7, 8, 9]])  # pad id 0
    with pytest.raises(RuntimeError, match="1 of 2 prompts of TRL's batch have no target"):
        with trl_peer._oracle_generation(object(), queries, 0, {(5, 6): 3}):
            pass


@needs_trl
def test_static_cache_decodes_through_a_static_cache_with_the_same_tokens(
        cache_dir, tmp_path, monkeypatch, torch_one_thread):
    """generation.static_cache=true: TRL's generate decodes every rollout through one
    StaticCache size (the longest prompt and response), uncompiled on a CPU, and, seeded,
    samples the same tokens as the default decode (fp32: the same logits up to rounding)."""
    from transformers.generation import utils as generation_utils

    _, _, module, _ = trl_peer._import_trl()
    sizes, tokens = [], []

    class RecordedStaticCache(generation_utils.StaticCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sizes.append(kwargs["max_cache_len"])

    real_batch_generation = module.batch_generation

    def recorded_batch_generation(*args):
        out = real_batch_generation(*args)
        tokens.append(out[0].clone())
        return out

    monkeypatch.setattr(generation_utils, "StaticCache", RecordedStaticCache)
    monkeypatch.setattr(module, "batch_generation", recorded_batch_generation)
    settings = SMALL + [f"workload.cache_dir={cache_dir}"]
    plain = trl_peer.run_trl_peer(None, settings, 2, 0, str(tmp_path / "plain"))
    assert sizes == []
    static = trl_peer.run_trl_peer(None, settings + ["generation.static_cache=true"], 2, 0,
                                   str(tmp_path / "static"))
    assert sizes == [32 + 24] * 2  # max_prompt_len + max_new_tokens, once a rollout
    assert len(tokens) == 4
    for step in range(2):
        assert torch.equal(tokens[step], tokens[2 + step])
    assert [r["response/lengths"] for r in plain] == [r["response/lengths"] for r in static]
    peer = json.loads((tmp_path / "static" / "peer.json").read_text())
    assert peer["policy_generation_config"] == {"cache_implementation": "static",
                                                "max_cache_len": 56, "disable_compile": True}
    assert any("StaticCache of 56 positions" in n for n in peer["notes"])


def test_every_generation_key_is_mapped_noted_or_refused():
    """Each key of our generation section has its way into TRL's generate (GENERATION_KEYS);
    a key without one is refused when set, not silently dropped; generation.cuda_graph maps
    to transformers' compile of the static-cache forward, on a GPU only."""
    import dataclasses

    from oppo_ds.config import GenerationConfig

    assert {f.name for f in dataclasses.fields(GenerationConfig)} == set(trl_peer.GENERATION_KEYS)
    cfg = load_config(None, ["generation.sync_every=16"])
    _, notes = trl_peer.trl_settings(cfg, out_dir="", eos_token_ids=(2,), use_cpu=True)
    assert "generation.sync_every=16: HF generate checks for ended rows after every token" in notes
    assert trl_peer.policy_generation(cfg) == {}

    newer = dataclasses.make_dataclass("NewerGeneration", [("speculative_tokens", int, 0)],
                                       bases=(GenerationConfig,))
    cfg.generation = newer(speculative_tokens=4)
    with pytest.raises(trl_peer.PeerSettingError,
                       match=r"generation.speculative_tokens=4: the peer does not know how"):
        trl_peer.trl_settings(cfg, out_dir="", eos_token_ids=(2,), use_cpu=True)
    cfg.generation = newer()  # at its default: what the peer's decode does too
    trl_peer.trl_settings(cfg, out_dir="", eos_token_ids=(2,), use_cpu=True)

    graph = load_config(None, ["generation.static_cache=true", "generation.cuda_graph=true"])
    with pytest.raises(trl_peer.PeerSettingError,
                       match="generation.cuda_graph=true: .* CUDA GPU only, and this process "
                             "sees none"):
        trl_peer.trl_settings(graph, out_dir="", eos_token_ids=(2,), use_cpu=True)
    _, notes = trl_peer.trl_settings(graph, out_dir="", eos_token_ids=(2,), use_cpu=False)
    assert any("mode 'reduce-overhead': CUDA graphs" in n for n in notes)
    assert trl_peer.policy_generation(graph) == {
        "cache_implementation": "static", "max_cache_len": 32 + 192, "disable_compile": False}
