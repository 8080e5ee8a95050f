"""Tool calling on chat completions: ``tools``, ``tool_choice`` (none, auto, required, a named
function) and ``parallel_tool_calls``.

``required`` and a named function constrain the output with a JSON schema built from the
functions' parameters (a list of {"name", "arguments"}; for a named function its arguments
alone), so the calls validate whatever the model; ``auto`` leaves the output free and a
family's parser (tool_parsers.py, chosen by ``proxy.tool_call_parser``) picks the calls out.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from pd_cluster.serving.api.errors import invalid_request
from pd_cluster.serving.api.tool_parsers import PARSERS, ParsedCall, ToolParser
from pd_cluster.structured_outputs import StructuredOutputsParams


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDef


_NO_ARGS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    mode: Literal["none", "auto", "required", "named"]
    tools: list[ToolDef]
    named: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> parameters

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the chat template gets them (OpenAI's shape, as HF templates expect)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            return StructuredOutputsParams(json=json.dumps(self.schemas[self.named]))
        if self.mode != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, schema in self.schemas.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=json.dumps(array))

    def calls(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished output."""
        if self.mode == "named":
            return None, [ParsedCall(self.named or "", text)]
        if self.mode == "required":
            try:
                return None, [ParsedCall(c["name"], json.dumps(c["arguments"]))
                              for c in json.loads(text)]
            except (ValueError, KeyError, TypeError):  # cut short by max_tokens
                return text, []
        if self.mode == "auto" and self.parser is not None:
            return self.parser.parse(text)
        return text, []


def tool_plan(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
              auto_enabled: bool, parser_name: str | None) -> ToolPlan | None:
    """The request's tool handling (None: no tools), or a 400 naming the field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid_request("tool_choice: needs tools", "tool_choice")
        return None
    try:
        defs = [ToolDef.model_validate(t) for t in tools]
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise invalid_request(f"tools: {loc}: {err['msg']}", "tools") from None
    schemas = {t.function.name: t.function.parameters or _NO_ARGS for t in defs}
    choice = tool_choice if tool_choice is not None else ("auto" if auto_enabled else "none")
    plan = ToolPlan("none", defs, parallel=parallel is not False, schemas=schemas)
    if choice in ("none", "required"):
        plan.mode = choice
    elif choice == "auto":
        if not auto_enabled or parser_name not in PARSERS:
            raise invalid_request('tool_choice: "auto" needs proxy.enable_auto_tool_choice and '
                                  'proxy.tool_call_parser set (as vLLM\'s '
                                  '--enable-auto-tool-choice --tool-call-parser)', "tool_choice")
        plan.mode, plan.parser = "auto", PARSERS[parser_name]()
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)):
        name = choice["function"].get("name")
        if name not in schemas:
            raise invalid_request(f"tool_choice: no tool named {name!r} in tools", "tool_choice")
        plan.mode, plan.named = "named", name
    else:
        raise invalid_request("tool_choice: must be none, auto, required or "
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
    return plan


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call_json(call: ParsedCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call_id(), "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as HF templates read them: assistant tool calls with arguments as
    objects, tool results with their call id."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        out.append(msg)
    return out


def _template_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}
