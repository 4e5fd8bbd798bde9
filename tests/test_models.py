"""Tier 0/2: model builders on tiny architectures built from config (nothing downloaded):
checkpoint round trips, value heads taken from other formats, KV-cache consistency of the
value model, local-only loading, dropout switched off."""

import json
import os
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

from oppo_ds import models, workload
from oppo_ds.models import (
    TINY_ARCHS,
    VALUE_HEAD_FILE,
    ValueHeadModel,
    build_causal_lm,
    build_value_model,
    checkpoint_eos_ids,
    disable_dropout,
    load_tokenizer,
    source_problem,
    tiny_config,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")

VOCAB = 64
ARCHS = ["tiny-llama", "tiny-qwen2", "tiny-gpt2"]


@pytest.fixture(autouse=True)
def _quiet_transformers():
    # loading an LM checkpoint into a bare body prints a load report for the unused LM head
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


def _tokens(batch=2, length=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)  # no pad / bos / eos ids


def _random_head(model: ValueHeadModel, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.value_head.weight.copy_(torch.randn(model.value_head.weight.shape, generator=g))
    return model


def _same_state(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_arch_list():
    assert set(TINY_ARCHS) == set(ARCHS)
    with pytest.raises(ValueError, match="tiny-llama"):
        tiny_config("tiny-mistral", VOCAB)


# ---------------------------------------------------------------- causal LM

@pytest.mark.parametrize("arch", ARCHS)
def test_causal_lm_save_reload_identical_logits(arch, tmp_path):
    lm = build_causal_lm(arch, vocab_size=VOCAB, seed=0).eval()
    assert lm.config.vocab_size == VOCAB
    lm.save_pretrained(tmp_path)
    assert os.path.isfile(tmp_path / "model.safetensors")
    reloaded = build_causal_lm(str(tmp_path)).eval()
    assert type(reloaded) is type(lm)
    x = _tokens()
    with torch.no_grad():
        assert torch.equal(lm(x).logits, reloaded(x).logits)


def test_causal_lm_seed_fixes_init():
    a = build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=3)
    b = build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=3)
    c = build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=4)
    _same_state(a, b)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_a_model_built_from_config_is_made_on_the_device_it_is_given():
    """``device`` is where the weights are made and initialized (the trainer passes its GPU:
    ``build_device``); "meta" shows it without one, since nothing there has numbers. Without a
    GPU, and under ZeRO-3 with one, the models are made on the CPU."""
    from oppo_ds.models import build_device

    for build in (build_causal_lm, build_value_model):
        on_meta = build("tiny-qwen2", vocab_size=VOCAB, seed=3, device="meta")
        assert {p.device.type for p in on_meta.parameters()} == {"meta"}
        assert {p.device.type for p in build("tiny-qwen2", vocab_size=VOCAB, seed=3)
                .parameters()} == {"cpu"}
    assert build_device(3) is None
    gpu = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    assert [build_device(stage) for stage in (0, 1, 2)] == [gpu] * 3


def test_tiny_arch_needs_vocab_size():
    with pytest.raises(ValueError, match="vocab_size"):
        build_causal_lm("tiny-llama")
    with pytest.raises(ValueError, match="vocab_size"):
        build_value_model("tiny-gpt2")


def test_causal_lm_dtype():
    lm = build_causal_lm("tiny-qwen2", vocab_size=VOCAB, dtype="bf16")
    assert next(lm.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fp32"):
        build_causal_lm("tiny-qwen2", vocab_size=VOCAB, dtype="fp64")


def test_causal_lm_from_checkpoint_with_missing_weights_fails(tmp_path):
    """A value-model directory has no LM head: loading it as the actor must not silently give
    a random head."""
    build_value_model("tiny-llama", vocab_size=VOCAB, seed=0).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="lm_head.weight"):
        build_causal_lm(str(tmp_path))


def test_a_weights_file_cut_short_names_the_checkpoint(tmp_path):
    """safetensors' own error ("Error while deserializing header: ...") names no file: a
    copy cut short, loaded as the actor, names the file and what to do, before transformers
    reads it; the start's check of every model source says the same before anything is
    built."""
    build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0).save_pretrained(str(tmp_path))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"^{re.escape(str(weights))} cannot be read \\(Error "
                                         "while deserializing header") as err:
        build_causal_lm(str(tmp_path))
    assert "copy the checkpoint again" in str(err.value)
    assert source_problem(str(tmp_path)) == str(err.value)


