"""Responses API bodies and stream events for a request run as a chat completion: the output
is a message and/or function calls (tools.ToolPlan picks them out of the text); streamed as
response.created, output items and their deltas, then response.completed."""
from __future__ import annotations

import time
import uuid
from typing import Any

from pd_cluster.serving.api.openai_format import Formatter, Result, sse, usage
from pd_cluster.serving.api.responses import ResponsesRequest
from pd_cluster.serving.api.tools import ToolPlan, call_id


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormatter(Formatter):
    def __init__(self, req: ResponsesRequest, plan: ToolPlan | None, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.req, self.plan = req, plan
        self.id = _id("resp")
        self.created = int(time.time())
        self._seq = 0
        self._text = ""
        self._msg_id = _id("msg")
        self._streams_text = plan is None or plan.mode == "none"
        self._opened_message = False

    # ---- bodies ---------------------------------------------------------------------------
    def _response(self, status: str, output: list[dict[str, Any]],
                  results: list[Result] | None, finish: str | None = None) -> dict[str, Any]:
        req = self.req
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "instructions": req.instructions,
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens, "text": req.text or {
                "format": {"type": "text"}}, "previous_response_id": None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length"
            else None, "metadata": {}, "store": False, "truncation": "disabled",
            "reasoning": None, "usage": None}
        if results is not None:
            u = usage(results)
            body["usage"] = {"input_tokens": u.prompt_tokens, "output_tokens":
                             u.completion_tokens, "total_tokens": u.total_tokens,
                             "input_tokens_details": {"cached_tokens":
                                                      u.prompt_tokens_details.cached_tokens},
                             "output_tokens_details": {"reasoning_tokens": 0}}
        return body

    def _items(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        """The output items; cut off at max_output_tokens, they are "incomplete" as the
        response is (an incomplete response holds no completed item)."""
        status = _status(finish_reason)
        content, calls = self.plan.calls(text) if self.plan is not None else (text, [])
        items = []
        if content:
            items.append({"type": "message", "id": self._msg_id, "status": status,
                          "role": "assistant", "content": [
                              {"type": "output_text", "text": content, "annotations": []}]})
        for c in calls:
            items.append({"type": "function_call", "id": _id("fc"), "call_id": call_id(),
                          "name": c.name, "arguments": c.arguments, "status": status})
        return items

    def full(self, results: list[Result]) -> dict[str, Any]:
        r = results[0]
        return self._response(_status(r.finish_reason), self._items(r.text, r.finish_reason),
                              results, r.finish_reason)

    # ---- events ---------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def opening_chunks(self, num_choices: int = 1) -> list[dict[str, Any]]:
        head = self._response("in_progress", [], None)
        return [self._event("response.created", response=head),
                self._event("response.in_progress", response=head)]

    def _open_message(self) -> list[dict[str, Any]]:
        self._opened_message = True
        item = {"type": "message", "id": self._msg_id, "status": "in_progress",
                "role": "assistant", "content": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", item_id=self._msg_id,
                            output_index=0, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})]

    def events(self, text: str, finish_reason: str | None,
               results: list[Result] | None = None) -> list[dict[str, Any]]:
        self._text += text
        out: list[dict[str, Any]] = []
        if self._streams_text and text:
            if not self._opened_message:
                out += self._open_message()
            out.append(self._event("response.output_text.delta", item_id=self._msg_id,
                                   output_index=0, content_index=0, delta=text))
        if finish_reason is None:
            return out
        items = self._items(self._text, finish_reason)
        for index, item in enumerate(items):
            if item["type"] == "message":
                if not self._opened_message:
                    out += self._open_message()
                    out.append(self._event("response.output_text.delta", item_id=self._msg_id,
                                           output_index=0, content_index=0,
                                           delta=item["content"][0]["text"]))
                part = item["content"][0]
                out += [self._event("response.output_text.done", item_id=self._msg_id,
                                    output_index=index, content_index=0, text=part["text"]),
                        self._event("response.content_part.done", item_id=self._msg_id,
                                    output_index=index, content_index=0, part=part)]
            else:
                opened = {**item, "arguments": "", "status": "in_progress"}
                out += [self._event("response.output_item.added", output_index=index,
                                    item=opened),
                        self._event("response.function_call_arguments.delta",
                                    item_id=item["id"], output_index=index,
                                    delta=item["arguments"]),
                        self._event("response.function_call_arguments.done",
                                    item_id=item["id"], output_index=index,
                                    arguments=item["arguments"])]
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        status = _status(finish_reason)
        final = self._response(status, items, results, finish_reason)
        out.append(self._event(f"response.{status}", response=final))
        return out

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None,
              index: int = 0, logprobs: Any = None,
              prompt_logprobs: Any = None) -> dict[str, Any] | None:
        events = self.events(text, finish_reason)
        return events[-1] if events else None

    def chunk_sse(self, text: str, token_ids: list[int], finish_reason: str | None,
                  index: int = 0, logprobs: Any = None, prompt_logprobs: Any = None
                  ) -> bytes | None:
        events = self.events(text, finish_reason, self.results)
        return b"".join(sse(e) for e in events) or None

    results: list[Result] | None = None  # the request's results (usage in response.completed)
