"""Reading a rank's Megatron shard straight from safetensors files (``megatron/loading.py``).

Tier 0: for tiny Llama and Qwen2 checkpoints (causal LM, tied embeddings, value models saved
by oppo-ds, an HF sequence classifier), single-file and sharded, the shards read lazily equal
the shards converted from the whole HF model exactly at (tp, pp) = (1,1), (2,1), (1,2), (2,2),
reading only row/column blocks of split tensors; no HF model is instantiated; missing tensors
and heads are refused naming the key and the file.
Tier 1: ``build_megatron_models`` at tp=2 over gloo gives the models the HF path gave.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from test_megatron import VOCAB, _spawn

import megatron.core  # noqa: F401  the test extra installs it: missing is a failure, not a skip

from oppo_ds.megatron.convert import hf_prefix, hf_to_megatron, shape_of  # noqa: E402
from oppo_ds.megatron.loading import (CheckpointError, SafetensorsReader,  # noqa: E402
                                      is_safetensors_checkpoint, open_checkpoint)
from oppo_ds.models import (VALUE_HEAD_FILE, build_causal_lm, build_value_model,  # noqa: E402
                            tiny_config)

SPLITS = [(1, 1), (2, 1), (1, 2), (2, 2)]
SHARD = "20KB"  # a tiny model in ~14 files, with model.safetensors.index.json


def _value_model(arch: str, seed: int):
    model = build_value_model(arch, vocab_size=VOCAB, seed=seed)
    torch.manual_seed(seed + 100)
    torch.nn.init.normal_(model.value_head.weight)  # a real head, not the zero one
    return model


def _save_value(model, path: str, sharded: bool) -> None:
    if not sharded:
        model.save_pretrained(path)  # what oppo-ds exports: an HF sequence classifier
        return
    # the base model in shards plus value_head.safetensors: what oppo-ds exported before
    # 2026-11-25 and still does for an architecture without a sequence classifier
    model.body.save_pretrained(path, max_shard_size=SHARD)
    save_file({"weight": model.value_head.weight.detach().contiguous()},
              os.path.join(path, VALUE_HEAD_FILE))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, kind) of every checkpoint the tests read."""
    from transformers import AutoModelForCausalLM, LlamaForSequenceClassification

    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for arch in ("tiny-llama", "tiny-qwen2"):
        lm = build_causal_lm(arch, vocab_size=VOCAB, seed=0)
        value = _value_model(arch, seed=1)
        for layout in ("single", "sharded"):
            path = str(root / f"{arch}-lm-{layout}")
            lm.save_pretrained(path, **({"max_shard_size": SHARD} if layout == "sharded" else {}))
            out[f"{arch}-lm-{layout}"] = (path, "lm")
            path = str(root / f"{arch}-value-{layout}")
            _save_value(value, path, layout == "sharded")
            out[f"{arch}-value-{layout}"] = (path, "value")
    config = tiny_config("tiny-qwen2", VOCAB)
    config.tie_word_embeddings = True  # no lm_head.weight in the file
    torch.manual_seed(2)
    path = str(root / "qwen2-tied")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    out["qwen2-tied"] = (path, "lm")
    config = tiny_config("tiny-llama", VOCAB)
    config.num_labels = 1
    torch.manual_seed(3)
    path = str(root / "llama-seqcls")
    LlamaForSequenceClassification(config).save_pretrained(path, max_shard_size=SHARD)
    out["llama-seqcls"] = (path, "value")
    assert os.path.isfile(os.path.join(out["tiny-llama-lm-sharded"][0],
                                       "model.safetensors.index.json"))
    return out


class _Recording:
    """A reader that notes which tensors were read whole."""

    def __init__(self, reader: SafetensorsReader):
        self.reader, self.whole = reader, []
        self.rows, self.cols, self.dims = reader.rows, reader.cols, reader.dims

    def __call__(self, name: str) -> torch.Tensor:
        self.whole.append(name)
        return self.reader(name)


def _hf_state(path: str, kind: str) -> dict:
    """The HF path: the whole model built, as the DeepSpeed backend builds it."""
    if kind == "lm":
        return build_causal_lm(path, dtype="fp32").state_dict()
    return {k.removeprefix("body."): v for k, v in build_value_model(path).state_dict().items()}


def _shards(get, shape, kind: str, prefix: str, tp: int, pp: int) -> list[list[dict]]:
    heads = dict(lm_head=kind == "lm", value_head=kind == "value")
    return [[hf_to_megatron(get, shape, tp=tp, tp_rank=t, pp=pp, pp_rank=p, prefix=prefix,
                            **heads) for t in range(tp)] for p in range(pp)]