def test_a_sharded_checkpoint_missing_a_shard_is_a_source_problem(tmp_path):
    """The index names every shard; one not copied is named before any model is built (a
    70B checkpoint's shards take minutes to load before transformers would notice)."""
    build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0).save_pretrained(
        str(tmp_path), max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and source_problem(str(tmp_path)) is None
    os.remove(tmp_path / shards[1])
    assert source_problem(str(tmp_path)) == (
        f"{tmp_path / 'model.safetensors.index.json'} lists 1 weight file(s) the directory does "
        f"not hold ({shards[1]}): a checkpoint copied in part")
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    assert "cannot be read as a weights index" in source_problem(str(tmp_path))


def test_a_checkpoint_without_weights_transformers_reads_is_a_source_problem(tmp_path):
    """A folder with only config.json and the tokenizer, or a shard without its index, passed
    every check, and the engine build then raised transformers' "OSError: Error no file named
    model.safetensors, or pytorch_model.bin, found in directory"; a git-lfs pointer in place
    of model.safetensors gave safetensors' "header too large". Each is named, before any
    model is built."""
    build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0).save_pretrained(
        str(tmp_path), max_shard_size="20KB")
    workload.build_tokenizer().save_pretrained(str(tmp_path))
    looked = ("model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
              "pytorch_model.bin.index.json")
    os.remove(tmp_path / "model.safetensors.index.json")
    shards = sorted(p.name for p in tmp_path.glob("model-*-of-*.safetensors"))
    assert source_problem(str(tmp_path)) == (
        f"{tmp_path} holds no weights transformers can load (looked for {looked}): it holds "
        f"shards ({', '.join(shards[:3])}) but not model.safetensors.index.json, the index "
        "that lists them: a checkpoint copied in part; copy the checkpoint again")
    for shard in tmp_path.glob("model-*.safetensors"):
        os.remove(shard)
    assert source_problem(str(tmp_path)) == (
        f"{tmp_path} holds no weights transformers can load (looked for {looked}): a config "
        "and tokenizer alone are no checkpoint; copy its weights too")
    (tmp_path / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 123456\n")
    assert source_problem(str(tmp_path)) == (
        f"{tmp_path / 'model.safetensors'} is a git-lfs pointer, not the file itself: run "
        f"`git lfs pull` in the repository of {tmp_path}, or copy the checkpoint again")


def test_only_the_weights_transformers_reads_are_checked(tmp_path):
    """A repo downloaded without its .bin shards keeps pytorch_model.bin.index.json, which
    transformers ignores when safetensors weights are there: no problem. Nor is a stale
    sharded index beside a whole model.safetensors."""
    build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0).save_pretrained(
        str(tmp_path), max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    bins = {key: "pytorch_model-00001-of-00002.bin" for key in index["weight_map"]}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": bins}))
    assert source_problem(str(tmp_path)) is None
    build_causal_lm(str(tmp_path))  # transformers reads the safetensors shards
    whole = tmp_path / "whole"
    build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0).save_pretrained(str(whole))
    (whole / "model.safetensors.index.json").write_text(json.dumps(index))  # shards not there
    assert source_problem(str(whole)) is None
    build_causal_lm(str(whole))  # as transformers reads it


def test_weights_of_other_shapes_than_the_config_name_them(tmp_path):
    """transformers raises "look at the above report!" and logs the report as a warning,
    which the load holds back: the error now names the weights and both shapes."""
    build_value_model("tiny-llama", vocab_size=VOCAB, seed=0).save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    width = config["intermediate_size"]
    config["intermediate_size"] = 2 * width
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert source_problem(str(tmp_path)) is None  # the files are whole: only a load tells
    hidden = config["hidden_size"]
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path))}: weights of the "
                                         f"checkpoint have other shapes than the architecture "
                                         f"its config.json") as err:
        build_value_model(str(tmp_path), require_head=True)
    # one row per projection, its layers folded into one key as transformers reports them
    layers = ", ".join(map(str, range(config["num_hidden_layers"])))
    assert f"layers.{{{layers}}}.mlp.up_proj.weight: [{width}, {hidden}] in the checkpoint, " \
        f"[{2 * width}, {hidden}] in the model" in str(err.value)


def test_the_mismatch_rows_of_a_deep_models_report_are_read():
    """Past ten layers transformers writes a key's layers as {first...last}; the rows are
    read as they are (a count of weights would be wrong there), the rest noted."""
    from oppo_ds.models import _HeldReport

    report = _HeldReport()
    rows = [f"model.layers.{{0...31}}.mlp.{p}_proj.weight | MISMATCH | Reinit due to size "
            f"mismatch - ckpt: torch.Size([11008, 4096]) vs model:torch.Size([14336, 4096])"
            for p in ("up", "gate")]
    report.texts.append("\x1b[1mLlamaModel LOAD REPORT\x1b[0m from: /ckpt\nKey | Status | \n"
                        "---+---+---\n" + "\n".join(rows) + "\nscore.weight | UNEXPECTED | ")
    assert report.mismatches() == [
        f"model.layers.{{0...31}}.mlp.{p}_proj.weight: [11008, 4096] in the checkpoint, "
        f"[14336, 4096] in the model" for p in ("up", "gate")]


# ---------------------------------------------------------------- value-head models

