"""The state of one request inside the proxy: the job, each engine's leg, what was sent.

A GenerateJob is what the client asked for (one choice). A Leg is one engine's part of one
attempt at it: its incremental deltas are appended in order (a gap or repeat is that engine's
failure). Sent is what the client already has; it survives retries and migrations, so nothing
is sent twice. What the client gets next is computed from a leg and Sent without changing
either (stream_diff.next_output), then committed to Sent (Sent.commit).
"""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Callable

from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.routing.engine_pool import EngineState
from pd_cluster.driver.messages import EngineDelta, EngineRequest


class SharedPrefix:
    """The choices of one prompt (n > 1) share its prefill: the leader (the first choice) runs
    as usual (P, then D); the others wait until its first output, then run on the engine that
    holds the prompt's KV, where the prefix cache serves every full block (ref counts, no copy)
    and only the tail of the last block is computed again."""

    def __init__(self, leader: str) -> None:
        self.leader = leader  # request id of the choice that prefills the prompt
        self._ready = asyncio.Event()
        self.engine: str | None = None  # None: the others plan as usual

    def announce(self, engine: str | None) -> None:
        if not self._ready.is_set():
            self.engine = engine
            self._ready.set()

    async def wait(self, deadline: float) -> str | None:
        try:
            await asyncio.wait_for(self._ready.wait(), max(deadline - time.monotonic(), 0.001))
        except asyncio.TimeoutError:
            return None
        return self.engine


@dataclass
class GenerateJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline: float  # time.monotonic() bound for the whole request
    prefix: SharedPrefix | None = None  # shared with this prompt's other choices
    route: str = ""  # where the planner sent it and why (the access log shows it)

    @property
    def leads_prefix(self) -> bool:
        """This choice prefills the shared prompt (and announces where its KV is)."""
        return self.prefix is not None and self.prefix.leader == self.request_id


@dataclass
class StreamEvent:
    text: str  # new text since the previous event
    token_ids: list[int]  # new token ids since the previous event
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float] | None] | None = None  # per new token, when asked for
    prompt_logprobs: list[dict[int, float] | None] | None = None  # in the first event, if asked


class EngineFailed(Exception):
    """``reported``: the pool was told of this failure already (a lost token link fails
    every leg on it: one failure of the engine, not one per leg)."""

    def __init__(self, engine: EngineState, message: str, dead: bool, reported: bool = False):
        super().__init__(f"{engine.name}: {message}")
        self.engine, self.dead, self.reported = engine, dead, reported


class EngineDraining(EngineFailed):
    """The leg was moved off an engine that is draining (scaled down or switching role): not
    the engine's failure; the request continues elsewhere, uncounted against its retries."""

    def __init__(self, engine: EngineState, message: str = "draining"):
        super().__init__(engine, message, dead=False)


class LegKind(enum.Enum):
    """What one engine does for an attempt (the P/D vocabulary, one name per part)."""
    WHOLE = "whole"  # computes the whole answer (colocated, degraded, resumed, n-sibling)
    PREFILL = "prefill"  # P: computes the prompt and its first token, ships the KV to D
    DECODE = "decode"  # D: gets the KV from P, generates the rest (and the first token again)

    @property
    def ends_request(self) -> bool:
        """Its finish is the request's finish (P's token only starts it)."""
        return self is not LegKind.PREFILL


@dataclass
class Leg:
    engine: EngineState
    request: EngineRequest
    work: int
    kind: LegKind
    finished: bool = False
    # What this engine produced so far, assembled from its deltas (appended, never re-sent).
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float] | None] = field(default_factory=list)  # if asked for
    prompt_logprobs: list[dict[int, float] | None] | None = None  # from whoever computed it
    last: EngineDelta | None = None
    next_seq: int = 0
    failure: Exception | None = None  # why this leg ended without finishing (see inbox.py)
    # Told of the leg's first delta (the planner measures prefill rates and link latency).
    on_first: Callable[[EngineDelta], None] | None = None
    # Told when it fails (its engine's load stops counting its prefill as queued).
    on_fail: Callable[[], None] | None = None
    # Told of every delta once applied (the engine's DecodeWatch follows a decoding leg).
    on_delta: Callable[[EngineDelta], None] | None = None

    def fail(self, error: Exception) -> None:
        """End the leg unfinished: ``error`` is why."""
        self.failure = error
        if self.on_fail is not None:
            self.on_fail()

    def apply(self, delta: EngineDelta) -> None:
        """Append one incremental delta; a gap or repeat is the engine's failure."""
        if delta.seq != self.next_seq:
            raise EngineFailed(self.engine, f"delta {delta.seq} of {delta.request_id} arrived, "
                                            f"expected {self.next_seq}: lost or reordered",
                               dead=False)
        if self.next_seq == 0 and self.on_first is not None:
            self.on_first(delta)
        self.next_seq += 1
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finished, self.last = delta.finished, delta
        if self.on_delta is not None:
            self.on_delta(delta)


@dataclass
class Output:
    """What the client gets next from one leg: computed from the leg and Sent, not applied."""
    event: StreamEvent | None  # None: nothing to send yet
    # The client's first token came from P (True), or D's first token was checked against it
    # (False); None: no change.
    first_token_from_prefill: bool | None = None


@dataclass
class Sent:
    """What the client has been sent so far (across retries nothing is sent twice)."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float] | None] = field(default_factory=list)  # if asked for
    prompt_logprobs_sent: bool = False
    # The first token came from P and D has not confirmed it yet (D must continue P's token).
    first_token_from_prefill: bool = False

    @property
    def any(self) -> bool:
        return bool(self.token_ids or self.text)

    def commit(self, out: Output) -> None:
        """The client is sent ``out``: record it."""
        if out.first_token_from_prefill is not None:
            self.first_token_from_prefill = out.first_token_from_prefill
        ev = out.event
        if ev is None:
            return
        if ev.logprobs is not None:
            self.logprobs.extend(ev.logprobs)
        self.token_ids.extend(ev.token_ids)
        self.text += ev.text
        self.prompt_logprobs_sent = self.prompt_logprobs_sent or ev.prompt_logprobs is not None


__all__ = ["EngineDraining", "EngineFailed", "GenerateJob", "Leg", "LegKind", "Output", "Sent",
           "SharedPrefix", "StreamEvent"]
