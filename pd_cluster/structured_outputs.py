"""What a request's output must match (vLLM's ``StructuredOutputsParams``): one constraint of
json (a JSON schema), regex, choice, grammar (EBNF) or json_object (any JSON object).

A plain dataclass of builtins: it travels inside SamplingParams through msgpack as it is. The
grammar behind it is compiled by the engine (engine/structured/), once per distinct spec.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema, serialised (the proxy dumps a dict schema)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF/xgrammar syntax, a ``root`` rule)
    json_object: bool = False
    # JSON without whitespace between tokens (None: the engine's configured default).
    disable_any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(KINDS)} must be "
                             f"given, got {', '.join(given) or 'none'}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: must be a non-empty string")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of "
                             "non-empty strings")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object: must be a bool")
        if self.disable_any_whitespace is not None and not isinstance(
                self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace: must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> Any:
        """The constraint's value (the schema, pattern, choices or grammar text)."""
        return getattr(self, self.kind)

    def cache_key(self, default_no_whitespace: bool) -> tuple:
        """Equal keys compile to the same grammar (the engine caches by it)."""
        spec = self.spec()
        no_ws = (default_no_whitespace if self.disable_any_whitespace is None
                 else self.disable_any_whitespace)
        return (self.kind, tuple(spec) if isinstance(spec, list) else spec, no_ws)
