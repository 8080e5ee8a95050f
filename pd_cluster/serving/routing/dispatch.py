"""Runs one request on the engines: P and D in parallel (or one colocated engine), with retries.

The client sees a single stream. The first token comes from whichever leg delivers it first
(normally P: max_tokens=1, then it ships the KV to D); everything after it comes from D. Each
engine streams incremental deltas numbered per request: they are appended to that leg's
output as they arrive (inbox.py; a gap or repeat fails the leg), and the client gets what it
has not been sent yet (stream_diff.py). An engine failure before anything was sent retries on
another pair; after that the request migrates: another engine resumes from what was sent.

Deltas arrive over the engines' token path (token_channel.py: frames on a socket), the one
path tokens take; requests go out on the same channel.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

import msgspec

from pd_cluster.serving.api.errors import APIError, internal_error, timeout_error
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.engine_pool import EnginePool, NoHealthyEngine
from pd_cluster.serving.routing.inbox import AttemptInbox
from pd_cluster.serving.routing.legs import (EngineDraining, EngineFailed, GenerateJob, Leg,
                                             Output, Sent, StreamEvent)
from pd_cluster.serving.routing.planner import Planner
from pd_cluster.serving.routing.stream_diff import next_output, waiting_prompt_logprobs
from pd_cluster.serving.routing.token_channel import TokenChannel

logger = logging.getLogger(__name__)

__all__ = ["Dispatcher", "GenerateJob", "StreamEvent"]


class Dispatcher:
    def __init__(self, pool: EnginePool, mode: str, metrics: ProxyMetrics,
                 channel: TokenChannel, max_retries: int, max_migrations: int = 0,
                 stream_interval: int = 1):
        self.pool, self.metrics, self.channel = pool, metrics, channel
        self.stream_interval = stream_interval  # tokens per event at least (after the first)
        self.planner = Planner(pool, mode, metrics)
        self.max_retries, self.max_migrations = max_retries, max_migrations

    async def stream(self, job: GenerateJob) -> AsyncIterator[StreamEvent]:
        """The request's events. An engine that fails before any output is replaced (a
        retry); one that fails after output is migrated: another engine resumes from the
        prompt plus the tokens sent so far, and the client's stream goes on unbroken."""
        sent = Sent()
        excluded: set[str] = set()
        pinned = None  # a sibling choice runs where its prompt's KV already is
        if job.prefix is not None and not job.leads_prefix:
            pinned = await job.prefix.wait(job.deadline)
        try:
            async for event in self._attempts(job, sent, excluded, pinned):
                yield event
        finally:
            if job.leads_prefix:
                job.prefix.announce(None)  # no KV to share (failed, or ended before output)

    async def _attempts(self, job: GenerateJob, sent: Sent, excluded: set[str],
                        pinned: str | None) -> AsyncIterator[StreamEvent]:
        retries = migrations = 0
        while True:
            # Each attempt has its own engine-side id (the proxy's id, suffixed after the
            # first): the abort of a failed attempt may still be on its way to an engine that
            # the next attempt uses, and must not hit the new one.
            attempt = retries + migrations
            rid = job.request_id if not attempt else f"{job.request_id}.{attempt}"
            try:
                if sent.any:
                    legs = self.planner.resume(job, excluded, sent, rid)
                    sent.commit(Output(None, first_token_from_prefill=False))
                else:
                    legs = self.planner.plan(job, excluded, rid, None if attempt else pinned)
            except NoHealthyEngine as e:
                if sent.any:
                    raise internal_error(f"cannot resume the request: {e}", status=503) from None
                raise APIError(503, str(e), "service_unavailable") from None
            if not legs:  # everything was generated before the engine failed
                yield StreamEvent("", [], "length")
                return
            try:
                async for event in self._run(job, legs, sent):
                    yield event
                return
            except EngineDraining as e:  # moved off: not a failure, not counted
                self.metrics.drain_moves.inc()
                logger.info("%s: moved off draining %s after %d tokens", job.request_id,
                            e.engine.name, len(sent.token_ids))
                continue
            except EngineFailed as e:
                if e.dead or not e.reported:  # a lost link counts once, not once per leg
                    self.pool.mark_failed(e.engine, str(e), dead=e.dead)
                excluded.add(e.engine.name)
                out_of_time = time.monotonic() >= job.deadline
                if sent.any:
                    if migrations >= self.max_migrations or out_of_time:
                        raise internal_error(f"engine failure: {e}", status=502) from None
                    migrations += 1
                    self.metrics.migrations.inc()
                    logger.warning("%s: %s failed after %d tokens; migrating: %s",
                                   job.request_id, e.engine.name, len(sent.token_ids), e)
                    continue
                if retries >= self.max_retries or out_of_time:
                    raise internal_error(f"engine failure: {e}", status=502) from None
                retries += 1
                self.metrics.retries.inc()
                logger.warning("%s: retrying on another engine after: %s", job.request_id, e)

    # ---- one attempt -----------------------------------------------------------------------
    async def _run(self, job: GenerateJob, legs: list[Leg], sent: Sent
                   ) -> AsyncIterator[StreamEvent]:
        inbox = AttemptInbox()
        for leg in legs:
            self.pool.acquire(leg.engine, leg.work)
        try:
            for leg in legs:
                self._start(leg, inbox)
            while True:
                try:
                    changed = await inbox.changed(job.deadline)
                except asyncio.TimeoutError:
                    raise timeout_error("request timed out waiting for the engines") from None
                for leg in changed:
                    for event in self._events(leg, legs, job, sent):
                        yield event
                        if event.finish_reason is not None:
                            return
                    failure = leg.failure
                    if failure is not None:
                        if isinstance(failure, APIError) or leg.kind.ends_request \
                                or not sent.any:
                            raise failure
                        # P failed after its token went out: D prefills by itself
        finally:
            inbox.close()
            for leg in legs:
                self.channel.unregister(leg)
                self.pool.release(leg.engine, leg.work)
                if not leg.finished and not self.channel.abort(leg):
                    # abort on every engine still holding the request
                    asyncio.ensure_future(_quietly(leg.engine.handle.abort.remote(
                        [leg.request.request_id])))

    def _events(self, leg: Leg, legs: list[Leg], job: GenerateJob, sent: Sent
                ) -> list[StreamEvent]:
        """What the client gets after ``leg`` got deltas, committed to ``sent``. Output
        waiting for the prompt's logprobs is released with them, P's part first."""
        waiting, _ = waiting_prompt_logprobs(job, legs, sent)
        order = sorted(legs, key=lambda lg: lg.kind.ends_request) if waiting else [leg]
        if leg.kind.ends_request and job.leads_prefix and leg.last is not None:
            job.prefix.announce(leg.engine.name)  # it has the prompt's KV now
        events = []
        for lg in order:
            waiting, prompt_logprobs = waiting_prompt_logprobs(job, legs, sent)
            try:
                out = next_output(lg, job, sent, prompt_logprobs, waiting,
                                  self.stream_interval)
            except EngineFailed:
                self.metrics.first_token_mismatch.inc()
                raise
            if out is None:
                continue
            sent.commit(out)
            if out.event is not None:
                if lg.last is not None:  # the delta the event came from
                    self.metrics.proxy_overhead.observe(max(time.time() - lg.last.emit_time,
                                                            0.0))
                events.append(out.event)
                if out.event.finish_reason is not None:
                    break
        return events

    # ---- where a leg's deltas come from -------------------------------------------------------
    def _start(self, leg: Leg, inbox: AttemptInbox) -> None:
        """Route the leg's deltas to ``inbox`` and send its request to its engine, both over
        the token channel; a failure to do so ends up in ``inbox`` too."""
        try:
            if not self.channel.register(leg, inbox):
                raise EngineFailed(leg.engine, "no token path to it (yet)", dead=False)
            request = msgspec.structs.replace(leg.request, output_session=self.channel.session)
            self.channel.submit(leg, request)  # over the engine's request socket
        except EngineFailed as e:
            inbox.fail(leg, e)


async def _quietly(ref: Any, timeout: float = 10.0) -> None:
    # An abort sent to a dead or restarting actor fails; nobody needs its result.
    try:
        await asyncio.wait_for(ref, timeout)
    except Exception:  # noqa: BLE001 - best effort only
        pass
