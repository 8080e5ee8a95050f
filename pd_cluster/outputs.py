"""What the engine hands back per request: cumulative output plus this step's delta."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    logprobs: list[dict[int, float] | None] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, float] | None] | None = None  # when logprobs were asked
    error: str | None = None  # why the engine ended the request (finish_reason "abort")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Per prompt token (None for the first), once, when asked for and computed by this engine.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
