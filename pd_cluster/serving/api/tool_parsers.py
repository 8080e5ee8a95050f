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

    def scanner(self) -> "CallStart":
        """A streamed output's watch for where its calls begin."""
        return MarkerStart(self.start)


class CallStart:
    """Where a streamed output's calls begin, found piece by piece: ``feed`` looks at the new
    piece and a tail of bounded length, so a stream costs its length, not its length squared
    (the text is never rescanned from the start)."""

    def __init__(self) -> None:
        self.in_calls = False
        self.scanned = 0  # characters looked at, in all (the work a test can measure)

    def feed(self, piece: str) -> str:
        """The content that can be sent now: text before the calls, never a possible
        beginning of them (held back until a later piece decides)."""
        raise NotImplementedError


class MarkerStart(CallStart):
    """Calls begin at a marker anywhere in the text (``<tool_call>``, ``[TOOL_CALLS]``)."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self._held = ""  # a suffix that may begin the marker (shorter than it)

    def feed(self, piece: str) -> str:
        if self.in_calls:
            return ""
        # A marker across pieces begins inside the held suffix, never before it.
        window = self._held + piece
        self.scanned += len(window)
        at = window.find(self.marker) if self.marker else -1
        if at >= 0:
            self.in_calls, self._held = True, ""
            return window[:at]
        keep = next((k for k in range(min(len(self.marker), len(window)), 0, -1)
                     if self.marker.startswith(window[-k:])), 0)
        self._held = window[len(window) - keep:]
        return window[:len(window) - keep]


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

    def scanner(self) -> CallStart:
        return LeadingStart(self._TAG)

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


class LeadingStart(CallStart):
    """Llama 3's calls come first: after leading whitespace, ``{`` or the python tag begins
    them; any other first word (or a tag cut short) makes the whole output content."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag
        self.free = False  # decided: no calls; every piece is content as it comes
        self._lead: list[str] = []  # leading whitespace (held)
        self._head = ""  # the text after it while a prefix of the tag (held)
        self._trail: list[str] = []  # whitespace after that head (held)

    def _held(self) -> str:
        return "".join(self._lead) + self._head + "".join(self._trail)

    def feed(self, piece: str) -> str:
        self.scanned += len(piece)
        if self.free or self.in_calls:
            return piece if self.free else ""
        if not self._head:
            rest = piece.lstrip()
            self._lead.append(piece[:len(piece) - len(rest)])
            if not rest:
                return ""
            piece = rest
        elif self._trail or not piece.strip():
            if not piece.strip():  # a tag prefix then whitespace: still undecided
                self._trail.append(piece)
                return ""
            # whitespace inside the head: not the tag
            self.free = True
            return self._held() + piece
        core = self._head + piece  # the head is shorter than the tag: a bounded rescan
        self.scanned += len(self._head)
        if core.startswith("{") or core.startswith(self.tag):
            self.in_calls = True
            return "".join(self._lead)
        head = core.rstrip()
        if self.tag.startswith(head):
            self._head, self._trail = head, [core[len(head):]] if len(core) > len(head) else []
            return ""
        self.free = True
        lead, self._lead, self._head = "".join(self._lead), [], ""
        return lead + core


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "qwen": HermesParser,
                                        "llama3_json": Llama3JsonParser,
                                        "mistral": MistralParser}
