"""A typed YAML schema from dataclasses, for any tree of sections: values from YAML and from
``key.path=value`` overrides typed by the field annotations (so ``optim.lr=3e-4`` is a float
even though YAML 1.1 reads it as a string), unknown keys refused with a did-you-mean, choices
and minimums from ``opt(...)`` metadata, ``bundled:REL`` values resolved to the file shipped
inside mdtk. Nothing here knows the trainer's sections (``schema``).

A key that is a Python keyword (``checkpoint.async``) is a field with a trailing underscore
(``async_``), as PEP 8 names them; YAML, overrides, messages and ``as_dict`` use the key."""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from toolkit import bundled
from toolkit.errors import ConfigError


def opt(default: Any = None, *, choices: Sequence[Any] | None = None, minimum: float | None = None,
        factory: Any = None) -> Any:
    """A schema field with its default and what values it allows (checked on load)."""
    meta = {"choices": tuple(choices) if choices else None, "min": minimum}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


NULLS = ("null", "~", "None")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def key_of(f: dataclasses.Field) -> str:
    """The YAML key of a schema field: its name, less the underscore a keyword needs."""
    stem = f.name[:-1]
    return stem if f.name.endswith("_") and keyword.iskeyword(stem) else f.name


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of a section by YAML key."""
    return {key_of(f): f for f in dataclasses.fields(cls)}


def as_dict(section: Any) -> dict[str, Any]:
    """A section tree as plain YAML keys and values (tuples become lists)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        out[key_of(f)] = as_dict(value) if dataclasses.is_dataclass(value) else plain(value)
    return out


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` (from YAML or from a command-line string) to the schema type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value in NULLS):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{key}={value!r}: expected {_type_name(tp)}")
    if value is None:
        raise ConfigError(f"{key} must not be null: give a {_type_name(tp)}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off"):
            return value.lower() in ("true", "yes", "on")
        raise ConfigError(f"{key}={value!r}: expected true or false.")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected an integer, not a boolean.")
        if isinstance(value, int):
            return value
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected an integer.") from None
        if not number.is_integer():
            raise ConfigError(f"{key}={value!r}: expected an integer.")
        return int(number)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected a number, not a boolean.")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected a number (e.g. 3e-4).") from None
        if not math.isfinite(number):
            raise ConfigError(f"{key}={value!r}: expected a finite number (e.g. 3e-4).")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}={value!r}: expected a single string.")
        return str(value)
    if origin is list:
        items = value if isinstance(value, (list, tuple)) else [value]
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(items)]
    if origin is dict:  # a free-form mapping (e.g. a reward function's entry): checked by its
        if not isinstance(value, dict):  # section's check
            raise ConfigError(f"{key}={value!r}: expected a mapping, e.g. {{function: ...}}.")
        return dict(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}={value!r}: expected a list of {len(args)} values, "
                              f"e.g. [0.9, 0.95].")
        pairs = enumerate(zip(value, args, strict=True))
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in pairs)
    raise TypeError(f"schema type {tp!r} of {key} is not handled")  # a bug in this module


def _check_field(value: Any, f: dataclasses.Field, key: str) -> None:
    choices, minimum = f.metadata.get("choices"), f.metadata.get("min")
    if choices and value not in choices:
        allowed = ", ".join(str(c) for c in choices)
        raise ConfigError(f"{key}={value!r} is not allowed: choose one of {allowed}.")
    if minimum is not None and value is not None and value < minimum:
        raise ConfigError(f"{key}={value!r} must be >= {minimum}.")


def _unknown(key: str, known: Sequence[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key.split(".")[-1], known, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown key '{key}' in {where}.{hint} Known keys: {', '.join(known)}.")


def build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"'{prefix or 'the config'}' must be a mapping of keys, got {raw!r}.")
    fields, hints = _fields(cls), _hints(cls)
    where = f"section '{prefix}'" if prefix else "the top level"
    values = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise _unknown(key, list(fields), where)
        f = fields[name]
        tp = hints[f.name]
        if _is_section(tp):
            values[f.name] = build(tp, value, key)
        else:
            values[f.name] = _coerce(value, tp, key)
            _check_field(values[f.name], f, key)
    return cls(**values)


def resolve_bundled(section: Any, prefix: str = "") -> None:
    """Replace each ``bundled:REL`` value (one string, or one item of a list) in place by the
    path of that file shipped inside mdtk, so the configs in the package work from any folder."""
    for f in dataclasses.fields(section):
        key = f"{prefix}.{key_of(f)}" if prefix else key_of(f)
        value = getattr(section, f.name)
        try:
            if dataclasses.is_dataclass(value):
                resolve_bundled(value, key)
            elif isinstance(value, str):
                setattr(section, f.name, bundled.resolve(value))
            elif isinstance(value, list):
                setattr(section, f.name, [bundled.resolve(v) if isinstance(v, str) else v
                                          for v in value])
        except FileNotFoundError as e:
            raise ConfigError(f"{key}: {e}") from None


def parse_override(root: type, text: str) -> tuple[list[str], Any]:
    """``"optim.lr=3e-4"`` -> (["optim", "lr"], value typed by the schema ``root``)."""
    import yaml

    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value (e.g. train.steps=10).")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    cls: Any = root
    for depth, name in enumerate(path):
        fields = _fields(cls)
        sub = ".".join(path[: depth + 1])
        if name not in fields:
            where = f"section '{'.'.join(path[:depth])}'" if depth else "the top level"
            raise _unknown(sub, list(fields), where)
        tp = _hints(cls)[fields[name].name]
        if _is_section(tp):
            if depth == len(path) - 1:
                raise ConfigError(f"override {text!r} names the section '{sub}': give one of its "
                                  f"keys, e.g. {sub}.{next(iter(_fields(tp)))}=...")
            cls = tp
            continue
        if depth != len(path) - 1:
            raise ConfigError(f"override {text!r}: '{sub}' is a value, not a section.")
        if tp is str or typing.get_args(tp) == (str, type(None)):
            value: Any = raw  # strings are taken verbatim (paths, "none", "auto")
            if raw in NULLS:
                value = None
        else:
            try:
                value = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                value = raw
        value = _coerce(value, tp, key)
        _check_field(value, fields[name], key)
        return path, value
    raise ConfigError(f"override {text!r} has an empty key.")


def apply_overrides(root: type, raw: Mapping[str, Any], overrides: Sequence[str]
                    ) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``key.path=value`` (typed by the schema ``root``)
    applied (later ones win)."""
    out: dict[str, Any] = plain(dict(raw))
    for text in overrides:
        path, value = parse_override(root, text)
        node = out
        for name in path[:-1]:
            if not isinstance(node.get(name), dict):
                node[name] = {}
            node = node[name]
        node[path[-1]] = list(value) if isinstance(value, tuple) else value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML file holds (a path or a ``bundled:`` name)."""
    import yaml

    try:
        p = Path(bundled.resolve(str(path)))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    if not p.is_file():
        examples = bundled.training_examples()
        raise ConfigError(f"config file {str(p)!r} does not exist (the examples that ship "
                          f"with mdtk: {', '.join(examples)}).")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{p} must hold a mapping of sections, got {type(raw).__name__}.")
    return raw


def plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj
