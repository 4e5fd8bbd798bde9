"""The config keys that name files or folders, and the rules they share: a leading `~` is the
home folder, as a shell would have read it (`model.actor: ~/ckpt`), and an empty string, which
an unset shell variable leaves (`model.tokenizer=$TOK`), is refused rather than taken as the
default. ``local_paths`` applies both once, when a ``Config`` is built."""
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