def _assert_equal_shards(got, want) -> None:
    for p, (got_stage, want_stage) in enumerate(zip(got, want)):
        for t, (g, w) in enumerate(zip(got_stage, want_stage)):
            assert set(g) == set(w), (p, t)
            bad = [k for k in w if not torch.equal(g[k], w[k])]
            assert not bad, (p, t, bad[:3])


@pytest.mark.parametrize("name", ["tiny-llama-lm-single", "tiny-llama-lm-sharded",
                                  "tiny-qwen2-lm-single", "tiny-qwen2-lm-sharded", "qwen2-tied",
                                  "tiny-llama-value-single", "tiny-llama-value-sharded",
                                  "tiny-qwen2-value-single", "tiny-qwen2-value-sharded",
                                  "llama-seqcls"])
def test_lazy_shards_equal_shards_of_the_whole_model(checkpoints, name):
    path, kind = checkpoints[name]
    assert is_safetensors_checkpoint(path)
    state = _hf_state(path, kind)
    config, reader, prefix = open_checkpoint(path, kind, require_head=kind == "value")
    shape = shape_of(config)
    assert prefix == ("" if name.endswith("value-sharded") else "model.")
    for tp, pp in SPLITS:
        recording = _Recording(reader)
        got = _shards(recording, shape, kind, prefix, tp, pp)
        # the HF path's value model is a base model: its keys have no "model."
        _assert_equal_shards(got, _shards(state.__getitem__, shape, kind, hf_prefix(state),
                                          tp, pp))
        # split tensors are read as blocks; only the norms and the value head whole
        assert recording.whole and all(n.endswith("norm.weight") or n == "value_head.weight"
                                       for n in recording.whole), recording.whole
    if kind == "value":  # the head really is the checkpoint's, not a fresh zero one
        assert reader("value_head.weight").abs().sum() > 0
    reader.close()


def test_no_hf_model_is_built(checkpoints, tmp_path, monkeypatch):
    """A config naming an architecture class transformers does not have, Llama's shape
    fields, and every HF model constructor broken: only a loader that never builds the HF
    model reads it, and it gives the same shards."""
    import transformers

    src, _ = checkpoints["tiny-llama-lm-sharded"]
    want_state = build_causal_lm(src).state_dict()
    path = str(tmp_path / "odd")
    shutil.copytree(src, path)
    config_file = os.path.join(path, "config.json")
    config = json.load(open(config_file))
    config["architectures"] = ["NoSuchLlamaForCausalLM"]
    json.dump(config, open(config_file, "w"))

    def no_models(*args, **kwargs):
        raise AssertionError("an HF model was instantiated")

    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", no_models)
    with pytest.raises(AssertionError, match="instantiated"):  # the patch does bite
        build_causal_lm(path)
    config, reader, prefix = open_checkpoint(path, "lm")
    with reader:
        shape = shape_of(config)
        for tp, pp in SPLITS:
            _assert_equal_shards(_shards(reader, shape, "lm", prefix, tp, pp),
                                 _shards(want_state.__getitem__, shape, "lm", prefix, tp, pp))


def test_missing_tensor_names_the_key_and_the_file(checkpoints, tmp_path):
    src, _ = checkpoints["tiny-llama-lm-single"]
    state = build_causal_lm(src).state_dict()
    shape = shape_of(tiny_config("tiny-llama", VOCAB))
    gone = "model.layers.1.mlp.up_proj.weight"
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(os.path.join(src, "config.json"), single)
    save_file({k: v.contiguous() for k, v in state.items() if k != gone},
              str(single / "model.safetensors"))
    _, reader, prefix = open_checkpoint(str(single), "lm")
    with pytest.raises(CheckpointError, match=rf"{gone}.*model\.safetensors"):
        hf_to_megatron(reader, shape, prefix=prefix)

    # sharded: the index sends a key to a file that does not hold it, or to no file at all
    sharded = str(tmp_path / "sharded")
    shutil.copytree(checkpoints["tiny-llama-lm-sharded"][0], sharded)
    index_file = os.path.join(sharded, "model.safetensors.index.json")
    index = json.load(open(index_file))
    files = sorted(set(index["weight_map"].values()))
    wrong = next(f for f in files if f != index["weight_map"][gone])
    index["weight_map"][gone] = wrong
    json.dump(index, open(index_file, "w"))
    _, reader, prefix = open_checkpoint(sharded, "lm")
    with pytest.raises(CheckpointError, match=rf"{wrong}: no tensor '{gone}'"):
        hf_to_megatron(reader, shape, prefix=prefix)
    # a config.json whose vocabulary is not the file's: refused, not silently sliced
    config = json.load(open(os.path.join(sharded, "config.json")))
    config["vocab_size"] = VOCAB - 1
    json.dump(config, open(os.path.join(sharded, "config.json"), "w"))
    config, reader, prefix = open_checkpoint(sharded, "lm")
    with pytest.raises(CheckpointError, match=rf"embed_tokens.weight has {VOCAB} rows, "
                                              rf"config.json implies {VOCAB - 1}"):
        hf_to_megatron(reader, shape_of(config), tp=2, prefix=prefix)
    os.remove(os.path.join(sharded, files[0]))
    name = next(k for k, f in index["weight_map"].items() if f == files[0])
    with pytest.raises(CheckpointError, match=rf"{files[0]}: file missing.*{name}"):
        SafetensorsReader(sharded)(name)


