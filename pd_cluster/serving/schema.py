"""Build frozen dataclasses from parsed YAML, with errors that name the offending key path.

A small structural validator (no pydantic) so config errors read like
``prefill.replcas: unknown key (expected one of: num_cpus, num_gpus, replicas)``.
Dataclass ``__post_init__`` checks raise ``ValueError("<key>: <problem>")``; the builder
prefixes the path of the enclosing section.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
    """A config value or key is invalid; the message starts with the key path."""


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def build(cls: type, data: Any, path: str = "") -> Any:
    """Validate ``data`` (a mapping) against dataclass ``cls`` and construct it."""
    where = path or "<root>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in data:
        if key not in names:
            raise ConfigError(f"{_join(path, str(key))}: unknown key "
                              f"(expected one of: {', '.join(sorted(names))})")
    kwargs = {k: coerce(hints[k], v, _join(path, k)) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        msg = str(e)
        # Messages of the form "key: problem" get the section path in front.
        if msg.split(" ")[0].endswith(":"):
            raise ConfigError(_join(path, msg)) from None
        raise ConfigError(f"{where}: {msg}") from None


def coerce(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints widen to float, nothing else."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{path}: must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(option, value, path)
            except ConfigError as e:
                errors.append(str(e).split(": ", 1)[-1])
        raise ConfigError(f"{path}: {'; or '.join(errors)}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: must be one of {', '.join(map(str, allowed))}, "
                              f"got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        item = (get_args(tp) or (Any,))[0]
        return [coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    raise ConfigError(f"{path}: unsupported annotation {tp!r}")  # a bug in the schema


def set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    """``set_path(d, "proxy.port", 0)``: create intermediate sections as needed."""
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {key} is not a section")
        node = child
    node[keys[-1]] = value
