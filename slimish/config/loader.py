"""YAML file + dotted `key.sub=value` overrides -> a typed, validated `JobConfig`.

Contract: every error is a `ConfigError` whose message starts with the full dotted key and says what is allowed
(the allowed keys, values or type). Nothing is silently coerced except int -> float. Values are read with YAML
1.2's rules for booleans and floats (PyYAML implements YAML 1.1, where `off`, `on`, `yes` and `no` are booleans,
so `rollout.partial.mode=off` would be False, and `1e-4` is a string).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from slimish.config.errors import ConfigError
from slimish.config.schema import JobConfig
from slimish.config.validate import validate


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 (core schema) booleans (only true/false) and floats (`1e-4` included)."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:bool",
                                                                      "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _no_duplicate_keys(loader, node, deep=False):
    """A mapping whose key appears twice is an error (PyYAML keeps the last one silently)."""
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice in one mapping",
                                                    key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Yaml12Loader.construct_mapping = _no_duplicate_keys


def _yaml_load(text: str):
    return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """['a.b=1', 'c=x'] -> nested dict; values are parsed as YAML scalars/lists."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override must look like section.key=value")
        dotted, raw = item.split("=", 1)
        if not all(dotted.strip().split(".")):
            raise ConfigError(item, "an override must look like section.key=value (a dotted key, no empty part)")
        try:
            value = _yaml_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(dotted, f"cannot parse value {raw!r}: {exc}") from None
        node = nested
        parts = dotted.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(dotted, "conflicts with an earlier override of a parent key")
            node = child
        node[parts[-1]] = value
    return nested


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _type_name(tp) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _check_value(key: str, tp, value):
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(key, f"got {value!r}; allowed values: {', '.join(repr(a) for a in allowed)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected a bool (true/false), got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an int, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {type(value).__name__} {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):  # the first member that takes the value (bool | float: true, 0.5)
        for member in get_args(tp):
            try:
                return _check_value(key, member, value)
            except ConfigError:
                continue
        raise ConfigError(key, f"expected a {' or a '.join(_type_name(a) for a in get_args(tp))}, got "
                               f"{type(value).__name__} {value!r}")
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {type(value).__name__} {value!r}")
        (item_type,) = get_args(tp) or (None,)
        if item_type is not None:
            return [_check_value(f"{key}[{k}]", item_type, item) for k, item in enumerate(value)]
        return list(value)
    raise ConfigError(key, f"unsupported schema type {_type_name(tp)}")


def build_dataclass(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a nested dict, checking every key and type."""
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip(".") or "<root>", f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(dotted, f"unknown key{hint}; allowed keys here: {', '.join(sorted(fields))}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build_dataclass(tp, value if value is not None else {}, prefix=f"{dotted}.")
        else:
            kwargs[key] = _check_value(dotted, tp, value)
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def load_config(path: str | Path | None, overrides: list[str] | None = None, *, files: bool = True,
                isolate_hooks: bool = False) -> JobConfig:
    """Load YAML `path` (may be None), apply dotted `overrides`, build and validate the config (files=False: read
    no file but the model's config.json; isolate_hooks: import the hooks in a process of their own)."""
    data: dict = {}
    if path is not None:
        data = _read_mapping(Path(path))
    data = _merge(data, parse_overrides(overrides or []))
    cfg = build_dataclass(JobConfig, data)
    validate(cfg, files=files, isolate_hooks=isolate_hooks)
    return cfg


def _read_mapping(path: Path) -> dict:
    """The YAML mapping in config file `path`; a ConfigError in one line for anything else (a directory, an
    unreadable or non-UTF-8 file, invalid YAML, a list or a scalar). A missing file raises FileNotFoundError."""
    if path.is_dir():
        raise ConfigError("<file>", f"{path} is a directory: give a YAML config file (configs/quickstart_cpu.yaml)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("<file>", f"{path} is not UTF-8 text (byte {exc.start}): give a YAML config file") from None
    except PermissionError:
        raise ConfigError("<file>", f"{path} cannot be read (permission denied)") from None
    try:
        data = _yaml_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("<file>", f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("<file>", f"{path} holds a YAML {type(data).__name__}, not a mapping of sections "
                                    "(run:, model:, rollout:, ...)")
    return data


def save_config(cfg: JobConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
