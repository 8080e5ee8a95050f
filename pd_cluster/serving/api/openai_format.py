"""Turns dispatcher events into OpenAI response bodies and SSE chunks (completions and chat)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pd_cluster.serving.api.logprobs_format import TokenText, chat_logprobs, completion_logprobs
from pd_cluster.serving.api.openai_schemas import (ChatChoice, ChatCompletionResponse,
                                                   ChatMessageOut, CompletionChoice,
                                                   CompletionResponse, PromptTokensDetails,
                                                   Usage)

# Extension fields left out of a body when unset, so plain OpenAI clients see plain bodies.
_OPTIONAL = ("token_ids", "prompt_token_ids", "usage", "message", "delta")


_json = msgspec.json.Encoder()  # ~6x json.dumps per streamed chunk (UTF-8, not \u-escaped)


def sse(payload: dict[str, Any] | str) -> bytes:
    if isinstance(payload, str):
        return f"data: {payload}\n\n".encode()
    return b"data: " + _json.encode(payload) + b"\n\n"


def _dump(model: Any) -> dict[str, Any]:
    out = model.model_dump()
    _drop_none(out)
    return out


def _drop_none(d: dict[str, Any]) -> None:
    for key in _OPTIONAL:
        if key in d and d[key] is None:
            del d[key]
    for choice in d.get("choices", []):
        _drop_none(choice)


@dataclass
class Result:
    """A finished (or finishing) request, accumulated from events."""
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float] | None] = field(default_factory=list)  # if asked for
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with echo and logprobs


def usage(results: list[Result]) -> Usage:
    """One request's usage: each distinct prompt counted once, every choice's output."""
    prompts: dict[int, Result] = {id(r.prompt_token_ids): r for r in results}
    n_prompt = sum(len(r.prompt_token_ids) for r in prompts.values())
    n_out = sum(len(r.token_ids) for r in results)
    cached = sum(r.num_cached_tokens for r in prompts.values())
    return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class Formatter:
    """One request's bodies. Subclasses: text completions and chat completions."""

    def __init__(self, request_id: str, model: str, return_token_ids: bool,
                 logprobs: int | None = None, token_text: TokenText | None = None,
                 echo: list[tuple[str, list[int]]] | None = None):
        self.id, self.model, self.return_token_ids = request_id, model, return_token_ids
        self.created = int(time.time())
        self.logprobs, self.token_text = logprobs, token_text  # top-k asked for, or None
        self._offsets: dict[int, int] = {}  # choice -> text offset of its next token
        # Completions' echo: each choice's prompt (text, ids), put before its output.
        self.echo = echo
        self._echoed: set[int] = set()
        self._head_bytes: bytes | None = None

    def opening_chunks(self, num_choices: int = 1) -> list[dict[str, Any]]:
        return []

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None,
              index: int = 0, logprobs: Any = None,
              prompt_logprobs: Any = None) -> dict[str, Any] | None:
        raise NotImplementedError

    def chunk_sse(self, text: str, token_ids: list[int], finish_reason: str | None,
                  index: int = 0, logprobs: Any = None, prompt_logprobs: Any = None
                  ) -> bytes | None:
        """``chunk`` as an SSE event. A plain chunk (no logprobs, token ids or echo: what
        nearly every streamed chunk is) is filled into pre-encoded bytes, no dict per token."""
        if self._plain and (self.echo is None or index in self._echoed):
            if not text and finish_reason is None and not token_ids:
                return None
            reason = b"null" if finish_reason is None else _json.encode(finish_reason)
            return b"".join((self._head, str(index).encode(), self._plain_body(text),
                             b',"logprobs":null,"finish_reason":', reason, b"}]}\n\n"))
        chunk = self.chunk(text, token_ids, finish_reason, index, logprobs, prompt_logprobs)
        return None if chunk is None else sse(chunk)

    @property
    def _plain(self) -> bool:
        return self.logprobs is None and not self.return_token_ids

    @property
    def _head(self) -> bytes:
        if self._head_bytes is None:  # every chunk of the request starts the same way
            self._head_bytes = b"".join((
                b'data: {"id":', _json.encode(self.id), b',"object":',
                _json.encode(self.chunk_object), b',"created":', str(self.created).encode(),
                b',"model":', _json.encode(self.model), b',"choices":[{"index":'))
        return self._head_bytes

    def _plain_body(self, text: str) -> bytes:
        raise NotImplementedError

    def _logprobs(self, token_ids: list[int], logprobs: Any, index: int) -> Any:
        return None

    def usage_chunk(self, results: list[Result]) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_object, "created": self.created,
                "model": self.model, "choices": [], "usage": usage(results).model_dump()}

    def full(self, results: list[Result]) -> dict[str, Any]:
        raise NotImplementedError

    chunk_object = ""


