"""Command-line options from a config dataclass: one option per field whose metadata has a help text, so a
setting's default, type, choices and help live in one place (the field) and the CLI cannot drift from the config."""
from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING, fields
from typing import Any, TypeVar

C = TypeVar("C")


def opt(help: str, **extra: Any) -> dict[str, Any]:
    """A field's metadata: its help text, and optionally `choices`, `flag` (the option's name without '--'; default:
    the field's name with dashes) and `invert` (a bool field set False by the flag, e.g. --fp32 for bf16)."""
    return {"help": help, **extra}


def _scalar(hint: Any) -> Any:
    """`int | None` -> int, `Path` -> Path."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one option per documented field of the dataclass `cls` (dest = the field's name)."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if "help" not in f.metadata:
            continue
        flag = "--" + f.metadata.get("flag", f.name.replace("_", "-"))
        kind = _scalar(hints[f.name])
        if kind is bool:
            action = "store_false" if f.metadata.get("invert") else "store_true"
            parser.add_argument(flag, dest=f.name, action=action, help=f.metadata["help"])
            continue
        default = f.default if f.default is not MISSING else None
        parser.add_argument(flag, dest=f.name, type=kind, default=default, choices=f.metadata.get("choices"),
                            help=f.metadata["help"])


def from_options(cls: type[C], ns: argparse.Namespace, **more: Any) -> C:
    """The dataclass from parsed options (its documented fields) and `more`."""
    given = {f.name: getattr(ns, f.name) for f in fields(cls) if "help" in f.metadata}  # type: ignore[arg-type]
    return cls(**given, **more)
