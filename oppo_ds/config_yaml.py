"""What a config's text holds before it is checked against the dataclasses
(``oppo_ds.config``): a YAML file read into its mapping of sections, a key given twice in one
mapping refused (PyYAML keeps the last silently) and a syntax error said as file:line:column;
and the dotted command-line overrides (``ppo.kl_coef=0.05``) set into that mapping."""
from __future__ import annotations

import logging
from typing import Any

import yaml

from .config_types import ConfigError

logger = logging.getLogger(__name__)


def set_dotted(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(dotted, f"{part} is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``ppo.kl_coef=0.05`` -> ("ppo.kl_coef", 0.05); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(text, "overrides take the form key.sub=value")
    key, raw = text.split("=", 1)
    if not all(part.strip() for part in key.split(".")):  # `=5`, `ppo.=5`, `ppo..kl_coef=1`
        raise ConfigError("", f"malformed override {text!r}: expected KEY=VALUE with a dotted "
                              "key, e.g. ppo.kl_coef=0.05")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


_MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *anchor`


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping (two `ppo:`
    sections, `steps:` twice), which PyYAML resolves by keeping the last, is a
    ``ConfigError`` naming the dotted key, the file and both lines. A key beside a merge
    (`<<: *anchor`) still replaces the merged one."""

    def __init__(self, stream, path: str):
        super().__init__(stream)
        self.path = path

    def construct_document(self, node):
        self._check_unique(node, "", set())
        return super().construct_document(node)

    def _check_unique(self, node, prefix: str, seen: set) -> None:
        if id(node) in seen:  # an alias: its node was checked where its anchor is
            return
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_unique(item, f"{prefix}[{i}]", seen)
        if not isinstance(node, yaml.MappingNode):
            return
        first_line: dict = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                continue
            key = f"{prefix}.{key_node.value}" if prefix else key_node.value
            line, name = key_node.start_mark.line + 1, (key_node.tag, key_node.value)
            if name in first_line:
                raise ConfigError(key, f"given twice in {self.path} (lines {first_line[name]} and "
                                       f"{line}); the later one would silently replace the "
                                       "earlier: keep one")
            first_line[name] = line
            self._check_unique(value_node, key, seen)


def _yaml_error(path: str, err: yaml.YAMLError) -> str:
    """PyYAML's error as one line, ``file:line:column: problem``: its own message starts with
    the context ("while scanning for the next token") and puts the position lines below."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or getattr(err, "context", None)
    if mark is None or problem is None:
        return f"{path} is not valid YAML: {str(err).splitlines()[0]}"
    text = f"{path}:{mark.line + 1}:{mark.column + 1}: {problem}"
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and problem != context and start is not None and start is not mark:
        text += f" ({context} started at {start.line + 1}:{start.column + 1})"
    return text


def read_config_file(path: str) -> dict:
    """The mapping of sections a YAML config file holds, as written (nothing converted or
    checked against the keys yet): ``ConfigError`` (key ``--config``) for a file that cannot
    be read or parsed, naming file, line and column."""
    try:
        with open(path, encoding="utf-8") as f:
            loader = _ConfigLoader(f, path)
            try:
                data = loader.get_single_data()
            finally:
                loader.dispose()
    except FileNotFoundError:
        raise ConfigError("--config", f"no such file: {path}") from None
    except OSError as err:  # a directory, no permission: still one line, not a traceback
        raise ConfigError("--config", f"cannot read {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError("--config", f"{path} is not UTF-8 text (byte "
                                      f"0x{err.object[err.start]:02x} at offset {err.start}); "
                                      "save it as UTF-8") from None
    except yaml.YAMLError as err:
        raise ConfigError("--config", _yaml_error(path, err)) from None
    if data is None:  # empty, or only comments
        logger.warning("--config %s sets no key (empty or only comments): every key has its "
                       "default", path)
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("--config", f"{path} must hold a mapping of sections")
    return data
