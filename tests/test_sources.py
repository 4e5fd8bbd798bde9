"""Tier 1: a run's model, tokenizer and prompt sources are checked before anything is built,
and a bad one is a ``ConfigError`` naming the key, which `oppo-train` prints as its one line
(each of these was a traceback, or a misleading error about something else, before)."""
import json

import pytest

from oppo_ds.config import ConfigError, load_config
from oppo_ds.models import build_causal_lm, build_value_model
from oppo_ds.workload import build_tokenizer


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A user's layout: an actor with its tokenizer, a reward model with a head, a causal LM
    without one, a model directory without a tokenizer, and a prompt file."""
    root = tmp_path_factory.mktemp("sources")
    tok = build_tokenizer()
    build_causal_lm("tiny-llama", vocab_size=len(tok), seed=0).save_pretrained(root / "actor")
    tok.save_pretrained(root / "actor")
    reward = build_value_model("tiny-llama", vocab_size=len(tok), seed=0)
    reward.save_pretrained(str(root / "reward"))
    build_causal_lm("tiny-llama", vocab_size=len(tok), seed=1).save_pretrained(root / "no-tokenizer")
    (root / "weightless").mkdir()  # a checkpoint whose weights were never copied
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (root / "weightless" / name).write_bytes((root / "actor" / name).read_bytes())
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "want a b c ->"}) + "\n")
    return root


LFS = "version https://git-lfs.github.com/spec/v1\noid sha256:0123abcd\nsize 7031\n"


def _base(root, out) -> list[str]:
    return [f"model.actor={root}/actor", f"model.reward={root}/reward",
            f"data.prompts={root}/prompts.jsonl", "steps=1", "ppo.batch_size=4",
            "ppo.mini_batch_size=4", "ppo.micro_batch_size=4", f"logging.output_dir={out}/run"]


@pytest.mark.parametrize("override, expected", [
    ("model.actor={root}/missing",
     "model.actor: model path '{root}/missing' is not a local directory; oppo-ds never downloads "
     "weights: point the config at a local Hugging Face checkpoint or use one of tiny-llama, "
     "tiny-qwen2, tiny-gpt2"),
    ("model.critic={root}/prompts.jsonl",
     "model.critic: model path '{root}/prompts.jsonl' is not a local directory; oppo-ds never "
     "downloads weights: point the config at a local Hugging Face checkpoint or use one of "
     "tiny-llama, tiny-qwen2, tiny-gpt2"),
    ("model.reward={root}/actor",
     "model.reward: {root}/actor: no value head found (looked for value_head.safetensors and "
     "keys value_head.weight, score.weight, v_head.weight, v_head.summary.weight); a reward "
     "model needs a trained scalar head"),
    ("model.tokenizer={root}/no-tokenizer",
     "model.tokenizer: '{root}/no-tokenizer' holds no tokenizer (looked for tokenizer.json, "
     "tokenizer.model, vocab.json, tokenizer_config.json)"),
    ("model.actor={root}/no-tokenizer",
     "model.actor: '{root}/no-tokenizer' holds no tokenizer (looked for tokenizer.json, "
     "tokenizer.model, vocab.json, tokenizer_config.json); set model.tokenizer to a tokenizer "
     "directory"),
    ("model.critic={root}/weightless",
     "model.critic: {root}/weightless holds no weights transformers can load (looked for "
     "model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
     "pytorch_model.bin.index.json): a config and tokenizer alone are no checkpoint; copy its "
     "weights too"),
], ids=["missing-actor", "critic-is-a-file", "reward-without-head", "tokenizer-dir-without-one",
        "actor-without-tokenizer", "critic-without-weights"])
def test_a_bad_source_is_an_error_naming_the_key(dirs, tmp_path, monkeypatch, override, expected):
    """Before: a missing actor directory fell back to the built-in tokenizer and failed on the
    prompts ("a list of chat messages but no chat template" or "encodes to no tokens"), a
    tokenizer directory without a tokenizer gave "encodes to no tokens", a reward model without
    a head a ValueError traceback from deep in the model build."""
    base = _base(dirs, tmp_path)
    from oppo_ds.engines import factory
    from oppo_ds.trainer import PPOTrainer

    monkeypatch.setattr(factory, "build_models",
                        lambda *a, **k: pytest.fail("models were built before the check"))
    with pytest.raises(ConfigError) as err:
        PPOTrainer(load_config(None, [*base, override.format(root=dirs)]))
    assert str(err.value) == expected.format(root=dirs)


def test_no_end_token_anywhere_runs_every_response_to_the_limit(dirs, tmp_path, caplog):
    """A raw tokenizer (no EOS, no pad) and an actor checkpoint whose configs name no EOS:
    the run pads with id 0, warns that every response runs to max_new_tokens, and trains
    (before: a TypeError from the first left_pad)."""
    import logging
    import shutil

    from oppo_ds.telemetry import read_history
    from oppo_ds.trainer import PPOTrainer

    actor = tmp_path / "actor"
    shutil.copytree(dirs / "actor", actor)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((actor / name).read_text())
        config["eos_token_id"] = None
        (actor / name).write_text(json.dumps(config))
    tok = build_tokenizer()
    tok.pad_token = None
    tok.eos_token = None
    tok.save_pretrained(actor)
    cfg = load_config(None, [
        f"model.actor={actor}", f"model.reward={dirs}/reward", f"data.prompts={dirs}/prompts.jsonl",
        "steps=1", "ppo.batch_size=4", "ppo.mini_batch_size=4", "ppo.micro_batch_size=4",
        "generation.max_new_tokens=5", "logging.progress=false", "checkpoint.export_hf=false",
        f"logging.output_dir={tmp_path}/run"])
    with caplog.at_level(logging.WARNING):
        PPOTrainer(cfg).train()
    assert "padding with id 0" in caplog.text and "no end-of-sequence token" in caplog.text
    (row,) = read_history(str(tmp_path / "run" / "metrics.jsonl"))
    assert row["response/lengths"] == [5, 5, 5, 5]


def test_a_broken_tokenizer_file_is_an_error_naming_the_key_and_the_file(dirs, tmp_path,
                                                                          monkeypatch):
    """A tokenizer.json cut short, or a git-lfs pointer never pulled in place of
    tokenizer_config.json, was a raw "json.decoder.JSONDecodeError: Expecting value: line 1
    column 1" (or the tokenizers library's error), naming no file: now the key that supplied
    the tokenizer (the actor's folder, or model.tokenizer) and the file."""
    from oppo_ds.engines import factory
    from oppo_ds.trainer import PPOTrainer

    monkeypatch.setattr(factory, "build_models",
                        lambda *a, **k: pytest.fail("models were built before the check"))
    cut = tmp_path / "cut"
    cut.mkdir()
    for file in (dirs / "actor").iterdir():
        data = file.read_bytes()
        (cut / file.name).write_bytes(data[:len(data) // 2] if file.name == "tokenizer.json"
                                      else data)
    with pytest.raises(ConfigError) as err:
        PPOTrainer(load_config(None, [*_base(dirs, tmp_path), f"model.actor={cut}"]))
    assert str(err.value).startswith(f"model.actor: {cut}/tokenizer.json cannot be read as "
                                     "JSON (")
    assert str(err.value).endswith("): a copy cut short; copy the tokenizer again; set "
                                   "model.tokenizer to a tokenizer directory")
    lfs = tmp_path / "lfs"
    lfs.mkdir()
    (lfs / "tokenizer.json").write_bytes((dirs / "actor" / "tokenizer.json").read_bytes())
    (lfs / "tokenizer_config.json").write_text(LFS)
    with pytest.raises(ConfigError) as err:
        PPOTrainer(load_config(None, [*_base(dirs, tmp_path), f"model.tokenizer={lfs}"]))
    assert str(err.value) == (
        f'model.tokenizer: {lfs}/tokenizer_config.json is a git-lfs pointer (a small text file '
        'starting "version https://git-lfs"), not the file itself: run `git lfs pull` in the '
        "repository it came from, or copy the tokenizer again")


def test_a_generation_config_left_a_git_lfs_pointer_names_the_actor(dirs, tmp_path, monkeypatch):
    """transformers skips a generation_config.json it cannot parse; the end-of-response ids
    (generation.eos_token_ids: auto) are read from it here, where it was a raw JSONDecodeError."""
    from oppo_ds.engines import factory
    from oppo_ds.trainer import PPOTrainer

    monkeypatch.setattr(factory, "build_models",
                        lambda *a, **k: pytest.fail("models were built before the check"))
    actor = tmp_path / "actor"
    actor.mkdir()
    for file in (dirs / "actor").iterdir():
        (actor / file.name).write_bytes(file.read_bytes())
    (actor / "generation_config.json").write_text(LFS)
    with pytest.raises(ConfigError) as err:
        PPOTrainer(load_config(None, [*_base(dirs, tmp_path), f"model.actor={actor}"]))
    assert str(err.value) == (
        f"model.actor: {actor}/generation_config.json is a git-lfs pointer, not the file itself: "
        f"run `git lfs pull` in the repository of {actor}, or copy the checkpoint again (read "
        "for generation.eos_token_ids: auto)")
