"""PPO-ptx (``data.ptx``, ``ppo.ptx_coef``): pretraining text cut into blocks, their
language-modelling loss against Hugging Face's own, in the actor's update independent of the
micro-batch split, resumed exactly, learned from, and DeepSpeed-Chat's flags for it."""
from __future__ import annotations

import json

import pytest
import torch

from oppo_ds import workload as wl
from oppo_ds.config import ConfigError, load_config
from oppo_ds.datafiles import DataError, PromptRow
from oppo_ds.ptx import lm_loss, ptx_blocks
from oppo_ds.telemetry import read_history
from test_trainer import run

TEXTS = ["warm a b c d e f g h i j k l m n o p q r s t u v w x calm a a a a b b b b",
         "bold x x x w w w v v v u u u t t t s s s r r r q q q p p p o o o n n n",
         "cool a c e g i k m o q s u w b d f h j l n p r t v x a c e g i k m o q s"]


def _rows(texts):
    return [PromptRow(t, "ptx.jsonl", i + 1, f"ptx.jsonl:{i + 1}") for i, t in enumerate(texts)]


def test_blocks_are_the_concatenated_texts_cut_evenly():
    tok = wl.build_tokenizer()
    ids = [i for t in TEXTS for i in tok(t)["input_ids"]]  # <bos> in front of each text
    blocks = ptx_blocks(_rows(TEXTS), tok, 16, "ptx.jsonl")
    assert [b.input_ids for b in blocks] == [ids[i:i + 16] for i in range(0, len(ids) // 16 * 16, 16)]
    assert len(ids) % 16 and all(len(b.input_ids) == 16 for b in blocks)  # the remainder dropped
    with pytest.raises(DataError, match="fewer than one block of data.ptx_block_len = 4096"):
        ptx_blocks(_rows(TEXTS), tok, 4096, "ptx.jsonl")
    chat = [PromptRow([{"role": "user", "content": "hi"}], "c.jsonl", 3, "c.jsonl:3")]
    with pytest.raises(DataError, match="c.jsonl:3: pretraining text must be a string"):
        ptx_blocks(chat, tok, 4, "c.jsonl")


def test_blank_pretraining_rows_are_skipped_and_counted(tmp_path, caplog):
    """wikitext's row 0 is "": a blank pretraining text stopped the run ("'text' is empty or
    whitespace only"), where DeepSpeed-Chat tokenises it without complaint. The trainer's
    reading of data.ptx skips such rows and counts them in one log line; a blank prompt is
    still an error."""
    from types import SimpleNamespace

    from oppo_ds.trainer import PPOTrainer

    path = tmp_path / "wikitext.jsonl"
    texts = ["", TEXTS[0], " \n", TEXTS[1], "\t", TEXTS[2]]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = load_config(None, [f"data.ptx={path}", "ppo.ptx_coef=1", "data.ptx_block_len=16"])
    tok = wl.build_tokenizer()
    trainer = SimpleNamespace(cfg=cfg, tokenizer=tok, world_size=1, is_main=True)
    with caplog.at_level("INFO", logger="oppo_ds.datafiles"):
        blocks = PPOTrainer._load_ptx(trainer)
    assert [b.input_ids for b in blocks] == \
        [b.input_ids for b in ptx_blocks(_rows(TEXTS), tok, 16, str(path))]
    assert f"{path}: 3 rows skipped, their 'text' (data.ptx_key) empty or whitespace only" \
        in caplog.text
    from oppo_ds.datafiles import read_prompt_rows

    with pytest.raises(DataError, match=rf"{path}:1: 'text' is empty or whitespace only"):
        read_prompt_rows(str(path), prompt_key="text")


def test_lm_loss_is_hugging_faces_own():
    from oppo_ds.models import build_causal_lm

    model = build_causal_lm("tiny-llama", vocab_size=40, seed=3).eval()
    ids = torch.randint(5, 40, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids).loss  # HF shifts the labels itself
        summed, mean = lm_loss(model, ids, normalizer=2.0)
    torch.testing.assert_close(mean, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(summed, want * 3 * 11 / 2.0, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("overrides, key", [
    (["ppo.ptx_coef=1"], "ppo.ptx_coef"),
    (["data.ptx=t.jsonl"], "data.ptx"),
    (["data.ptx=[]", "ppo.ptx_coef=1"], "data.ptx"),
    (["data.ptx=t.jsonl", "ppo.ptx_coef=-1"], "ppo.ptx_coef"),
    (["data.ptx_block_len=1"], "data.ptx_block_len"),
])
def test_config_refusals(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key


@pytest.fixture(scope="module")
def ptx_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ptx") / "ptx.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 4))
    return str(path)


PTX = ("checkpoint.export_hf=false", "ppo.ptx_coef=0.5", "data.ptx_block_len=16")


def _metrics(out):
    return {r["step"]: r for r in read_history(str(out / "metrics.jsonl"))}


def test_the_micro_batch_split_changes_nothing(cache_dir, ptx_file, tmp_path):
    """Micro-batches of 4 or of 2 sequences (and of pretraining blocks beside them), or sized
    by tokens (ppo.micro_batch_tokens=100, each sequence counting its 16-token block too, so
    1 to 3 sequences and as many blocks a micro-batch): the same updates (1e-5: float sums in
    another order), loss/ptx the mean over the blocks whatever their split."""
    run(cache_dir, tmp_path / "m4", "steps=3", *PTX, f"data.ptx={ptx_file}")
    run(cache_dir, tmp_path / "m2", "steps=3", *PTX, f"data.ptx={ptx_file}", "ppo.micro_batch_size=2")
    run(cache_dir, tmp_path / "t100", "steps=3", *PTX, f"data.ptx={ptx_file}",
        "ppo.micro_batch_tokens=100")
    a = _metrics(tmp_path / "m4")
    for other in ("m2", "t100"):
        b = _metrics(tmp_path / other)
        for step in (1, 2, 3):
            for key in ("loss/ptx", "loss/policy", "reward/mean", "kl/mean", "grad_norm/actor"):
                assert b[step][key] == pytest.approx(a[step][key], abs=1e-5), (other, step, key)
    counts = [r["train/micro_batches"] for r in _metrics(tmp_path / "t100").values()]
    assert max(counts) > 1 and any(c != int(c) for c in counts), counts  # uneven splits
    assert 0 < a[1]["loss/ptx"] < 5  # a per-token mean NLL over a 33-token vocabulary


def test_a_frozen_actor_takes_no_block_into_the_split(cache_dir, ptx_file, tmp_path):
    """Under ppo.freeze_actor_steps the actor neither trains nor takes pretraining blocks, so
    ppo.micro_batch_tokens splits by the critic's rows alone: the counts of the run without
    PPO-ptx, and the same critic (each row counted its 16-token block as well, making more
    micro-batches than the critic needed)."""
    frozen = ("steps=3", "ppo.micro_batch_tokens=100", "ppo.freeze_actor_steps=2")
    run(cache_dir, tmp_path / "ptx", *frozen, *PTX, f"data.ptx={ptx_file}")
    run(cache_dir, tmp_path / "plain", *frozen, PTX[0])
    a, b = _metrics(tmp_path / "ptx"), _metrics(tmp_path / "plain")
    for step in (1, 2):
        assert a[step]["train/micro_batches"] == b[step]["train/micro_batches"], step
        assert a[step]["loss/value"] == pytest.approx(b[step]["loss/value"], abs=1e-6), step
    assert max(a[s]["train/micro_batches"] for s in (1, 2)) > 1
    # step 3: the actor trains, its blocks count, and the same rows need more micro-batches
    assert a[3]["train/micro_batches"] > b[3]["train/micro_batches"]


def _text_loss(trainer) -> float:
    """The actor's mean NLL per token over every pretraining block."""
    ids = torch.tensor([b.input_ids for b in trainer.ptx_blocks])
    with trainer.actor.generation_context() as model:
        return lm_loss(model, ids, 1.0)[1].item()


def test_ptx_is_learned_from_and_resumes_exactly(cache_dir, ptx_file, tmp_path):
    """After 4 steps with weight 20 the actor models the pretraining text better than after
    the same 4 steps with a negligible weight (measured: 3.35 against 3.46 nats per token);
    killed after the step-2 checkpoint and resumed, the run gives the uninterrupted one's
    later steps (1e-6), the blocks' position included."""
    common = ("steps=4", "checkpoint.export_hf=false", "data.ptx_block_len=16",
              f"data.ptx={ptx_file}", "checkpoint.every=2")
    strong = (*common, "ppo.ptx_coef=20")
    trainer, _ = run(cache_dir, tmp_path / "full", *strong)
    weak, _ = run(cache_dir, tmp_path / "weak", *common, "ppo.ptx_coef=1e-6")
    assert _text_loss(trainer) < _text_loss(weak) - 0.05
    full = _metrics(tmp_path / "full")
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(cache_dir, tmp_path / "cut", *strong, crash_after=2)
    trainer, _ = run(cache_dir, tmp_path / "cut", *strong)
    cut = _metrics(tmp_path / "cut")
    for step in (3, 4):
        for key in ("loss/ptx", "loss/policy", "loss/value", "reward/mean"):
            assert cut[step][key] == pytest.approx(full[step][key], abs=1e-6), (step, key)
    # 4 steps x 8 sequences: 32 blocks taken
    assert trainer.ptx_stream.prompts_seen == 32


def test_resume_with_other_blocks_is_refused(cache_dir, ptx_file, tmp_path):
    run(cache_dir, tmp_path / "r", "steps=1", *PTX, f"data.ptx={ptx_file}")
    with pytest.raises(ConfigError) as err:
        run(cache_dir, tmp_path / "r", "steps=2", "checkpoint.export_hf=false", "ppo.ptx_coef=0.5",
            "data.ptx_block_len=8", f"data.ptx={ptx_file}")
    assert err.value.key == "data.ptx" and "pretraining text of other blocks" in str(err.value)


def test_two_ranks_each_take_their_blocks(tmp_path, ptx_file):
    """Over two gloo ranks under ZeRO-2 the pretraining loss joins each rank's update; each
    rank's checkpoint holds its own position in its shard of the blocks."""
    from test_distributed import launch

    launch(tmp_path / "run", tmp_path / "cache", "steps=2", "system.zero_stage=2",
           "ppo.ptx_coef=0.5", "data.ptx_block_len=16", f"data.ptx={ptx_file}")
    rows = read_history(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2] and all(0 < r["loss/ptx"] < 5 for r in rows)
    states = [torch.load(tmp_path / "run" / "checkpoints" / "trainer" / "step2" / f"rank{r}.pt",
                         weights_only=False)["ptx_stream"] for r in (0, 1)]
    assert [s["position"] for s in states] == [8, 8]  # 2 steps x batch 4, each its own shard
    assert all(s["world_size"] == 2 for s in states)


def test_dschat_unsupervised_flags(tmp_path, ptx_file):
    from oppo_ds.cli.train import build_parser, resolve_config

    def resolve(argv):
        return resolve_config(build_parser().parse_args(argv), prepare_files=False)

    cfg, notes = resolve(["--unsupervised_dataset_name", ptx_file,
                          "--unsupervised_dataset_config_name", "wikitext-2-raw-v1"])
    assert cfg.data.ptx == ptx_file and cfg.ppo.ptx_coef == 27.8  # DeepSpeed-Chat's default
    cfg, _ = resolve(["--unsupervised_dataset_name", ptx_file, "--unsupervised_dataset_config_name",
                      "x", "--unsup_coef", "0.5"])
    assert cfg.ppo.ptx_coef == 0.5
    # DeepSpeed-Chat trains on it only with both names given
    cfg, notes = resolve(["--unsupervised_dataset_name", ptx_file, "--unsup_coef", "0.5"])
    assert cfg.data.ptx is None and cfg.ppo.ptx_coef == 0.0
    assert any("without --unsupervised_dataset_config_name" in n for n in notes)
    with pytest.raises(ConfigError, match="not a local file or directory"):
        resolve(["--unsupervised_dataset_name", str(tmp_path / "wikitext"),
                 "--unsupervised_dataset_config_name", "x"])
    # a hub snapshot with a folder per configuration: the one named is read
    snapshot = tmp_path / "Salesforce--wikitext"
    for name in ("wikitext-2-raw-v1", "wikitext-103-raw-v1"):
        (snapshot / name).mkdir(parents=True)
        (snapshot / name / "train-00000-of-00001.jsonl").write_text('{"text": "a b"}\n')
    cfg, _ = resolve(["--unsupervised_dataset_name", str(snapshot),
                      "--unsupervised_dataset_config_name", "wikitext-2-raw-v1"])
    assert cfg.data.ptx == str(snapshot / "wikitext-2-raw-v1")
