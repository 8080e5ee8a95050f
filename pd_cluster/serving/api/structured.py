"""The request fields that constrain the output, mapped to StructuredOutputsParams:
OpenAI's ``response_format`` (json_object, json_schema) and vLLM's ``structured_outputs``
(json, regex, choice, grammar, json_object, disable_any_whitespace). Whether a spec compiles
is checked by grammar_check.py (off the event loop, bounded), not here."""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pd_cluster.serving.api.errors import invalid_request
from pd_cluster.structured_outputs import StructuredOutputsParams


class StructuredOutputsField(BaseModel):
    """vLLM 0.32's ``structured_outputs`` request field (the parts served here)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    json_: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    def __init__(self, **data: Any) -> None:  # "json" shadows BaseModel.json
        if "json" in data:
            data["json_"] = data.pop("json")
        super().__init__(**data)

    def params(self) -> StructuredOutputsParams:
        schema = self.json_
        return StructuredOutputsParams(
            json=json.dumps(schema) if isinstance(schema, dict) else schema, regex=self.regex,
            choice=self.choice, grammar=self.grammar, json_object=bool(self.json_object),
            disable_any_whitespace=self.disable_any_whitespace)


def response_format_params(fmt: dict[str, Any] | None, field: str = "response_format"
                           ) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` ({"type": "text" | "json_object" | "json_schema"})."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise invalid_request(f"{field}.type: must be text, json_object or json_schema, got "
                              f"{kind!r}", field)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise invalid_request(f"{field}.json_schema: must be an object with a 'schema' object",
                              field)
    schema = spec.get("schema", {"type": "object"})  # OpenAI: schema is optional
    return StructuredOutputsParams(json=json.dumps(schema))


def request_params(structured: dict[str, Any] | None, response_format: dict[str, Any] | None
                   ) -> StructuredOutputsParams | None:
    """The request's one output constraint (both fields at once: a 400)."""
    if structured is not None and response_format not in (None, {"type": "text"}):
        raise invalid_request("structured_outputs and response_format: give one of them",
                              "structured_outputs")
    try:
        if structured is not None:
            return StructuredOutputsField(**structured).params()
        return response_format_params(response_format)
    except ValidationError as e:  # name the sub-field
        err = e.errors()[0]
        loc = ".".join(str(x).rstrip("_") for x in err["loc"])
        msg = "unknown parameter" if err["type"] == "extra_forbidden" else err["msg"]
        raise invalid_request(f"structured_outputs.{loc}: {msg}", "structured_outputs") from None
    except ValueError as e:  # StructuredOutputsParams' own checks name the field
        raise invalid_request(str(e), "structured_outputs") from None


def spec_bytes(params: StructuredOutputsParams) -> int:
    """The size of the constraint's text (what a compile's cost grows with)."""
    spec = params.spec()
    if isinstance(spec, list):
        return sum(len(c.encode()) for c in spec)
    return len(spec.encode()) if isinstance(spec, str) else 0


def check_compiles(params: StructuredOutputsParams, field: str) -> None:
    """A 400 naming ``field`` unless ``params`` compile (slow for some specs: call it off the
    event loop, grammar_check.py)."""
    from pd_cluster.engine.structured.xgrammar_backend import check_spec
    try:
        check_spec(params, bool(params.disable_any_whitespace))
    except ValueError as e:
        raise invalid_request(f"{field}: {params.kind} does not compile: {e}", field) from None
