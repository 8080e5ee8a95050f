"""``/v1/responses`` (stateless): a Responses request becomes the chat request it means
(instructions as the system message, input items as messages, function tools, ``text.format``
as response_format) and runs as one; responses_format.py writes the Responses bodies/events.
Stored state (``previous_response_id``, ``background``) is a clear 400: nothing is stored."""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pd_cluster.serving.api.errors import invalid_request
from pd_cluster.serving.api.openai_schemas import ChatCompletionRequest


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # unknown fields: ignored
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    seed: int | None = None  # an extension (vLLM's too)
    user: str | None = None
    previous_response_id: str | None = None
    background: bool | None = None


def parse_responses(raw: bytes) -> tuple[ResponsesRequest, ChatCompletionRequest]:
    """The Responses request and the chat request it runs as (400s name the field)."""
    try:
        req = ResponsesRequest.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise invalid_request(f"Malformed JSON body: {err.get('msg')}", None,
                                  "invalid_json") from None
        loc = ".".join(str(x) for x in err["loc"])
        raise invalid_request(f"{loc}: {err['msg']}", str(err["loc"][0]) if err["loc"]
                              else None) from None
    if req.previous_response_id is not None:
        raise invalid_request("previous_response_id: this server stores no responses (send "
                              "the conversation as input items)", "previous_response_id")
    if req.background:
        raise invalid_request("background: not supported (nothing is stored)", "background")
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req), "stream": req.stream}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("seed", "seed"), ("user", "user"),
                         ("parallel_tool_calls", "parallel_tool_calls")):
        if getattr(req, theirs) is not None:
            body[ours] = getattr(req, theirs)
    if req.tools:
        body["tools"] = [_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        body["response_format"] = _format(fmt)
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        raise invalid_request(f"{'.'.join(map(str, err['loc']))}: {err['msg']}", "input") \
            from None
    return req, chat


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text",
                                                                 "text"):
                raise invalid_request("input: only text content parts are supported", "input")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise invalid_request("input: a message's content must be text or text parts", "input")


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return out + [{"role": "user", "content": req.input}]
    for item in req.input:
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise invalid_request(f"input: item type {kind!r} is not supported", "input")
    return out


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise invalid_request(f"tools: only function tools are supported, got "
                              f"{tool.get('type')!r}", "tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    return fmt  # text, json_object (anything else: response_format's own 400)
