"""OpenAI API request/response models (pydantic) and their mapping to SamplingParams.

Requests are parsed strictly from the raw JSON body (wrong types are 400s, not coerced).
Fields this server does not know are ignored and logged once per name, as vLLM does
(unknown_fields.py: a bounded memory of names); vLLM's common extensions (top_k, min_tokens,
ignore_eos, stop_token_ids, ...) are accepted; known features this server does not implement
are rejected with the parameter named, never silently ignored.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from pd_cluster.chat import check_content_parts
from pd_cluster.generation_defaults import GenerationDefaults
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.api.errors import APIError, invalid_request
from pd_cluster.serving.api.unknown_fields import UnknownFields
from pd_cluster.serving.api.structured import request_params
from pd_cluster.serving.api.tools import ToolPlan
from pd_cluster.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

_STRICT = ConfigDict(extra="forbid", strict=True)
_LENIENT = ConfigDict(extra="allow", strict=True)  # unknown fields: ignored, logged once
MAX_N = 64  # choices per prompt in one request
# Sampling fields a request may leave unset (None): SamplingParams' own default then applies.
_UNSET_DEFAULTS = ("temperature", "top_p", "top_k", "repetition_penalty")


class StreamOptions(BaseModel):
    model_config = _LENIENT
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk (vLLM, guidellm)


class _SamplingFields(BaseModel):
    model_config = _LENIENT
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    repetition_penalty: float | None = None  # unset: the generation config's, else 1.0
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False  # add prompt_token_ids / token_ids to the response
    # Output constraints (serving/api/structured.py): vLLM's field and OpenAI's
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> dict[str, Any]:
        """Params whose value asks for a feature we do not have (name -> value)."""
        return {}

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise invalid_request("logit_bias: keys must be token ids", "logit_bias") from None

    def logprobs_k(self) -> int | None:
        """Top-k logprobs asked for (0: the sampled token's only), or None."""
        return None

    def prompt_logprobs_k(self) -> int | None:
        """Top-k logprobs asked for each prompt token, or None."""
        return None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """What the output must match (a 400 naming the field if it cannot)."""
        return request_params(self.structured_outputs, self.response_format)

    def sampling_params(self, max_tokens: int,
                        defaults: GenerationDefaults | None = None) -> SamplingParams:
        """The request's SamplingParams; ``defaults`` (the generation config's) fill the
        sampling fields it leaves unset."""
        for name, value in self.unsupported().items():
            raise invalid_request(f"{name}={value!r} is not supported by this server", name)
        if isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise invalid_request(f"n: must be an integer in [1, {MAX_N}], got {self.n!r}", "n")
        kwargs: dict[str, Any] = dict(  # n > 1: the proxy runs n requests (choices.py)
            max_tokens=max_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=self._logit_bias(), logprobs=self.logprobs_k(),
            prompt_logprobs=self.prompt_logprobs_k(),
            structured_outputs=self.structured_outputs_params())
        for name in _UNSET_DEFAULTS:
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if defaults is not None:
            kwargs = defaults.fill(kwargs)
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:  # "max_tokens must be >= 1 ..." -> 400, param max_tokens
            raise invalid_request(str(e)) from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_k(self) -> int | None:
        return self.logprobs if self.echo else None  # echo shows the prompt's logprobs too

    def unsupported(self) -> dict[str, Any]:
        out = super().unsupported()
        if self.suffix is not None:
            out["suffix"] = self.suffix
        if self.best_of not in (None, 1):
            out["best_of"] = self.best_of
        return out


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # e.g. tool_calls: null from clients
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:  # "images are not supported", not "not a string"
        return check_content_parts(value)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    _tools: ToolPlan | None = PrivateAttr(None)

    def logprobs_k(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs: needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def use_tools(self, plan: ToolPlan | None) -> None:
        """The tool handling decided by the proxy (tools.tool_plan): it constrains the output."""
        self._tools = plan

    @property
    def tool_plan(self) -> ToolPlan | None:
        return self._tools

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        own = super().structured_outputs_params()
        tools = self._tools.constraint() if self._tools is not None else None
        if tools is None:
            return own
        if own is not None:
            raise invalid_request("tool_choice: required or a named function cannot be "
                                  "combined with response_format or structured_outputs",
                                  "tool_choice")
        return tools  # compiled by the proxy's grammar check (grammar_check.py)


def parse_request(model: type[_SamplingFields], raw: bytes, unknown: UnknownFields) -> Any:
    """Parse a raw JSON body into ``model``; every problem becomes a 400 naming the param.
    Fields it does not know are ignored and noted in ``unknown`` (logged once per name)."""
    try:
        req = model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise invalid_request(f"Malformed JSON body: {err.get('msg')}", None,
                                  "invalid_json") from None
        if err["type"] == "model_type" or not err["loc"]:
            raise invalid_request("The request body must be a JSON object", None) from None
        loc = ".".join(str(x) for x in err["loc"] if not isinstance(x, int) or x)
        param = str(err["loc"][0])
        msg = ("unknown parameter" if err["type"] == "extra_forbidden"
               else str(err["ctx"]["error"]) if err["type"] == "value_error"
               else err["msg"])
        raise invalid_request(f"{loc}: {msg}", param) from None
    unknown.note(req.model_extra or {})
    if req.stream_options is not None:
        unknown.note(req.stream_options.model_extra or {}, "stream_options.")
    return req


# ---- responses ---------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: Any = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut | None = None
    delta: ChatMessageOut | None = None
    logprobs: Any = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pd-cluster"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


__all__ = ["APIError", "CompletionRequest", "ChatCompletionRequest", "parse_request", "Usage",
           "CompletionResponse", "CompletionChoice", "ChatCompletionResponse", "ChatChoice",
           "ChatMessageOut", "ModelCard", "ModelList", "StreamOptions"]
