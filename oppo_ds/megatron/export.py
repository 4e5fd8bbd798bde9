"""Hugging Face weights from a Megatron-engine checkpoint: ``python -m oppo_ds.megatron.export``.

A run on the Megatron backend saves, per trained model and checkpoint tag, one shard file per
(tensor, pipeline) rank, ``<output_dir>/checkpoints/<actor|critic>/<tag>/mp_rank_TT_PPP.pt``,
and the HF ``config.json`` of the model beside them. This reads the weights of every shard
(memory-mapped: the optimizer state in the same files is not read), joins them with
``convert.megatron_to_hf`` and writes an HF checkpoint (safetensors) that
``AutoModelForCausalLM`` (actor) or ``oppo_ds.models.ValueHeadModel`` (critic) loads. The end
of a run does the same from memory when ``checkpoint.export_hf`` is on; this is for a
checkpoint taken earlier, or a run that exported nothing.

    python -m oppo_ds.megatron.export runs/megatron-70b/checkpoints/actor/step100 out/actor-step100

Host memory: the whole model once, in the checkpoint's dtype (the HF model takes its tensors in
place).
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch

SHARD = re.compile(r"mp_rank_(\d{2})_(\d{3})\.pt")
CONFIG = "config.json"


def shard_files(tag_dir: str) -> list[list[str]]:
    """The shard paths of a checkpoint tag, ``[pp_rank][tp_rank]``; ``FileNotFoundError``
    naming what is missing."""
    if not os.path.isdir(tag_dir):
        raise FileNotFoundError(f"{tag_dir}: no such checkpoint directory")
    found = {}
    for name in os.listdir(tag_dir):
        if m := SHARD.fullmatch(name):
            found[int(m.group(2)), int(m.group(1))] = os.path.join(tag_dir, name)
    if not found:
        raise FileNotFoundError(f"{tag_dir}: no Megatron shard files (mp_rank_TT_PPP.pt)")
    pp, tp = max(p for p, _ in found) + 1, max(t for _, t in found) + 1
    missing = [f"mp_rank_{t:02d}_{p:03d}.pt" for p in range(pp) for t in range(tp)
               if (p, t) not in found]
    if missing:
        raise FileNotFoundError(f"{tag_dir}: shards missing for tensor x pipeline = {tp} x {pp}: "
                                f"{', '.join(missing)}")
    return [[found[p, t] for t in range(tp)] for p in range(pp)]


def read_checkpoint(tag_dir: str) -> tuple[object, str, dict[str, torch.Tensor]]:
    """(HF config, kind "lm" or "value", HF state dict) of a Megatron checkpoint tag."""
    from transformers import AutoConfig

    from .convert import shape_of
    from .model import megatron_names, state_to_hf

    paths = shard_files(tag_dir)
    if not os.path.isfile(os.path.join(tag_dir, CONFIG)):
        raise FileNotFoundError(f"{tag_dir}: no {CONFIG} (the HF config the engine saves with "
                                f"its shards)")
    config = AutoConfig.from_pretrained(tag_dir)
    shards = []
    for row in paths:
        shards.append([])
        for path in row:
            saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
            shards[-1].append(megatron_names(saved["model"]))
    kind = "value" if "value_head.weight" in shards[-1][0] else "lm"
    return config, kind, state_to_hf(shards, shape_of(config), kind)


def export(tag_dir: str, out_dir: str) -> str:
    """Write the HF checkpoint of a Megatron checkpoint tag to ``out_dir``; returns its kind."""
    from .convert import shape_of
    from .model import hf_model

    config, kind, state = read_checkpoint(tag_dir)
    hf_model(config, state, kind, shape_of(config).tied).save_pretrained(out_dir)
    return kind


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m oppo_ds.megatron.export",
        description="Hugging Face weights from a Megatron-engine checkpoint tag "
                    "(<output_dir>/checkpoints/<actor|critic>/<tag>).")
    parser.add_argument("checkpoint", help="the tag directory holding mp_rank_TT_PPP.pt files")
    parser.add_argument("out", help="directory to write the HF checkpoint to")
    args = parser.parse_args(argv)
    try:
        kind = export(args.checkpoint, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.out}: {'causal LM' if kind == 'lm' else 'value model (a sequence classifier with one label)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
