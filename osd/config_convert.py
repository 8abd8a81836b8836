"""Frozen dataclasses from plain mappings (parsed YAML), type by type, with errors that name the
field and the bad value: the conversion behind osd.config's loader."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

__all__ = ["config_from_dict"]


def config_from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Builds dataclass ``cls`` from a mapping, recursively, rejecting unknown keys."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} in {prefix or 'config'}; known: {sorted(names)}"
        )
    kwargs = {name: _convert(hints[name], value, f"{prefix}{name}") for name, value in data.items()}
    return cls(**kwargs)


def _convert(hint: Any, value: Any, name: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return config_from_dict(hint, value or {}, prefix=f"{name}.")  # type: ignore[arg-type]
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{name} must be one of {list(args)}, got {value!r}")
        return value
    if origin is tuple:
        items = value if isinstance(value, list | tuple) else [value]
        return tuple(_convert(args[0], item, name) for item in items)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return _convert(arm, value, name)
            except ValueError as e:
                errors.append(str(e).removeprefix(f"{name} must be ").rsplit(", got ", 1)[0])
        raise ValueError(f"{name} must be {' or '.join(errors)}, got {value!r}")
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 1e-4 as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint in (int, str, bool) and type(value) is hint:
        return value
    raise ValueError(f"{name} must be {getattr(hint, '__name__', hint)}, got {value!r}")
