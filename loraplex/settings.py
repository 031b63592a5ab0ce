"""Settings from flags and LORAPLEX_* environment variables, for frozen dataclasses.

Each service declares one frozen dataclass (its `config.py`); this module turns
its fields into command-line flags whose defaults come from the environment
(`LORAPLEX_<FIELD>` upper-cased) or the dataclass default, in that order, with
flags winning over both. Field metadata `help` documents a flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "LORAPLEX_"


class SettingsError(ValueError):
    """A setting has a value the service cannot use."""


def _base_type(tp: Any) -> Any:
    """`int | None` -> int; `list[str]` -> list."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return origin or tp


def parse_bool(text: str) -> bool:
    """A boolean setting: 1/true/yes/on or 0/false/no/off (any case; empty is false)."""
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise SettingsError(f"expected a boolean (true/false), got {text!r}")


def _convert(name: str, tp: Any, text: str) -> Any:
    base = _base_type(tp)
    try:
        if base is bool:
            return parse_bool(text)
        if base is list or base is tuple:
            items = [p.strip() for p in text.split(",") if p.strip()]
            return tuple(items) if base is tuple else items
        if base is int and name.endswith("_bytes"):
            return parse_size(text)
        if base is int:
            return int(float(text)) if "e" in text.lower() else int(text, 0)
        if base is float:
            return float(text)
        return text
    except (ValueError, SettingsError) as exc:
        raise SettingsError(f"bad value for {name}: {exc}") from exc


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one `--field-name` flag per dataclass field."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        env = ENV_PREFIX + f.name.upper()
        help_text = f.metadata.get("help", "")
        tp = hints[f.name]
        base = _base_type(tp)
        if base is bool:
            parser.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                                help=f"{help_text} [env {env}]")
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(),
                                help=f"{help_text} [env {env}]")


def settings_from_args(cls: type[T], args: argparse.Namespace | None = None,
                       environ: typing.Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Builds `cls` from flags (strings), then environment, then defaults."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        raw = getattr(args, f.name, None) if args is not None else None
        env_raw = environ.get(ENV_PREFIX + f.name.upper())
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif raw is not None:
            values[f.name] = raw if not isinstance(raw, str) else _convert(f.name, tp, raw)
        elif env_raw is not None:
            values[f.name] = _convert(f.name, tp, env_raw)
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise SettingsError(str(exc)) from exc


def parse_size(text: str | int) -> int:
    """'1GiB', '512M', '1e9', 1024 -> bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().replace("ib", "").replace("b", "")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    mult = 1
    if s and s[-1] in units:
        mult = units[s[-1]]
        s = s[:-1]
    try:
        return int(float(s) * mult)
    except ValueError as exc:
        raise SettingsError(f"not a size: {text!r} (try 1GiB, 512MiB, 1000000)") from exc