@pytest.mark.parametrize("arch", ARCHS)
def test_value_model_shape_and_round_trip(arch, tmp_path):
    vm = _random_head(build_value_model(arch, vocab_size=VOCAB, seed=0)).eval()
    x = _tokens(batch=3, length=7)
    with torch.no_grad():
        values = vm(x).values
    assert values.shape == (3, 7)
    assert values.abs().sum() > 0
    (tmp_path / VALUE_HEAD_FILE).write_bytes(b"an earlier export's head")  # must not be read
    vm.save_pretrained(str(tmp_path))
    assert not os.path.isfile(tmp_path / VALUE_HEAD_FILE)
    reloaded = build_value_model(str(tmp_path), require_head=True).eval()
    _same_state(vm, reloaded)
    with torch.no_grad():
        assert torch.equal(reloaded(x).values, values)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_saved_value_model_is_an_hf_sequence_classifier(arch, tmp_path):
    """What TRL takes as a value or reward model: AutoModelForSequenceClassification loads
    every weight (none missing, none left over) and scores the last token as we do, within
    1e-5 (fp32: the same ops, in another module)."""
    from transformers import AutoModelForSequenceClassification

    vm = _random_head(build_value_model(arch, vocab_size=VOCAB, seed=0)).eval()
    vm.save_pretrained(str(tmp_path))
    hf, info = AutoModelForSequenceClassification.from_pretrained(str(tmp_path),
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert hf.config.num_labels == 1
    assert hf.config.architectures[0].endswith("ForSequenceClassification")
    x = _tokens(batch=1, length=7)  # one row: no padding for HF to look for
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(x).logits[:, 0], vm(x).values[:, -1],
                                   rtol=0, atol=1e-5)


