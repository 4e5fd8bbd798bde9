"""The config keys that name files or folders, and the rules they share: a leading `~` is the
home folder, as a shell would have read it (`model.actor: ~/ckpt`), and an empty string, which
an unset shell variable leaves (`model.tokenizer=$TOK`), is refused rather than taken as the
default. ``local_paths`` applies both once, when a ``Config`` is built. And
``check_export_targets``: no model source inside the final export's folders."""
from __future__ import annotations

import dataclasses
import os

from .config_types import ConfigError

# section -> its keys holding a path (or a list of paths); model.reward_function's
# `path/to/file.py:function` starts with its path
PATH_KEYS = {
    "model": ("actor", "reference", "reward", "critic", "tokenizer", "reward_function"),
    "data": ("prompts", "ptx"),
    "eval": ("prompts",),
    "logging": ("output_dir",),
    "workload": ("cache_dir",),
}


def _default_hint(section, name: str) -> str:
    default = {f.name: f.default for f in dataclasses.fields(section)}[name]
    if default is None:
        return "null for the default"
    return f"leave the key out for its default, {default!r}"


def local_paths(cfg) -> None:
    """Expand `~` in every key of ``PATH_KEYS`` of ``cfg``, in place; ``ConfigError`` naming
    the key for an empty path (what an unset shell variable gives)."""
    for section_name, names in PATH_KEYS.items():
        section = getattr(cfg, section_name)
        for name in names:
            value, key = getattr(section, name), f"{section_name}.{name}"
            if value is None:
                continue
            paths = [value] if isinstance(value, str) else value
            if not all(p.strip() for p in paths):
                empty = "an empty path" if isinstance(value, str) else f"an empty path in {value!r}"
                raise ConfigError(key, f"{empty} (an unset shell variable?): give a path, or "
                                       f"{_default_hint(section, name)}")
            expanded = [os.path.expanduser(p) for p in paths]
            setattr(section, name, expanded[0] if isinstance(value, str) else expanded)


EXPORT_FOLDERS = ("actor", "critic", "actor_ema")  # the final export's (oppo_ds.export)
MODEL_SOURCE_KEYS = ("actor", "reference", "reward", "critic", "tokenizer")


def _within(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def check_export_targets(cfg) -> None:
    """``ConfigError`` where the final Hugging Face export (``checkpoint.export_hf``) would
    delete a model source: each of output_dir/actor, /critic and /actor_ema is removed and
    written again (or removed where the run has no such model), so a source folder equal to
    one of them or inside one is lost at the end of the run. Only folders that exist count
    (a model name such as `builtin` or `tiny-llama` is none). ``PPOTrainer`` checks it before
    it builds anything, not for ``--evaluate``, which exports nothing (it may evaluate such an
    export)."""
    if not cfg.checkpoint.export_hf:
        return
    out = os.path.realpath(cfg.logging.output_dir)
    for key in MODEL_SOURCE_KEYS:
        source = getattr(cfg.model, key)
        if source is None or not os.path.isdir(source):
            continue
        real = os.path.realpath(source)
        for name in EXPORT_FOLDERS:
            target = os.path.join(out, name)
            if _within(real, target):
                raise ConfigError("logging.output_dir", (
                    f"the final export (checkpoint.export_hf) replaces {target}, which holds "
                    f"model.{key} ({source}): the run would delete its own source; choose "
                    f"another logging.output_dir, or set checkpoint.export_hf: false"))
