"""Chat bodies and chunks of a request with tools: ``message.tool_calls`` and
``finish_reason: tool_calls``; streamed as OpenAI deltas whose argument fragments concatenate
to the non-streamed call (a named call streams its arguments as they come; other calls go
out whole once parsed, content before them streams as it comes)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pd_cluster.serving.api.openai_format import ChatFormatter, Result
from pd_cluster.serving.api.tool_parsers import CallStart
from pd_cluster.serving.api.tools import ToolPlan, call_id, tool_call_json


@dataclass
class _Stream:
    # The output so far, as it came (joined once, at the end: ``+=`` on a long text copies
    # it on every chunk).
    parts: list[str] = field(default_factory=list)
    sent: int = 0  # characters of it sent as content
    start: CallStart | None = None  # auto: where the calls begin, found piece by piece
    named_id: str | None = None


class ToolChatFormatter(ChatFormatter):
    def __init__(self, plan: ToolPlan, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plan = plan
        self._streams: dict[int, _Stream] = {}

    @property
    def _plain(self) -> bool:
        return False  # every chunk goes through chunk()

    @staticmethod
    def _reason(finish_reason: str | None, calls: list[Any]) -> str | None:
        return "tool_calls" if calls and finish_reason == "stop" else finish_reason

    def full(self, results: list[Result]) -> dict[str, Any]:
        body = super().full(results)
        for choice, r in zip(body["choices"], results):
            content, calls = self.plan.calls(r.text)
            choice["message"]["content"] = content
            choice["message"]["tool_calls"] = [tool_call_json(c) for c in calls]
            choice["finish_reason"] = self._reason(r.finish_reason, calls)
        return body

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None,
              index: int = 0, logprobs: Any = None,
              prompt_logprobs: Any = None) -> dict[str, Any] | None:
        plan = self.plan
        if plan.mode == "none":
            return super().chunk(text, token_ids, finish_reason, index, logprobs)
        s = self._streams.setdefault(index, _Stream())
        delta: dict[str, Any] = {}
        reason = finish_reason
        if plan.mode == "named":
            if s.named_id is None and (text or finish_reason):
                s.named_id = call_id()
                delta["tool_calls"] = [{"index": 0, "id": s.named_id, "type": "function",
                                        "function": {"name": plan.named, "arguments": text}}]
            elif text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
            reason = self._reason(finish_reason, [plan.named])
        else:
            s.parts.append(text)
            if plan.mode == "auto":
                if s.start is None:
                    s.start = plan.parser.scanner()
                content = s.start.feed(text)
                if content:
                    delta["content"] = content
                    s.sent += len(content)
            if finish_reason is not None:
                whole = "".join(s.parts)
                _, calls = plan.calls(whole)
                if calls:
                    delta["tool_calls"] = [tool_call_json(c, i) for i, c in enumerate(calls)]
                elif len(whole) > s.sent:  # no calls after all: the rest is content
                    delta["content"] = delta.get("content", "") + whole[s.sent:]
                reason = self._reason(finish_reason, calls)
        if not delta and reason is None and not (self.return_token_ids or token_ids):
            return None
        return self._chunk(delta, reason, token_ids, index, logprobs)