def test_an_architecture_without_a_sequence_classifier_keeps_its_own_head_file(tmp_path,
                                                                              monkeypatch):
    """The fallback for an architecture transformers has no *ForSequenceClassification for
    (none of the tiny ones: AutoModelForSequenceClassification is made to refuse here)."""
    from transformers import AutoModelForSequenceClassification

    def refuse(config, **kwargs):
        raise ValueError(f"Unrecognized configuration class {type(config)}")
    monkeypatch.setattr(AutoModelForSequenceClassification, "from_config", refuse)
    vm = _random_head(build_value_model("tiny-llama", vocab_size=VOCAB, seed=0)).eval()
    vm.save_pretrained(str(tmp_path))
    assert os.path.isfile(tmp_path / VALUE_HEAD_FILE)
    _same_state(vm, build_value_model(str(tmp_path), require_head=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_value_model_has_zero_head(arch):
    vm = build_value_model(arch, vocab_size=VOCAB, seed=0)
    assert torch.count_nonzero(vm.value_head.weight) == 0
    with torch.no_grad():
        assert torch.count_nonzero(vm(_tokens()).values) == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_value_model_from_causal_lm_checkpoint(arch, tmp_path):
    lm = build_causal_lm(arch, vocab_size=VOCAB, seed=0).eval()
    lm.save_pretrained(tmp_path)
    vm = build_value_model(str(tmp_path)).eval()
    # the body is the LM's body, weight for weight; the head starts at zero
    _same_state(lm.base_model, vm.body)
    x = _tokens()
    with torch.no_grad():
        out = vm(x).values
        hidden = lm(x, output_hidden_states=True).hidden_states[-1]
    assert out.shape == x.shape and torch.count_nonzero(out) == 0
    assert torch.count_nonzero(vm.value_head.weight) == 0
    with torch.no_grad():
        assert torch.allclose(vm.body(x).last_hidden_state, hidden, atol=1e-6)
    with pytest.raises(ValueError, match="value head"):
        build_value_model(str(tmp_path), require_head=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_value_head_from_sequence_classifier(arch, tmp_path):
    config = tiny_config(arch, VOCAB)
    config.num_labels = 1
    torch.manual_seed(5)
    clf = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    clf.save_pretrained(tmp_path)
    assert "score.weight" in load_file(str(tmp_path / "model.safetensors"))
    vm = build_value_model(str(tmp_path), require_head=True).eval()
    assert torch.equal(vm.value_head.weight, clf.score.weight)
    x = _tokens()
    with torch.no_grad():
        values = vm(x).values
        # the classifier's per-token scores, by hand from its hidden states
        hidden = clf.base_model(x).last_hidden_state
        per_token = hidden @ clf.score.weight[0]
        pooled = clf(x).logits[:, 0]  # HF pools at the last non-pad token (the last one here)
    assert torch.allclose(values, per_token, atol=1e-5)
    assert torch.allclose(values[:, -1], pooled, atol=1e-5)
    assert values.abs().sum() > 0


def test_the_value_head_is_read_from_the_file_transformers_reads(tmp_path):
    """A shard left by an earlier sharded save sorts before model.safetensors; its old head
    must not be taken over the head of the weights the body is loaded from."""
    vm = build_value_model("tiny-llama", vocab_size=VOCAB, seed=0)
    with torch.no_grad():
        vm.value_head.weight.fill_(0.5)
    vm.save_pretrained(str(tmp_path))
    stale = torch.full_like(vm.value_head.weight, -1.0)
    save_file({"score.weight": stale.contiguous()},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    assert torch.equal(build_value_model(str(tmp_path)).value_head.weight,
                       torch.full_like(stale, 0.5))
    # a head in a file of its own beside the body's (no value_head.safetensors) is still found
    body = tmp_path / "body"
    build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0).save_pretrained(str(body))
    save_file({"score.weight": stale.contiguous()}, str(body / "score.safetensors"))
    assert torch.equal(build_value_model(str(body)).value_head.weight, stale)


def test_value_head_reads_an_opt_bodys_projected_width(tmp_path):
    """OPT-350m (DeepSpeed-Chat's default critic) projects its hidden size (1024) to
    word_embed_proj_dim (512) before the output: a scalar head of the hidden size failed at
    the first forward with a shape error. Its head reads the projected width, as HF's OPT
    classifier does, and scores what that classifier scores."""
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, word_embed_proj_dim=32,
                                    num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                                    max_position_embeddings=64, num_labels=1)
    torch.manual_seed(3)
    clf = transformers.OPTForSequenceClassification(config).eval()
    clf.save_pretrained(tmp_path / "rm")
    transformers.OPTForCausalLM(config).save_pretrained(tmp_path / "lm")
    assert build_value_model(str(tmp_path / "lm")).value_head.weight.shape == (1, 32)
    vm = build_value_model(str(tmp_path / "rm"), require_head=True).eval()
    x = torch.tensor([[2, 5, 6, 7, 9, 11]])
    with torch.no_grad():
        assert torch.allclose(vm(x).values[:, -1], clf(x).logits[:, 0], atol=1e-6)


@pytest.mark.parametrize("key", ["v_head.weight", "v_head.summary.weight"])
def test_value_head_under_other_keys(key, tmp_path):
    lm = build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0)
    lm.save_pretrained(tmp_path)
    head = torch.randn(1, lm.config.hidden_size)
    path = str(tmp_path / "model.safetensors")
    save_file({**load_file(path), key: head}, path, metadata={"format": "pt"})
    vm = build_value_model(str(tmp_path), require_head=True)
    assert torch.equal(vm.value_head.weight, head)


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
def test_value_head_in_pickled_weights(sharded, tmp_path, monkeypatch):
    """A reward model saved as pytorch_model.bin (older TRL and transformers releases, many
    published Llama-2-era reward models), whole or in shards with an index: transformers loads
    its body, and the head was looked for in safetensors files only, so the run refused it as
    having no head. Its head is read now, and it scores what the classifier scores."""
    from oppo_ds.config import Config, ConfigError
    from oppo_ds.sources import Sources, check_paths

    config = tiny_config("tiny-llama", VOCAB)
    config.num_labels = 1
    torch.manual_seed(7)
    clf = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    clf.save_pretrained(tmp_path)  # transformers 5 saves safetensors only: the .bin by hand
    os.remove(tmp_path / "model.safetensors")
    state = clf.state_dict()
    if sharded:  # the head in the last shard, as a save in key order puts it
        names = sorted(state, key=lambda k: k == "score.weight")
        shards = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
                  "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
        for file, keys in shards.items():
            torch.save({k: state[k] for k in keys}, tmp_path / file)
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    else:
        torch.save(state, tmp_path / "pytorch_model.bin")
    opened = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: opened.append(os.path.basename(f))
                        or load(f, *a, **k))
    assert models.has_value_head(str(tmp_path))
    # of shards, only the one the index names for the head is unpickled to find it
    assert opened == ["pytorch_model-00002-of-00002.bin" if sharded else "pytorch_model.bin"]
    monkeypatch.setattr(torch, "load", load)
    vm = build_value_model(str(tmp_path), require_head=True).eval()
    assert torch.equal(vm.value_head.weight, clf.score.weight)
    x = _tokens()
    with torch.no_grad():
        assert torch.allclose(vm(x).values[:, -1], clf(x).logits[:, 0], atol=1e-5)

    sources = Sources(actor="tiny-llama", reference="tiny-llama", reward=str(tmp_path),
                      critic="tiny-llama", tokenizer=None, prompts="p.jsonl",
                      builtin_prompts=False)
    check_paths(Config(), sources)
    last = sorted(tmp_path.glob("*.bin"))[-1]  # the file that holds the head, cut short
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    cut = f"{last} cannot be read: its zip directory, at the end of the file, is missing"
    with pytest.raises(ValueError, match=re.escape(cut)):  # torch's own error names no file
        build_value_model(str(tmp_path), require_head=True)
    with pytest.raises(ConfigError, match=re.escape(f"model.reward: {last} cannot be read")):
        check_paths(Config(), sources)


