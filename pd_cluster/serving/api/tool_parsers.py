"""Parsers that pick tool calls out of a model's free text (``tool_choice: auto``), one per
family, named as vLLM's ``--tool-call-parser``: hermes (Hermes, Qwen: ``<tool_call>{...}
</tool_call>``), llama3_json (Llama 3.x: a JSON object, ``{"name", "parameters"}``), mistral
(``[TOOL_CALLS]`` then a JSON list, or ``name[ARGS]{...}`` per call)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text


def _call(obj: Any, args_key: str = "arguments") -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _objects(text: str) -> list[Any]:
    """The JSON values written one after another in ``text`` (separators ; , or space)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            return out
        value, i = dec.raw_decode(text, i)
        out.append(value)


class ToolParser:
    """``start``: the text that begins the calls (content before it is the message's)."""
    start = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls); no calls (and the whole text as content) if none parse."""
        raise NotImplementedError

    def calls_begin(self, text: str) -> int:
        """Where the calls begin in ``text`` (-1: not yet)."""
        return text.find(self.start) if self.start else -1

    def holdback(self, text: str) -> int:
        """Characters at the end of ``text`` that may still begin a call (not sent yet)."""
        return next((k for k in range(min(len(self.start), len(text)), 0, -1)
                     if self.start.startswith(text[-k:])), 0)


class HermesParser(ToolParser):
    start = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        try:
            calls = [_call(json.loads(m)) for m in self._CALL.findall(text[at:])]
        except ValueError:
            return text, []
        if not calls or None in calls:
            return text, []
        return (text[:at] if text[:at].strip() else None), calls  # type: ignore[return-value]


class Llama3JsonParser(ToolParser):
    start = "{"
    _TAG = "<|python_tag|>"

    def calls_begin(self, text: str) -> int:
        stripped = text.lstrip()
        if stripped.startswith(self._TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return -1

    def holdback(self, text: str) -> int:
        stripped = text.strip()  # calls come only at the very start
        return len(text) if not stripped or self._TAG.startswith(stripped) else 0

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip().removeprefix(self._TAG).strip()
        if not body.startswith("{"):
            return text, []
        try:
            calls = [_call(o, "parameters") for o in _objects(body)]
        except ValueError:
            return text, []
        if not calls or None in calls:
            return text, []
        return None, calls  # type: ignore[return-value]


class MistralParser(ToolParser):
    start = "[TOOL_CALLS]"
    _NAMED = re.compile(r"([A-Za-z0-9_.-]+)\[ARGS\]")

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        body = text[at + len(self.start):].strip()
        try:
            if body.startswith("["):
                calls = [_call(o) for o in json.loads(body)]
            else:  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
                calls = []
                for part in body.split(self.start):
                    m = self._NAMED.match(part.strip())
                    if m is None:
                        return text, []
                    args = part.strip()[m.end():]
                    json.loads(args)
                    calls.append(ParsedCall(m.group(1), args))
        except ValueError:
            return text, []
        if not calls or None in calls:
            return text, []
        return (text[:at] if text[:at].strip() else None), calls  # type: ignore[return-value]


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "qwen": HermesParser,
                                        "llama3_json": Llama3JsonParser,
                                        "mistral": MistralParser}
