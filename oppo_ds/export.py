"""The run's final models in Hugging Face format, DeepSpeed-Chat's layout (a mixin of
``PPOTrainer``): ``output_dir/actor`` (a causal LM whose generation config ends responses
where training did), ``output_dir/critic`` (a sequence classifier naming its pad id) and, with
``model.actor_ema``, ``output_dir/actor_ema``. LoRA is folded into the weights; Megatron's
shards are collected by every rank and written by rank 0.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Optional

import torch.distributed as dist

from .config_paths import EXPORT_FOLDERS
from .durable import fsync_dir, fsync_tree
from .lora import has_lora, merged_state_dict

logger = logging.getLogger("oppo_ds.trainer")

EXPORTS = set(EXPORT_FOLDERS)  # the folders of a run's final export


def write_end_ids(path: str, ids: tuple[int, ...]) -> None:
    """Set the ids this run's responses ended at as ``eos_token_id`` of the generation config
    saved in ``path``, so that ``generate`` (or a server reading it) ends the exported actor's
    responses where training ended them: the tokenizer's EOS, which the run also ends at, is
    not always in a checkpoint's generation config, and ``generation.eos_token_ids`` may set
    others. The config's other fields stay as the checkpoint had them."""
    from transformers import AutoConfig, GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(path)
    except OSError:  # the model wrote none
        config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
    config.eos_token_id = ids[0] if len(ids) == 1 else list(ids)
    config._from_model_config = False  # its own: no generate may rebuild it from config.json
    config.save_pretrained(path)


def write_pad_id(path: str, pad_id: Optional[int]) -> None:
    """Name the tokenizer's pad id in the config saved in ``path`` when the checkpoint left it
    out (Llama 3's): HF's sequence classifier finds each row's last token by it and refuses a
    batch of more than one row without it."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if config.get("pad_token_id") is None and pad_id is not None:
        config["pad_token_id"] = int(pad_id)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)


class Exporting:
    """``export`` of ``PPOTrainer``."""

    def export(self, out_dir: str) -> None:
        """Final actor (and critic, where there is one; the actor's average with
        model.actor_ema) in Hugging Face format, DeepSpeed-Chat's layout. Each is written to
        a temporary folder that then replaces its own: none holds files of an earlier run's
        export in the same directory (its chat template, say), and an export slot this run
        does not fill (``critic`` after a critic-free run) is removed, not left beside it."""
        engines = tuple(self.trained_engines.items())
        self._export_models(out_dir, engines)
        if self.ema is not None:
            with self.ema.swapped_in(self.actor.module):
                self._export_models(out_dir, (("actor_ema", self.actor),))
        written = {name for name, _ in engines} | ({"actor_ema"} if self.ema is not None else set())
        for stale in EXPORTS - written:
            if self.is_main and os.path.isdir(os.path.join(out_dir, stale)):
                logger.info("removed %s: an earlier run's export (this run has no %s)",
                            os.path.join(out_dir, stale), stale)
                shutil.rmtree(os.path.join(out_dir, stale))
        if dist.is_initialized():
            dist.barrier()

    def _export_models(self, out_dir: str, named_engines) -> None:
        for name, engine in named_engines:
            final = os.path.join(out_dir, name)
            with engine.generation_context() as model:
                # Megatron shards: every rank sends its part, and each replica's gathering rank
                # writes, into the folder itself (cleared first, before any rank writes);
                # otherwise rank 0 writes a temporary folder that then replaces it
                collective = getattr(model, "collective_save", False)
                path = final if collective else os.path.join(out_dir, f".{name}.tmp")
                if self.is_main:  # an earlier export, or one a crash mid-export left
                    shutil.rmtree(path, ignore_errors=True)
                if collective:
                    if dist.is_initialized():
                        dist.barrier()
                    model.save_pretrained(path)
                elif self.is_main:
                    # LoRA folded into the weights: a plain checkpoint of the base architecture
                    state = merged_state_dict(model) if has_lora(model) else None
                    model.save_pretrained(path, state_dict=state)
                if self.is_main:
                    self.tokenizer.save_pretrained(path)
                if self.is_main and name != "critic" and self.sampling.eos_token_ids:
                    write_end_ids(path, self.sampling.eos_token_ids)
                if self.is_main and name == "critic":
                    write_pad_id(path, self.tokenizer.pad_token_id)
            if collective or self.is_main:  # on disk before it replaces an earlier export
                fsync_tree(path)
            if self.is_main and path != final:
                shutil.rmtree(final, ignore_errors=True)
                os.replace(path, final)
                fsync_dir(out_dir)