def test_pickled_heads_in_other_shapes_and_files_that_are_no_weights(tmp_path):
    """A .bin in torch's format before 1.6 (no zip to map) is read; one cut short there stops
    the start naming model.reward. An empty .bin or a git-lfs pointer never pulled is named
    before loading (torch's errors name no file). A head with a bias that is not zero (TRL's
    v_head.summary) is refused, since the head here has none; a zero bias is dropped. A state
    dict nested one level down is named, not reported as having no head."""
    from oppo_ds.config import Config, ConfigError
    from oppo_ds.sources import Sources, check_paths

    lm = build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0)
    head = torch.randn(1, lm.config.hidden_size)

    def checkpoint(name, state, **save):
        lm.config.save_pretrained(tmp_path / name)
        torch.save(state, tmp_path / name / "pytorch_model.bin", **save)
        return str(tmp_path / name)

    body = {f"model.{k}": v for k, v in lm.model.state_dict().items()}
    legacy = checkpoint("legacy", {**body, "v_head.summary.weight": head},
                        _use_new_zipfile_serialization=False)
    assert torch.equal(build_value_model(legacy, require_head=True).value_head.weight, head)
    sources = Sources(actor="tiny-llama", reference="tiny-llama", reward=legacy,
                      critic="tiny-llama", tokenizer=None, prompts="p.jsonl",
                      builtin_prompts=False)
    file = tmp_path / "legacy" / "pytorch_model.bin"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ConfigError, match=re.escape(f"model.reward: {file} cannot be read as a "
                                                    "pickled state dict of tensors")):
        check_paths(Config(), sources)

    for name, content, what in (("empty", b"", "empty"),
                                ("lfs", b"version https://git-lfs.github.com/spec/v1\n",
                                 "a git-lfs pointer")):
        path = checkpoint(name, {})
        (tmp_path / name / "pytorch_model.bin").write_bytes(content)
        assert source_problem(path) == (f"{tmp_path / name / 'pytorch_model.bin'} cannot be read: "
                                        f"the file is {what}: {models.CUT_SHORT}")

    biased = checkpoint("biased", {**body, "v_head.summary.weight": head,
                                   "v_head.summary.bias": torch.tensor([0.25])})
    with pytest.raises(ValueError, match=r"the scalar head v_head.summary.weight has a bias "
                                         r"\(v_head.summary.bias = 0.25\)"):
        build_value_model(biased, require_head=True)
    unbiased = checkpoint("unbiased", {**body, "v_head.summary.weight": head,
                                       "v_head.summary.bias": torch.zeros(1)})
    assert torch.equal(build_value_model(unbiased).value_head.weight, head)
    # the bias in another shard than the weight, as an index may put it
    split = tmp_path / "split"
    lm.config.save_pretrained(split)
    shards = {"a.bin": {**body, "v_head.summary.weight": head},
              "b.bin": {"v_head.summary.bias": torch.tensor([-1.5])}}
    for name, part in shards.items():
        torch.save(part, split / name)
    (split / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, part in shards.items() for k in part}}))
    with pytest.raises(ValueError, match=r"has a bias \(v_head.summary.bias = -1.5\)"):
        models.has_value_head(str(split))
    nested = checkpoint("nested", {"module": {**body, "v_head.weight": head}})
    with pytest.raises(ValueError, match="holds its tensors under 'module', not at the top"):
        models.has_value_head(nested)


def test_loading_a_body_reports_only_weights_it_does_not_expect(tmp_path, capfd, caplog, request):
    """A sequence classifier's or causal LM's head is not a body weight: loading either as a
    reward model or critic printed transformers' load report (a table calling the head "not ok
    if you expect identical arch") at every load. The heads are expected now; any other unused
    weight is named in one line of ours."""
    import logging

    config = tiny_config("tiny-qwen2", VOCAB)
    config.num_labels = 1
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "clf")
    build_causal_lm("tiny-qwen2", vocab_size=VOCAB, seed=0).save_pretrained(tmp_path / "lm")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()  # as a library user has it (oppo-train: error)
    request.addfinalizer(lambda: transformers.logging.set_verbosity(verbosity))
    with caplog.at_level(logging.WARNING, logger="oppo_ds.models"):
        build_value_model(str(tmp_path / "clf"), require_head=True)
        build_value_model(str(tmp_path / "lm"))
    reports = [r for r in caplog.records if "LOAD REPORT" in r.getMessage()]
    assert not reports and "LOAD REPORT" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.name == "oppo_ds.models"]
    caplog.clear()

    path = str(tmp_path / "lm" / "model.safetensors")
    save_file({**load_file(path), "extra.adapter.weight": torch.zeros(2)}, path, metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="oppo_ds.models"):
        build_value_model(str(tmp_path / "lm"))
    assert "LOAD REPORT" not in capfd.readouterr().err
    assert [r.getMessage() for r in caplog.records if r.name == "oppo_ds.models"] == [
        f"{tmp_path / 'lm'}: 1 weights in the checkpoint are not used by Qwen2Model (e.g. extra.adapter.weight)"]


def test_value_head_of_wrong_shape_rejected(tmp_path):
    vm = build_value_model("tiny-llama", vocab_size=VOCAB, seed=0)
    vm.save_pretrained(str(tmp_path))
    save_file({"weight": torch.zeros(2, vm.config.hidden_size)}, str(tmp_path / VALUE_HEAD_FILE))
    with pytest.raises(ValueError, match=r"shape \(2, 64\)"):
        build_value_model(str(tmp_path))


