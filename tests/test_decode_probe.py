"""The decode probe (python -m oppo_ds.decode_probe): it runs on a CPU, with the tiny and a
real shape's architecture, and reports every piece of a decode step. Its figures are timings
of this machine, checked for being measured at all (positive, finite), never for a speed."""
from __future__ import annotations

import json
import math
import os
import tempfile

import pytest
import torch

from oppo_ds import decode_probe

PIECES = {"forward", "forward + sync", "decode (cpu generator)", "decode (device generator)",
          "decode (in blocks)", "decode, left-padded", "decode, left-padded, new shapes",
          "decode, new shapes, no cuDNN attention", "decode, rows ending",
          "decode, static cache, rows ending", "sync", "launch", "d2h item", "h2d copy",
          "h2d pinned"}  # and on a GPU the CUDA-graph piece (decode_probe.GRAPH_PIECE)


def test_probe_reports_every_piece_of_a_decode_step(tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert decode_probe.main(["--arch", "tiny-qwen2", "--batch", "4", "--tokens", "6",
                              "--prompt-len", "5", "--dtype", "fp32", "--device", "cpu",
                              "--repeat", "2", "--sync-every", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["arch"], report["batch"], report["tokens"], report["device"],
            report["sync_every"]) == ("tiny-qwen2", 4, 6, "cpu", 4)
    assert set(report["ms_per_token"]) == PIECES and report["errors"] == {}
    assert all(math.isfinite(v) and v > 0 for v in report["ms_per_token"].values())
    shown = capsys.readouterr().out
    assert "tiny-qwen2 fp32 on cpu: batch 4" in shown and "blocks of 4 tokens" in shown
    assert all(piece in shown for piece in PIECES)


def test_a_failed_piece_is_reported_beside_the_others():
    """The GPU-only CUDA-graph piece, if its capture fails, is reported with its error after
    the other pieces' figures, which are kept."""
    report = {"arch": "a", "dtype": "bf16", "device": "d", "batch": 2, "prompt_len": 3,
              "tokens": 4, "repeat": 1, "sync_every": 2, "ms_per_token": {"forward": 1.0},
              "errors": {decode_probe.GRAPH_PIECE: "RuntimeError: capture failed"}}
    lines = decode_probe.format_report(report).splitlines()
    assert lines[1].split()[:2] == ["forward", "1.000"]
    assert lines[-1].strip() == f"{decode_probe.GRAPH_PIECE}  failed: RuntimeError: capture failed"


def test_probe_times_the_trainers_own_decode(tmp_path, capsys):
    """--trainer builds a PPOTrainer from the overrides and times its decode: its actor on the
    probe's prompts, its generate on its own prompts (split into a cost per token and a fixed
    cost per call), its first generate after a PPO step; beside the probe's pieces, leaving no
    run directory behind."""
    out = tmp_path / "probe.json"
    before = set(os.listdir(tempfile.gettempdir()))
    assert decode_probe.main(["--arch", "tiny-qwen2", "--batch", "4", "--tokens", "5",
                              "--prompt-len", "5", "--dtype", "fp32", "--device", "cpu",
                              "--repeat", "1", "--json", str(out), "--trainer",
                              "workload.kind=length_oracle", "model.builtin_arch=tiny-qwen2",
                              "ppo.mini_batch_size=4", "ppo.micro_batch_size=4"]) == 0
    report = json.loads(out.read_text())
    assert report["trainer_overrides"][0] == "workload.kind=length_oracle"
    figures = report["ms_per_token"]
    assert set(figures) == PIECES | set(decode_probe.TRAINER_PIECES) | {decode_probe.TRAINER_FIXED}
    # the split into a cost per token and a fixed cost is a difference of two timings (5 tokens
    # against 1, one run each here): finite, of either sign on a noisy machine (a fresh-clone
    # CI measured -0.375 ms per token and 17.7 ms fixed: the 1-token call took the longer)
    derived = {"trainer generate, per token", decode_probe.TRAINER_FIXED}
    assert all(math.isfinite(v) for v in figures.values())
    assert all(v > 0 for k, v in figures.items() if k not in derived)
    # the split adds up: 5 tokens = the fixed cost + 5 times the cost per token
    per_token, fixed = figures["trainer generate, per token"], figures[decode_probe.TRAINER_FIXED]
    assert figures["trainer generate"] * 5 == pytest.approx(fixed + 5 * per_token, rel=1e-9)
    shown = capsys.readouterr().out
    assert all(piece in shown for piece in decode_probe.TRAINER_PIECES)
    left = {n for n in set(os.listdir(tempfile.gettempdir())) - before
            if n.startswith("oppo-probe-")}
    assert not left


def test_probe_decodes_every_row_to_the_end():
    """No end id ends a row early: the decode pieces time the same number of tokens as the
    bare forward loop (a random model samples every id, an end id among them)."""
    from oppo_ds.models import build_causal_lm
    from oppo_ds.rollout.generate import SamplingParams, decode_steps, start_decode

    model = build_causal_lm("tiny-llama", vocab_size=decode_probe.TINY_VOCAB, seed=0).eval()
    params = SamplingParams(max_new_tokens=7, eos_token_ids=(), pad_token_id=0, temperature=1.0,
                            top_k=0, top_p=1.0)
    prompt = torch.randint(3, 500, (3, 4))
    state = start_decode(model, prompt, torch.ones_like(prompt), params)
    assert decode_steps(model, state, params, torch.Generator().manual_seed(0)) == 3 * 7
    assert state.lengths.tolist() == [7, 7, 7]


@pytest.mark.parametrize("bad", [["--tokens", "1"], ["--batch", "0"], ["--repeat", "0"],
                                 ["--sync-every", "1"]])
def test_probe_refuses_sizes_it_cannot_time(bad, capsys):
    with pytest.raises(SystemExit) as err:
        decode_probe.main(["--arch", "tiny-qwen2", "--device", "cpu", *bad])
    assert err.value.code == 2 and "--tokens and --sync-every must be >= 2" in capsys.readouterr().err


def test_probe_refuses_a_wrong_trainer_key_before_it_starts(capsys):
    """A wrong --trainer override is named at once, before the probe's own pieces run."""
    with pytest.raises(SystemExit) as err:
        decode_probe.main(["--arch", "tiny-qwen2", "--device", "cpu", "--trainer",
                           "workload.kind=length_oracle", "ppo.batchsize=4"])
    shown = capsys.readouterr()
    assert err.value.code == 2 and "--trainer: ppo.batchsize: unknown key" in shown.err
    assert "forward" not in shown.out


def test_new_shape_batches_never_repeat_a_size_while_there_is_room():
    """The new-shape pieces decode at batch sizes the probe has not used: below --batch,
    each piece's sizes after the last piece's, and never below 1."""
    first = decode_probe.new_shape_batches(32, 3)
    second = decode_probe.new_shape_batches(32, 3, skip=4)
    third = decode_probe.new_shape_batches(32, 3, skip=8)
    assert first == [31, 30, 29, 28] and second == [27, 26, 25, 24] and third[0] == 23
    assert len(set(first + second + third)) == 12
    assert decode_probe.new_shape_batches(3, 3) == [2, 1, 1, 1]


def test_left_padded_prompts_are_the_trainers_kind():
    """Prompts of random lengths in [width / 4, width], padded on the left with id 0."""
    gen = torch.Generator().manual_seed(0)
    ids, mask = decode_probe._left_padded(100, 64, 12, gen, torch.device("cpu"))
    lengths = mask.sum(1)
    assert ids.shape == mask.shape == (64, 12)
    assert int(lengths.min()) >= 3 and int(lengths.max()) <= 12 and len(set(lengths.tolist())) > 3
    for row, n in zip(range(64), lengths.tolist()):
        assert mask[row].tolist() == [0] * (12 - n) + [1] * n
        assert (ids[row, : 12 - n] == 0).all() and (ids[row, 12 - n:] >= 3).all()


def test_attention_without_cudnn_samples_the_same_tokens():
    """The no-cuDNN context (the probe's piece, and the default of system.cudnn_attention)
    changes only which attention kernel runs: on this CPU the tokens, log-probs and generator
    state are those of the default; inside it torch's cuDNN switch is off, after it back."""
    from oppo_ds.models import build_causal_lm
    from oppo_ds.rollout.generate import (SamplingParams, cudnn_attention, decode_steps,
                                          start_decode)

    model = build_causal_lm("tiny-qwen2", vocab_size=decode_probe.TINY_VOCAB, seed=0).eval()
    params = SamplingParams(max_new_tokens=6, eos_token_ids=(), pad_token_id=0, temperature=1.0,
                            top_k=0, top_p=1.0)
    ids, mask = decode_probe._left_padded(decode_probe.TINY_VOCAB, 3, 7,
                                          torch.Generator().manual_seed(1), torch.device("cpu"))
    runs = []
    assert torch.backends.cuda.cudnn_sdp_enabled()
    for enabled in (True, False):
        gen = torch.Generator().manual_seed(0)
        with cudnn_attention(enabled), torch.no_grad():
            assert torch.backends.cuda.cudnn_sdp_enabled() is enabled
            state = start_decode(model, ids, mask, params)
            decode_steps(model, state, params, gen)
        runs.append((state.tokens, state.logprobs, gen.get_state()))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][2], runs[1][2])
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=1e-6)
