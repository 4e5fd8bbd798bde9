"""The configuration reference, docs/config.md, generated from the dataclasses of
:mod:`oppo_ds.config`: every key's type, default and the docstring written under its field.

    python -m oppo_ds.config_docs > docs/config.md

``tests/test_config.py`` fails when the page and the dataclasses disagree.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

from .config import Config
from .config_paths import PATH_KEYS
from .config_types import describe_type


def field_docs(cls) -> dict[str, str]:
    """Docstrings written under each field of a dataclass (read from its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) \
                and isinstance(getattr(nxt, "value", None), ast.Constant) \
                and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def iter_keys(cls=Config, prefix: str = ""):
    """(dotted key, type description, default, doc) for every leaf key."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from iter_keys(tp, key + ".")
        else:
            yield key, describe_type(tp), getattr(default, f.name), docs.get(f.name, "")


def _class_doc(cls) -> str:
    """A section's own docstring, or "" for the one dataclasses generate (``Name(...)``)."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(doc.split())


def config_markdown() -> str:
    """The body of docs/config.md, generated from the dataclasses."""
    lines = ["# Configuration reference", "",
             "Generated from `oppo_ds/config.py` (`ppo`: `oppo_ds/config_ppo.py`, `system`:",
             "`oppo_ds/config_system.py`) by",
             "`python -m oppo_ds.config_docs`;",
             "a test fails when this page and the dataclasses disagree.", "",
             "Set keys in a YAML file (`oppo-train --config FILE`) or on the command line",
             "(`oppo-train ppo.kl_coef=0.05`). An unknown key or a bad value stops with exit",
             "code 2 and a message naming the key and what it allows.", "",
             "A key naming a file or folder (" + ", ".join(
                 f"`{section}.{name}`" for section, names in PATH_KEYS.items() for name in names)
             + ") reads a leading `~` as the home folder; an empty path is refused (null asks "
               "for an optional key's default).", ""]
    section = None
    for key, tp, default, doc in iter_keys():
        head = key.split(".")[0] if "." in key else None
        if head != section or not lines[-1].startswith("|"):
            section = head
            if lines[-1]:
                lines.append("")
            lines += [f"## `{head}`" if head else "## Top level", ""]
            cls_doc = _class_doc(typing.get_type_hints(Config)[head]) if head else ""
            if cls_doc:
                lines += [cls_doc, ""]
            lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        shown = "null" if default is None else (str(default).lower() if isinstance(default, bool) else default)
        lines.append(f"| `{key}` | {tp} | `{shown}` | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:]:
        sys.exit("usage: python -m oppo_ds.config_docs > docs/config.md")
    sys.stdout.write(config_markdown())