def _fp8_checkpoint(src: str, path, scale: float) -> dict:
    """``src`` saved as an FP8 checkpoint (DeepSeek-V3's and Qwen3-FP8's layout): each linear
    weight in float8_e4m3fn with its block scale ``weight_scale_inv`` beside it, and a
    quantization_config. Returns the tensors written."""
    shutil.copytree(src, path)
    state = {}
    for name, tensor in build_causal_lm(src).state_dict().items():
        if name.endswith("_proj.weight"):
            state[name] = (tensor / scale).to(torch.float8_e4m3fn)
            state[name.removesuffix("weight") + "weight_scale_inv"] = torch.full((1, 1), scale)
        else:
            state[name] = tensor.contiguous()
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    return state


def test_quantized_checkpoints_are_refused_not_cast(checkpoints, tmp_path):
    """An FP8 checkpoint's weights mean something only times their scales: the conversion
    cast them to bf16 without (garbage logits, no error). Its quantization_config is refused
    before any build, naming the model key and config.json; a tensor stored as FP8 or int8
    without one is refused naming the tensor and its file; so is one reaching the conversion
    from an HF model. The DeepSpeed backend's path, transformers' own FP8 quantizer, takes the
    checkpoint: on a CPU it dequantizes with the scales (on a GPU it keeps FP8 linears:
    not run here)."""
    from oppo_ds.config import Config, ConfigError, load_config
    from oppo_ds.sources import Sources, check_paths

    path = str(tmp_path / "fp8")
    scale = 2.0
    state = _fp8_checkpoint(checkpoints["tiny-llama-lm-single"][0], path, scale)
    sources = Sources(actor=path, reference=path, reward="tiny-llama", critic="tiny-llama",
                      tokenizer=None, prompts="p.jsonl", builtin_prompts=False)
    with pytest.raises(ConfigError, match=re.escape(
            f"{path}/config.json has a quantization_config (quant_method fp8)")) as err:
        check_paths(load_config(None, ["system.backend=megatron"]), sources)
    assert err.value.key == "model.actor"
    with pytest.raises(CheckpointError, match="quantization_config .*dequantize"):
        open_checkpoint(path, "lm")
    check_paths(Config(), sources)  # the DeepSpeed backend
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(build_causal_lm(path).state_dict()[q], state[q].float() * scale)

    # FP8 or int8 tensors without a quantization_config: named with their file, not cast
    config = json.load(open(os.path.join(path, "config.json")))
    del config["quantization_config"]
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    shape = shape_of(tiny_config("tiny-llama", VOCAB))
    _, reader, prefix = open_checkpoint(path, "lm")
    with pytest.raises(CheckpointError, match=re.escape(
            f"{path}/model.safetensors: tensor '{q}' is stored as F8_E4M3")):
        hf_to_megatron(reader, shape, tp=2, prefix=prefix)
    with pytest.raises(CheckpointError, match="linear_qkv.weight would be made of "
                                              "torch.float8_e4m3fn weights"):
        hf_to_megatron(state.__getitem__, shape, prefix=prefix)  # an HF model's tensors
    norm = "model.layers.0.input_layernorm.weight"
    state[norm] = torch.zeros(state[norm].shape, dtype=torch.int8)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"'{norm}' is stored as I8; system.backend "
                                              "megatron converts F32, BF16, F16 weights only"):
        SafetensorsReader(path)(norm)


