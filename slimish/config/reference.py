"""The config reference, read off the schema: every key with its type, default and help, as text (`slimish config
[SECTION]`) or as Markdown (`docs/config.md`, written by `make docs`; a test keeps the file equal to the schema)."""

from __future__ import annotations

import dataclasses
import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Literal, get_args, get_origin

from slimish.config.schema import JobConfig

HEADER = ("# Config reference\n\nEvery key of a slimish config, generated from `slimish/config/schema.py` by "
          "`make docs` (do not edit by hand). Set a key in the YAML file or on the command line as "
          "`section.key=value`; `slimish config [SECTION]` prints the same list.\n")


@dataclasses.dataclass(frozen=True)
class Key:
    dotted: str
    type: str
    default: str
    help: str


def _type_name(annotation) -> str:
    if get_origin(annotation) is Literal:
        return " | ".join(repr(v) for v in get_args(annotation))
    if get_origin(annotation) in (types.UnionType, typing.Union):
        return " | ".join(_type_name(a) for a in get_args(annotation))
    if get_origin(annotation) in (list, dict):
        return f"{get_origin(annotation).__name__}[{', '.join(_type_name(a) for a in get_args(annotation))}]"
    return getattr(annotation, "__name__", str(annotation))


def _default(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return repr(value)


def keys(cls=JobConfig, prefix: str = "") -> Iterator[Key]:
    """Every leaf key under `cls`, depth first, in the schema's order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        if dataclasses.is_dataclass(annotation):
            yield from keys(annotation, f"{prefix}{f.name}.")
        else:
            yield Key(f"{prefix}{f.name}", _type_name(annotation), _default(f), f.metadata.get("help", ""))


def sections() -> list[str]:
    return [f.name for f in dataclasses.fields(JobConfig)]


def text(section: str | None = None) -> str:
    """`key  (type, default)  help` lines, for one top-level section or all of them."""
    chosen = [k for k in keys() if section is None or k.dotted.split(".")[0] == section]
    return "\n".join(f"{k.dotted}  ({k.type}, default {k.default})\n" + textwrap.fill(
        k.help, width=110, initial_indent="    ", subsequent_indent="    ") for k in chosen)


def markdown() -> str:
    """The whole reference: one table per top-level section."""
    out = [HEADER]
    for section in sections():
        cls = typing.get_type_hints(JobConfig)[section]
        out.append(f"\n## `{section}`\n")
        if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):  # dataclasses invent a signature doc
            out.append(" ".join(cls.__doc__.split()) + "\n")
        out.append("| key | type | default | meaning |\n|---|---|---|---|")
        for k in keys(cls, f"{section}."):
            out.append(f"| `{k.dotted}` | {_cell(k.type)} | `{k.default}` | {_cell(k.help)} |")
    return "\n".join(out) + "\n"


def _cell(value: str) -> str:
    return value.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