class CompletionFormatter(Formatter):
    chunk_object = "text_completion"

    def _plain_body(self, text: str) -> bytes:
        return b',"text":' + _json.encode(text)

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None,
              index: int = 0, logprobs: Any = None,
              prompt_logprobs: Any = None) -> dict[str, Any] | None:
        scored_ids = token_ids
        if self.echo is not None and index not in self._echoed:  # the prompt goes first
            self._echoed.add(index)
            prompt_text, prompt_ids = self.echo[index]
            text, scored_ids = prompt_text + text, prompt_ids + token_ids
            logprobs = _echo_logprobs(prompt_ids, prompt_logprobs, logprobs)
        if not text and finish_reason is None and not self.return_token_ids and not token_ids:
            return None
        choice: dict[str, Any] = {"index": index, "text": text,
                                  "logprobs": self._logprobs(scored_ids, logprobs, index),
                                  "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [choice]}

    def full(self, results: list[Result]) -> dict[str, Any]:
        ids = self.return_token_ids
        return _dump(CompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage(results),
            prompt_token_ids=results[0].prompt_token_ids if ids else None,
            choices=[self._choice(i, r) for i, r in enumerate(results)]))

    def _choice(self, i: int, r: Result) -> CompletionChoice:
        text, scored_ids, logprobs = r.text, r.token_ids, r.logprobs
        if self.echo is not None:
            prompt_text, prompt_ids = self.echo[i]
            text, scored_ids = prompt_text + text, prompt_ids + r.token_ids
            logprobs = _echo_logprobs(prompt_ids, r.prompt_logprobs, logprobs)
        return CompletionChoice(index=i, text=text, finish_reason=r.finish_reason,
                                logprobs=self._logprobs(scored_ids, logprobs, i),
                                token_ids=r.token_ids if self.return_token_ids else None)

    def _logprobs(self, token_ids: list[int], logprobs: Any, index: int) -> Any:
        if self.logprobs is None or self.token_text is None or logprobs is None:
            return None
        out = completion_logprobs(token_ids, logprobs, self.token_text,
                                  self._offsets.get(index, 0))
        self._offsets[index] = self._offsets.get(index, 0) + sum(map(len, out["tokens"]))
        return out


def _echo_logprobs(prompt_ids: list[int], prompt_logprobs: Any, logprobs: Any) -> Any:
    """Logprobs of an echoed choice: the prompt's (the first token has none), then the output's."""
    if prompt_logprobs is None and logprobs is None:
        return None
    return list(prompt_logprobs or [None] * len(prompt_ids)) + list(logprobs or [])


class ChatFormatter(Formatter):
    chunk_object = "chat.completion.chunk"

    def _plain_body(self, text: str) -> bytes:
        return b',"delta":{"content":' + _json.encode(text) + b"}" if text else b',"delta":{}'

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None,
               token_ids: list[int] | None = None, index: int = 0,
               logprobs: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "delta": delta,
                                  "logprobs": self._logprobs(token_ids or [], logprobs, index),
                                  "finish_reason": finish_reason}
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        return {"id": self.id, "object": self.chunk_object, "created": self.created,
                "model": self.model, "choices": [choice]}

    def opening_chunks(self, num_choices: int = 1) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None, index=i)
                for i in range(num_choices)]

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None,
              index: int = 0, logprobs: Any = None,
              prompt_logprobs: Any = None) -> dict[str, Any] | None:
        if not text and finish_reason is None and not self.return_token_ids and not token_ids:
            return None
        return self._chunk({"content": text} if text else {}, finish_reason, token_ids, index,
                           logprobs)

    def _logprobs(self, token_ids: list[int], logprobs: Any, index: int) -> Any:
        if self.logprobs is None or self.token_text is None or logprobs is None:
            return None
        return chat_logprobs(token_ids, logprobs, self.token_text, self.logprobs)

    def full(self, results: list[Result]) -> dict[str, Any]:
        ids = self.return_token_ids
        return _dump(ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage(results),
            prompt_token_ids=results[0].prompt_token_ids if ids else None,
            choices=[ChatChoice(index=i, message=ChatMessageOut(content=r.text),
                                finish_reason=r.finish_reason,
                                logprobs=self._logprobs(r.token_ids, r.logprobs, i),
                                token_ids=r.token_ids if ids else None)
                     for i, r in enumerate(results)]))