def test_a_stale_index_beside_a_whole_weights_file_is_ignored_as_transformers_does(checkpoints,
                                                                                    tmp_path):
    """transformers reads model.safetensors when it is there and ignores an index beside it
    (left from an earlier sharded save, its shards gone); the Megatron reader read the index
    and failed on the missing shards. The start's check (``source_problem``) passes the
    directory, so both backends must load it."""
    from oppo_ds.models import source_problem

    src, _ = checkpoints["tiny-llama-lm-single"]
    index = json.load(open(os.path.join(checkpoints["tiny-llama-lm-sharded"][0],
                                        "model.safetensors.index.json")))
    mixed = tmp_path / "mixed"
    shutil.copytree(src, mixed)
    json.dump(index, open(mixed / "model.safetensors.index.json", "w"))  # its shards: absent
    assert source_problem(str(mixed)) is None
    shape = shape_of(tiny_config("tiny-llama", VOCAB))
    shards = []
    for path in (str(mixed), src):
        _, reader, prefix = open_checkpoint(path, "lm")
        shards.append(hf_to_megatron(reader, shape, prefix=prefix))
        reader.close()
    got, want = shards
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_value_head_rules_match_the_hf_path(checkpoints):
    """A causal LM checkpoint as critic: a zero head, as ``build_value_model`` gives; as
    reward (a head required): refused by both paths."""
    path, _ = checkpoints["tiny-qwen2-lm-single"]
    _, reader, prefix = open_checkpoint(path, "value")
    assert prefix == "model."
    assert torch.equal(reader("value_head.weight"), build_value_model(path).value_head.weight)
    assert not reader("value_head.weight").any()
    with pytest.raises(ValueError, match="no value head found"):
        build_value_model(path, require_head=True)
    with pytest.raises(CheckpointError, match="no value head found"):
        open_checkpoint(path, "value", require_head=True)


# ------------------------------------------------------------------------------ tier 1

def _build_worker(rank, world, out, sources: dict, bin_dir: str):
    """The four models from ``build_megatron_models`` (safetensors read lazily; the reference
    from a .bin checkpoint takes the whole-model path) against the HF path's models."""
    from _builders import left_padded_prompts

    from oppo_ds.config import load_config
    from oppo_ds.engines.megatron_engine import build_megatron_models
    from oppo_ds.megatron.model import build_model
    from oppo_ds.megatron.parallel import init_model_parallel
    from oppo_ds.rollout.generate import position_ids_from_mask

    cfg = load_config(None, ["system.backend=megatron", f"system.tensor_parallel={world}",
                             "checkpoint.export_hf=false"])
    src = SimpleNamespace(**sources, reference=bin_dir)
    common = dict(vocab_size=VOCAB, dtype="fp32", trust_remote_code=False, seed=0)
    engine_args = dict(total_steps=1, weight_decay=0.0, warmup_steps=0, scheduler="constant",
                       gradient_accumulation_steps=1, grad_clip=1.0)
    models = build_megatron_models(cfg, src, common, engine_args)
    groups = init_model_parallel(world, 1)
    cpu = torch.device("cpu")
    ids, mask = left_padded_prompts([7, 4, 6], VOCAB, 0, seed=5)
    call = dict(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
    report = {}
    with torch.no_grad():
        for role, kind, model, hf in (
                ("actor", "lm", models.actor.module, build_causal_lm(src.actor)),
                ("reference", "lm", models.reference, build_causal_lm(src.reference)),
                ("critic", "value", models.critic.module, build_value_model(src.critic)),
                ("reward", "value", models.reward, build_value_model(src.reward))):
            field = "logits" if kind == "lm" else "values"
            before = build_model(hf, groups, kind, dtype=torch.float32, device=cpu)
            got, want = getattr(model(**call), field), getattr(before(**call), field)
            report[role] = (bool(torch.equal(got, want)), float(got.std()))
    out.put(("report", rank, report))


def test_build_megatron_models_from_checkpoints_equals_hf_path(checkpoints, tmp_path,
                                                                torch_one_thread):
    # a .bin checkpoint: not safetensors, so built whole (the fallback path)
    bin_dir = str(tmp_path / "bin")
    model = build_causal_lm("tiny-llama", vocab_size=VOCAB, seed=4)
    model.config.save_pretrained(bin_dir)
    torch.save(model.state_dict(), os.path.join(bin_dir, "pytorch_model.bin"))
    assert not is_safetensors_checkpoint(bin_dir)
    sources = dict(actor=checkpoints["tiny-llama-lm-sharded"][0],
                   critic=checkpoints["tiny-llama-value-single"][0],
                   reward=checkpoints["tiny-llama-value-sharded"][0])
    reports = [m for m in _spawn(_build_worker, 2, sources, bin_dir) if m[0] == "report"]
    assert len(reports) == 2
    for _, rank, report in reports:
        assert set(report) == {"actor", "reference", "critic", "reward"}
        for role, (equal, spread) in report.items():
            assert equal and spread > 0, (rank, role, report)
