"""The machinery under the options dataclasses: a field that carries its flag, help, group and valid range; the
range checks; the argparse arguments and the recipe table generated from the fields."""
from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from dataclasses import field
from typing import Any


def option(default: Any = None, help: str = "", *, group: str = "", choices: tuple | None = None,
           low: float | None = None, high: float | None = None, above: float | None = None,
           metavar: str | None = None, flag: str | None = None, positional: bool = False, nargs: str | None = None,
           required: bool = False):
    """A dataclass field with what the command line and the checks need to know about it."""
    meta = dict(help=help, group=group, choices=choices, low=low, high=high, above=above, metavar=metavar,
                flag=flag, positional=positional, nargs=nargs, required=required)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def shown_default(value) -> str:
    return "off" if value is False else ("none" if value is None else str(value))


def fields_of(cls) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def value_type(cls, f: dataclasses.Field) -> type:
    """int, float, str or bool: the annotation without its `| None`."""
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0]


def range_problems(options) -> list[str]:
    problems = []
    for f in fields_of(type(options)):
        value, meta = getattr(options, f.name), f.metadata
        if value is None or isinstance(value, bool):
            continue
        flag = flag_of(f)
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{flag} must be a finite number, got {value}")
            continue
        if meta.get("choices") and value not in meta["choices"]:
            problems.append(f"{flag} must be one of {', '.join(meta['choices'])}, got {value!r}")
        low, high, above = meta.get("low"), meta.get("high"), meta.get("above")
        if isinstance(value, (int, float)):
            if low is not None and high is not None and not low <= value <= high:
                problems.append(f"{flag} must be in [{low}, {high}], got {value}")
            elif low is not None and value < low:
                problems.append(f"{flag} must be at least {low}, got {value}")
            elif above is not None and high is not None and not above < value <= high:
                problems.append(f"{flag} must be in ({above}, {high}], got {value}")
            elif high is not None and low is None and above is None and value > high:
                problems.append(f"{flag} must be at most {high}, got {value}")
    return problems


def argument_group(parser: argparse.ArgumentParser, title: str):
    """The parser's argument group of that title, made when it has none (one group per title in --help)."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def add_arguments(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """One --flag per field of an options dataclass, grouped as the fields say, help with the default."""
    for f in fields_of(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        group = meta.get("group") or ""
        target = parser if not group else argument_group(parser, group)
        kind = value_type(cls, f)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = meta.get("help", "")
        if kind is bool:
            target.add_argument(flag_of(f), action="store_true", default=default, dest=f.name, help=help_text)
            continue
        if default is not None and "default" not in help_text:
            help_text += f" (default {shown_default(default)})"
        target.add_argument(flag_of(f), type=kind, default=default, dest=f.name, help=help_text,
                            choices=meta.get("choices"), metavar=meta.get("metavar"))


def from_namespace(cls, namespace: argparse.Namespace, **overrides):
    values = {f.name: getattr(namespace, f.name) for f in fields_of(cls) if hasattr(namespace, f.name)}
    return cls(**{**values, **overrides})


def option_table(cls) -> dict[str, dict]:
    """{recipe key: {"flag", "type", "choices", "help"}} of an options dataclass (what recipes may set)."""
    return {f.name: {"flag": flag_of(f), "type": value_type(cls, f), "choices": f.metadata.get("choices"),
                     "help": f.metadata.get("help", "")} for f in fields_of(cls)}