def test_body_under_unknown_prefix_fails_instead_of_random_body(tmp_path):
    """E.g. DeepSpeed-Chat stores the body under `rwtransformer.`: transformers would leave
    every body weight randomly initialised and only log it; a reward model must not score
    with a random body behind a trained head."""
    vm = _random_head(build_value_model("tiny-llama", vocab_size=VOCAB, seed=0))
    vm.save_pretrained(str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    renamed = {f"rwtransformer.{k}": v.contiguous() for k, v in vm.body.state_dict().items()}
    save_file({**renamed, "v_head.weight": vm.value_head.weight.detach()}, path,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not in the checkpoint"):
        build_value_model(str(tmp_path), require_head=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_value_model_kv_cache_matches_full_forward(arch):
    """Streaming scorers prefill the prompt and then feed chunks through the cache."""
    vm = _random_head(build_value_model(arch, vocab_size=VOCAB, seed=0)).eval()
    x = _tokens(batch=2, length=11)
    with torch.no_grad():
        full = vm(x).values
        first = vm(x[:, :4], use_cache=True)
        assert first.past_key_values is not None
        rest = vm(x[:, 4:], past_key_values=first.past_key_values, use_cache=True)
    assert torch.allclose(torch.cat([first.values, rest.values], 1), full, atol=1e-5)
    assert vm(x).past_key_values is None  # no cache unless asked


@pytest.mark.parametrize("arch", ARCHS)
def test_value_model_kv_cache_left_padded_chunks(arch):
    """Left-padded rows, explicit position ids, three chunks: the values on real tokens equal
    those of a full forward."""
    vm = _random_head(build_value_model(arch, vocab_size=VOCAB, seed=0)).eval()
    x = _tokens(batch=3, length=12)
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    mask[2, :2] = 0
    x = x.masked_fill(mask == 0, 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = vm(x, attention_mask=mask, position_ids=pos).values
        cache, parts = None, []
        for lo, hi in [(0, 6), (6, 9), (9, 12)]:
            out = vm(x[:, lo:hi], attention_mask=mask[:, :hi], position_ids=pos[:, lo:hi],
                     past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            parts.append(out.values)
    streamed = torch.cat(parts, 1)
    real = mask.bool()
    assert torch.allclose(streamed[real], full[real], atol=1e-5)


# ---------------------------------------------------------------- local files only

@pytest.mark.parametrize("build", [build_causal_lm, build_value_model])
@pytest.mark.parametrize("source", ["/nonexistent/model", "meta-llama/Meta-Llama-3-8B"])
def test_missing_path_never_downloads(build, source):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        build(source)


@pytest.mark.parametrize("build", [build_causal_lm, build_value_model])
def test_dir_without_config_json(build, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.json"):
        build(str(tmp_path))


def _config_dir(root, name, **config):
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({}, str(path / "model.safetensors"))  # weights: a checkpoint needs a file of them
    return str(path)


SUPPORTED = ("supported: a model type that transformers' AutoModelForCausalLM loads (e.g. "
             "llama, qwen2, mistral, gemma, gpt2, opt)")


def test_a_checkpoint_that_is_no_causal_lm_is_a_config_error_naming_the_key(tmp_path):
    """An unknown model_type (a typo, a newer transformers) or an encoder-decoder (T5) was a
    transformers traceback from the model build; now check_paths, before anything is built,
    names the key, the path and what is supported."""
    from oppo_ds.config import Config, ConfigError
    from oppo_ds.sources import Sources, check_paths

    florp = _config_dir(tmp_path, "florp", model_type="florp", architectures=["LlamaForCausalLM"])
    t5 = _config_dir(tmp_path, "t5", model_type="t5", architectures=["T5ForConditionalGeneration"])
    llama = _config_dir(tmp_path, "llama", model_type="llama")

    def sources(**paths):
        base = dict(actor=llama, reference=llama, reward="tiny-llama", critic=llama)
        return Sources(**{**base, **paths}, tokenizer=None, prompts="p.jsonl",
                       builtin_prompts=False)

    check_paths(Config(), sources())
    with pytest.raises(ConfigError) as err:
        check_paths(Config(), sources(actor=florp))
    assert str(err.value) == (f"model.actor: {florp}: config.json has model_type 'florp', which "
                              f"transformers {transformers.__version__} does not know; "
                              f"{SUPPORTED}")
    with pytest.raises(ConfigError) as err:
        check_paths(Config(), sources(critic=t5))
    assert str(err.value) == (f"model.critic: {t5}: config.json has model_type 't5', not a causal "
                              "language model (every model of a run decodes or scores left to "
                              f"right); {SUPPORTED}")


def test_checkpoint_architecture_checks(tmp_path):
    from oppo_ds.models import source_problem

    own = _config_dir(tmp_path, "own", model_type="florp", auto_map={"AutoModel": "m.Florp"})
    assert source_problem(own).endswith("; it ships code of its own (auto_map): set "
                                        "model.trust_remote_code: true to run it")
    assert source_problem(own, trust_remote_code=True) is None
    # no model_type: transformers goes by the directory's name, as it did
    assert source_problem(_config_dir(tmp_path, "llama-untyped", vocab_size=3)) is None
    bad = _config_dir(tmp_path, "bad", model_type="llama")
    (tmp_path / "bad" / "config.json").write_text("{model_type: llama")
    assert source_problem(bad).startswith(f"{bad}/config.json cannot be read as JSON: ")
    assert source_problem(_config_dir(tmp_path, "list")) is None  # {} : no model_type
    (tmp_path / "list" / "config.json").write_text("[]")
    assert "holds no JSON object" in source_problem(str(tmp_path / "list"))
    assert source_problem("tiny-gpt2") is None


@pytest.mark.parametrize("build", [build_causal_lm, build_value_model])
def test_building_a_non_causal_checkpoint_fails_before_transformers(build, tmp_path):
    t5 = _config_dir(tmp_path, "t5", model_type="t5")
    with pytest.raises(ValueError, match=r"model_type 't5', not a causal language model"):
        build(t5)


def test_trust_remote_code_off_by_default_and_passed_through(tmp_path, monkeypatch):
    from oppo_ds.config import ModelConfig

    assert ModelConfig().trust_remote_code is False
    build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=0).save_pretrained(tmp_path)
    workload.build_tokenizer().save_pretrained(tmp_path)
    # no class named: AutoTokenizer picks one (a generic class is loaded without it)
    tok_config = tmp_path / "tokenizer_config.json"
    tok_config.write_text(json.dumps({k: v for k, v in json.loads(tok_config.read_text()).items()
                                      if k != "tokenizer_class"}))
    seen = []

    def spy(cls, name):
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            seen.append((cls.__name__, kwargs.get("trust_remote_code"), kwargs.get("local_files_only")))
            return original(*args, **kwargs)
        monkeypatch.setattr(cls, name, wrapper)

    spy(transformers.AutoConfig, "from_pretrained")
    spy(transformers.AutoModelForCausalLM, "from_pretrained")
    spy(transformers.AutoModel, "from_pretrained")
    spy(transformers.AutoTokenizer, "from_pretrained")

    build_causal_lm(str(tmp_path))
    build_value_model(str(tmp_path))
    load_tokenizer(str(tmp_path))
    names = {name for name, _, _ in seen}
    assert names == {"AutoConfig", "AutoModelForCausalLM", "AutoModel", "AutoTokenizer"}
    assert all(trust is False and local is True for _, trust, local in seen), seen

    seen.clear()
    build_causal_lm(str(tmp_path), trust_remote_code=True)
    build_value_model(str(tmp_path), trust_remote_code=True)
    load_tokenizer(str(tmp_path), trust_remote_code=True)
    assert {name for name, _, _ in seen} == names
    assert all(trust is True for _, trust, _ in seen), seen


# ---------------------------------------------------------------- tokenizer

def test_load_tokenizer_of_workload(tmp_path):
    workload.build_tokenizer().save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.pad_token_id == workload.PAD_ID and tok.pad_token == "<pad>"
    assert tok.eos_token_id == workload.EOS_ID and tok.bos_token_id == workload.BOS_ID
    assert tok.padding_side == "left"
    batch = tok(["warm a ->", "cool a b c ->"], padding=True)
    assert batch["input_ids"][0][:2] == [workload.PAD_ID] * 2  # padded on the left
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1]
    assert batch["input_ids"][0][-1] == batch["input_ids"][1][-1]  # both end with "->"
    assert batch["input_ids"][0][2] == batch["input_ids"][1][0] == workload.BOS_ID


@pytest.mark.parametrize("arch", ARCHS)
def test_workload_tokenizer_saved_with_each_model_loads_as_saved(arch, tmp_path):
    # beside a Qwen2 config.json, AutoTokenizer loads Qwen2Tokenizer whatever
    # tokenizer_config.json names, and it split "warm a b ->" into letters and lost "->"
    build_causal_lm(arch, vocab_size=VOCAB, seed=0).save_pretrained(tmp_path)
    built = workload.build_tokenizer()
    built.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    text = "warm a b ->"
    ids = tok(text)["input_ids"]
    assert ids == built(text)["input_ids"] == [workload.BOS_ID, *built.convert_tokens_to_ids(text.split())]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert workload.parse_prompt(tok.decode(ids, skip_special_tokens=True).split()) is not None


def test_load_tokenizer_pad_falls_back_to_eos(tmp_path):
    tok = workload.build_tokenizer()
    tok.pad_token = None
    tok.padding_side = "right"
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token_id == workload.EOS_ID
    assert loaded.padding_side == "left"


@pytest.mark.parametrize("files, expected", [
    ({"generation_config.json": {"eos_token_id": [128001, 128009]}, "config.json": {"eos_token_id": 128001}},
     [128001, 128009]),  # Llama-3-Instruct: the end-of-turn token is only in the generation config
    ({"generation_config.json": {"eos_token_id": 7}}, [7]),
    ({"generation_config.json": {"do_sample": True}, "config.json": {"eos_token_id": [5, None]}}, [5]),
    ({"config.json": {"eos_token_id": None}}, []),
    ({}, []),
], ids=["list", "one-id", "falls-back-to-config", "none", "no-files"])
def test_checkpoint_eos_ids(tmp_path, files, expected):
    """The ids HF generate stops at: generation_config.json's eos_token_id, else config.json's."""
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    assert checkpoint_eos_ids(str(tmp_path)) == expected
    assert checkpoint_eos_ids(str(tmp_path / "missing")) == []


def test_load_tokenizer_without_pad_or_eos_pads_with_id_0(tmp_path, caplog):
    """A raw tokenizer saved without special tokens pads with id 0 (masked wherever it pads),
    with a warning; before, the first left_pad failed on a None fill value."""
    import logging

    tok = workload.build_tokenizer()
    tok.pad_token = None
    tok.eos_token = None
    tok.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="oppo_ds.models"):
        loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token_id == 0 and loaded.eos_token_id is None
    assert "has neither a pad nor an EOS token; padding with id 0" in caplog.text


def test_load_tokenizer_missing_dir():
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        load_tokenizer("/nonexistent/tokenizer")


# ---------------------------------------------------------------- dropout

def _train_forwards_equal(model, x):
    model.train()
    with torch.no_grad():
        a, b = model(x).logits, model(x).logits
    return torch.equal(a, b)


def test_disable_dropout_gpt2():
    torch.manual_seed(0)
    lm = build_causal_lm("tiny-gpt2", vocab_size=VOCAB, seed=0)
    dropouts = [m for m in lm.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and all(m.p > 0 for m in dropouts)  # GPT-2 ships with dropout 0.1
    x = _tokens()
    assert not _train_forwards_equal(lm, x)
    assert disable_dropout(lm) is lm
    assert all(m.p == 0.0 for m in lm.modules() if isinstance(m, nn.Dropout))
    assert _train_forwards_equal(lm, x)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2"])
def test_disable_dropout_attention_float(arch):
    """Llama and Qwen2 keep attention dropout as a float attribute, not an nn.Dropout."""
    config = tiny_config(arch, VOCAB)
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(config)
    x = _tokens()
    assert not _train_forwards_equal(lm, x)
    disable_dropout(lm)
    assert _train_forwards_equal(lm, x)


def test_disable_dropout_value_model():
    vm = _random_head(build_value_model("tiny-gpt2", vocab_size=VOCAB, seed=0))
    disable_dropout(vm).train()
    x = _tokens()
    with torch.no_grad():
        assert torch.equal(vm(x).values, vm(x).values)


# ---------------------------------------------------------------- one tokenizer for every model

def _bpe_tokenizer(size: int):
    """A byte-level BPE tokenizer (another family than the built-in word-level one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    texts = [" ".join(workload.MOODS + workload.LETTERS)] * 10
    core.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")


def test_tokenizer_mismatch(tmp_path):
    """A model must read the actor's token ids as they are: an embedding too small for the
    tokenizer, or a saved tokenizer that gives tokens other ids, is an error; tokens that only
    one side has are a warning; a directory with weights only is compared by size alone."""
    from oppo_ds.models import tokenizer_mismatch

    actor_tok = workload.build_tokenizer()
    n = len(actor_tok)

    def saved(name, vocab_size, tokenizer=None):
        path = tmp_path / name
        build_value_model("tiny-llama", vocab_size=vocab_size, seed=0).save_pretrained(str(path))
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        return str(path)

    assert tokenizer_mismatch(saved("same", n, workload.build_tokenizer()), actor_tok) == (None, None)
    assert tokenizer_mismatch(saved("weights-only", n + 8), actor_tok) == (None, None)
    assert tokenizer_mismatch(str(tmp_path / "no-such-dir"), actor_tok) == (None, None)

    error, warning = tokenizer_mismatch(saved("small", n - 1), actor_tok)
    assert error == (f"its embedding holds {n - 1} token ids, the actor's tokenizer has {n}: it "
                     "was trained with another tokenizer") and warning is None

    bpe = _bpe_tokenizer(300)
    error, warning = tokenizer_mismatch(saved("other", len(bpe), bpe), actor_tok)
    assert error.startswith("its tokenizer is not the actor's: ") and "have other ids, e.g. " in error
    assert warning is None

    extended = workload.build_tokenizer()
    extended.add_special_tokens({"additional_special_tokens": ["<sep>"]})
    error, warning = tokenizer_mismatch(saved("extended", n + 1, extended), actor_tok)
    assert error is None
    assert warning == "1 token(s) are in only one of its tokenizer and the actor's, e.g. '<sep>' (in its)"


def test_position_limit(tmp_path):
    """How many positions a model source has, and whether more is an error: a learned table
    (GPT-2's n_positions, OPT's max_position_embeddings) is; a rotary model's length is not."""
    from transformers import OPTConfig

    from oppo_ds.models import position_limit

    assert position_limit("tiny-gpt2", VOCAB) == (512, "n_positions", True)
    assert position_limit("tiny-llama", VOCAB) == (512, "max_position_embeddings", False)
    assert position_limit("qwen2.5-1.5b") == (32768, "max_position_embeddings", False)
    build_causal_lm("tiny-qwen2", vocab_size=VOCAB, seed=0).save_pretrained(tmp_path / "qwen2")
    assert position_limit(str(tmp_path / "qwen2")) == (512, "max_position_embeddings", False)
    OPTConfig(max_position_embeddings=128).save_pretrained(tmp_path / "opt")
    assert position_limit(str(tmp_path / "opt")) == (128, "max_position_embeddings", True)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text('{"model_type": "mystery"}')
    assert position_limit(str(tmp_path / "bare")) is None
    assert position_limit(str(tmp_path / "missing")) is None
