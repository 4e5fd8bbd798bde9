"""Typed dataclasses from plain mappings (YAML, dotted overrides): the conversion rules of
``oppo_ds.config``. A value is checked against its field's annotation (bool, int, float, str,
None, Literal, list, Optional/Union, nested dataclasses); anything else raises ``ConfigError``
naming the dotted key and what it allows, and an unknown key names the keys that exist. No
key takes a non-finite number (YAML's .inf, .nan)."""
from __future__ import annotations

import dataclasses
import decimal
import difflib
import logging
import math
import re
import typing
from typing import Any, Literal, Union

logger = logging.getLogger("oppo_ds.config")

class ConfigError(ValueError):
    """A bad key or value; ``str()`` is the one-line message shown to the user."""

    def __init__(self, key: str, detail: str):
        self.key, self.detail = key, detail
        super().__init__(f"{key}: {detail}" if key else detail)

    def under(self, section: str) -> "ConfigError":
        """The same error for a key inside ``section``."""
        return ConfigError(f"{section}.{self.key}" if self.key else section, self.detail)


def require(cond: bool, key: str, message: str) -> None:
    """``ConfigError(key, message)`` unless ``cond``."""
    if not cond:
        raise ConfigError(key, message)


def describe_type(tp) -> str:
    """A type annotation in words, as error messages and docs/config.md give it."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) if isinstance(a, str) else str(a)
                                     for a in typing.get_args(tp))
    if origin is Union:
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is list:
        item = typing.get_args(tp)[0]
        plural = {int: "integers", float: "numbers", str: "strings", bool: "true/false values"}
        return f"a list of {plural[item]}" if item in plural else f"a list, each {describe_type(item)}"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string",
            dict: "a mapping"}.get(tp, str(tp))


# PyYAML follows YAML 1.1, where a float needs a dot: `1e-5` loads as the string "1e-5".
_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class _NotFinite(ConfigError):
    """A number key given inf or nan (raised by ``_convert``, whose Union arms tell it from a
    value of the wrong type)."""


def _not_finite(key: str, value: Any, tp) -> _NotFinite:
    return _NotFinite(key, f"got {value!r}, expected {describe_type(tp)} (finite: not inf or nan)")


def _convert(key: str, value: Any, tp) -> Any:
    origin = typing.get_origin(tp)
    if origin is Union:
        not_finite = False
        for arg in typing.get_args(tp):
            try:
                return _convert(key, value, arg)
            except _NotFinite:
                not_finite = True
            except ConfigError:
                continue
        if not_finite:
            raise _not_finite(key, value, tp)
        raise ConfigError(key, f"got {value!r}, expected {describe_type(tp)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"got {value!r}, expected {describe_type(tp)}")
        return [_convert(key, item, typing.get_args(tp)[0]) for item in value]
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(allowed):
            # YAML 1.1 reads an unquoted on / off (and yes / no) as true / false
            value = "on" if value else "off"
        if value in allowed and type(value) in {type(a) for a in allowed}:
            return value
        raise ConfigError(key, f"got {value!r}, allowed: {describe_type(tp)}")
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
                isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip())):
            try:
                number = float(value)
            except OverflowError:  # an integer too large for a float
                number = math.inf
            if not math.isfinite(number):  # .inf, .nan, 1e999
                raise _not_finite(key, value, tp)
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return _numbers_read(value)
    raise ConfigError(key, f"got {value!r}, expected {describe_type(tp)}")


# what YAML 1.1 leaves a string though it is a number: an exponent without a dot before it
# or without a sign in it (`5e7`, `1e-5`, `1.0e5`)
_EXPONENT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _numbers_read(value: Any) -> Any:
    """``value`` (a free-form mapping, e.g. a DeepSpeed section) with the numbers YAML 1.1
    leaves as strings (``_EXPONENT_TEXT``) read as numbers, exactly: an int where whole
    (`5e7`), else a float. Other strings stay text (`"2024"` quoted is a name)."""
    if isinstance(value, dict):
        return {k: _numbers_read(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers_read(v) for v in value]
    if isinstance(value, str) and _EXPONENT_TEXT.fullmatch(value.strip()):
        number = decimal.Decimal(value.strip())
        return int(number) if number == number.to_integral_value() else float(number)
    return value


def _key_homes(cls, key: str, prefix: str = "") -> list[str]:
    """Every dotted key named ``key`` in the tree of dataclass ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    homes = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            homes += _key_homes(hints[f.name], key, path)
        elif f.name == key:
            homes.append(path)
    return homes


def _unknown_key_hint(root, key: str, names: list[str]) -> str:
    """What an unknown ``key`` may have meant: the sections anywhere under dataclass ``root``
    that hold a key of that name (`kl_coef` at the top or `ppo.max_new_tokens`:
    generation.max_new_tokens), else a close name among the section's ``names``."""
    homes = _key_homes(root, key)
    if homes:
        return f"; did you mean {' or '.join(homes)}?"
    close = difflib.get_close_matches(key, names, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def build_dataclass(cls, data: dict, prefix: str, root=None):
    """An instance of dataclass ``cls`` from ``data`` (nested mappings for nested dataclasses),
    every value converted to its field's annotation; ``prefix``: the dotted key of ``data``.
    A section given null (`model:` with every key under it commented out) is an empty one, as
    an empty file is: a warning, not an error. ``root``: the top dataclass (default ``cls``),
    where an unknown key's hint looks for a key of its name."""
    root = cls if root is None else root
    if data is None and prefix:
        logger.warning("%s: the section is empty (null, or only comments): every key in it has "
                       "its default", prefix)
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            hint = _unknown_key_hint(root, str(key), names)
            raise ConfigError(path, f"unknown key; allowed keys{' in ' + prefix if prefix else ''}: "
                                    f"{', '.join(names)}{hint}")
        tp = hints[key]
        kwargs[key] = (build_dataclass(tp, value, path, root) if dataclasses.is_dataclass(tp)
                       else _convert(path, value, tp))
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(prefix) if prefix else err
