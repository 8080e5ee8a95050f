"""Config errors that name the offending key path, from pydantic's validation errors.

``prefill.replcas: unknown key (expected one of: ...)``, ``proxy.port: expected an integer``.
Validators raise ``ValueError("<key>: <problem>")`` when the key is below the field they check
(``resources.GPU: use num_gpus``); the path of the enclosing section goes in front.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

_EXPECTED = {"int_type": "expected an integer", "int_parsing": "expected an integer",
             "int_from_float": "expected an integer", "float_type": "expected a number",
             "float_parsing": "expected a number", "bool_type": "expected true or false",
             "bool_parsing": "expected true or false", "string_type": "expected a string",
             "dict_type": "expected a mapping", "model_type": "expected a mapping",
             "model_attributes_type": "expected a mapping", "list_type": "expected a list",
             "tuple_type": "expected a list"}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
           "less_than_equal": "<="}
_BOUND_KEYS = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt",
               "less_than_equal": "le"}
# Keys the YAML writes flat although the model nests them (kv_transfer's pipe keys).
FLATTENED = {"pipe_config"}
_FLATTENED = FLATTENED


class ConfigError(ValueError):
    """A config value or key is invalid; the message starts with the key path."""


def config_error(e: ValidationError, model: type[BaseModel]) -> ConfigError:
    """The first error of validating ``model`` as one line: ``<key path>: <problem>``."""
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if p not in _FLATTENED]
    kind, ctx, value = err["type"], err.get("ctx", {}), err.get("input")
    if kind == "extra_forbidden":
        known = _fields_at(model, loc[:-1])
        text = "unknown key" + (f" (expected one of: {', '.join(known)})" if known else "")
    elif kind == "literal_error":
        text = f"must be one of {ctx.get('expected', '?')}, got {value!r}"
    elif kind in _BOUNDS:
        text = f"must be {_BOUNDS[kind]} {ctx.get(_BOUND_KEYS[kind])}, got {value!r}"
    elif kind == "value_error":
        text = str(ctx.get("error", err["msg"]))
        head = text.split(" ", 1)[0]
        if head.endswith(":") and head[:-1].replace(".", "").replace("_", "").isalnum():
            loc, text = loc + [head[:-1]], text[len(head):].lstrip()  # "key: problem" below
    elif kind in _EXPECTED:
        text = f"{_EXPECTED[kind]}, got {value!r}"
    else:
        text = err["msg"]
    path = ".".join(loc)
    return ConfigError(f"{path or '<root>'}: {text}")


def _fields_at(model: type[BaseModel] | None, loc: list[str]) -> list[str]:
    """The keys a section accepts, found by walking the models along ``loc``."""
    for key in loc:
        if model is None:
            return []
        field = model.model_fields.get(key)
        if field is None:
            field = _nested_field(model, key)
        ann = getattr(field, "annotation", None)
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    if model is None:
        return []
    names = set(model.model_fields)
    for nested in _FLATTENED & names:  # flattened keys are accepted at this level too
        ann = model.model_fields[nested].annotation
        names = (names - {nested}) | set(getattr(ann, "model_fields", {}))
    return sorted(names)


def _nested_field(model: type[BaseModel], key: str) -> Any:
    for nested in _FLATTENED & set(model.model_fields):
        ann = model.model_fields[nested].annotation
        if key in getattr(ann, "model_fields", {}):
            return ann.model_fields[key]
    return None


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
