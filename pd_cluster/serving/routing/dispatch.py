"""Runs one request on the engines: P and D in parallel (or one colocated engine), with retries.

The client sees a single stream. The first token comes from whichever leg delivers it first
(normally P: max_tokens=1, then it ships the KV to D); everything after it comes from D. Each
engine streams incremental deltas numbered per request: they are appended to that leg's
output (a gap or repeat fails the leg), and the client gets what it has not been sent yet.
An engine failure before anything was sent retries on another pair; after that the stream
ends with an error.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, AsyncIterator

from pd_cluster.serving.routing.engine_pool import EnginePool, EngineState, NoHealthyEngine
from pd_cluster.serving.routing.legs import EngineFailed, GenerateJob, Leg, Sent, StreamEvent
from pd_cluster.serving.api.errors import APIError, internal_error, invalid_request, timeout_error
from pd_cluster.driver.messages import (ERROR_INVALID_REQUEST, ERROR_TIMEOUT, ROLE_COLOCATED,
                                        ROLE_DECODE, ROLE_PREFILL, EngineDelta, EngineRequest,
                                        decode_deltas, encode)
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.peer_linker import PeerLinker

logger = logging.getLogger(__name__)
_REPLACEMENT_CHAR = "\ufffd"


class Dispatcher:
    def __init__(self, pool: EnginePool, mode: str, metrics: ProxyMetrics, max_retries: int,
                 max_migrations: int = 0):
        self.pool, self.mode, self.metrics = pool, mode, metrics
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
            if job.prefix is not None and job.leads_prefix:
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
                legs = self._resume(job, excluded, sent, rid) if sent.any else \
                    self._plan(job, excluded, rid, None if attempt else pinned)
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
            except EngineFailed as e:
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

    def _resume(self, job: GenerateJob, excluded: set[str], sent: Sent, rid: str) -> list[Leg]:
        """One engine continues the request from what the client already has."""
        if len(sent.token_ids) >= (job.params.max_tokens or 0):
            return []
        roles = (ROLE_COLOCATED,) if self.mode == "colocated" else (ROLE_DECODE, ROLE_PREFILL)
        engine = None
        for role in roles:  # decode engines first: they are sized for long generations
            candidates = self.pool.available(role, excluded)
            if candidates:
                engine = self.pool.pick(role, candidates=candidates)
                break
        if engine is None:
            raise NoHealthyEngine("no healthy engine left to resume on")
        # The client has the prompt's logprobs already (nothing is sent before them).
        params = dataclasses.replace(job.params, prompt_logprobs=None)
        request = EngineRequest(rid, job.prompt_token_ids, params,
                                timeout=max(1.0, job.deadline - time.monotonic()),
                                resume_token_ids=list(sent.token_ids),
                                resume_text_len=len(sent.text))
        sent.first_from_prefill = False
        leg = Leg(engine, request, len(job.prompt_token_ids) + (job.params.max_tokens or 1),
                  final=True, token_ids=list(sent.token_ids), text=sent.text,
                  logprobs=list(sent.logprobs))
        return [leg]

    # ---- plan: which engines, with which instructions -------------------------------------
    def _plan(self, job: GenerateJob, excluded: set[str], rid: str,
              pinned: str | None = None) -> list[Leg]:
        n_prompt = len(job.prompt_token_ids)
        max_tokens = job.params.max_tokens or 1
        base = dict(request_id=rid, prompt_token_ids=job.prompt_token_ids,
                    timeout=max(1.0, job.deadline - time.monotonic()))

        def whole(e: EngineState) -> list[Leg]:  # one engine computes the whole answer
            return [Leg(e, EngineRequest(params=job.params, **base),
                         n_prompt + max_tokens, final=True)]

        if pinned is not None:
            engine = next((e for role in (ROLE_DECODE, ROLE_PREFILL, ROLE_COLOCATED)
                           for e in self.pool.available(role, excluded) if e.name == pinned),
                          None)
            if engine is not None:  # its prefix cache holds the prompt's full blocks
                self.metrics.shared_prefills.inc()
                return whole(engine)
        if self.mode == "colocated":
            return whole(self.pool.pick(ROLE_COLOCATED, excluded))
        prefills = self.pool.available(ROLE_PREFILL, excluded)
        decodes = self.pool.available(ROLE_DECODE, excluded)
        if not prefills and not decodes:
            raise NoHealthyEngine("no healthy prefill or decode engine available")
        if not decodes:  # degraded: prefill engines serve whole requests
            self.metrics.degraded.labels("no_decode").inc()
            return whole(self.pool.pick(ROLE_PREFILL, candidates=prefills))
        if not prefills:  # degraded: decode engines prefill by themselves, no KV to wait for
            self.metrics.degraded.labels("no_prefill").inc()
            return whole(self.pool.pick(ROLE_DECODE, candidates=decodes))
        if max_tokens == 1:  # P alone computes the whole answer: no KV to ship
            return whole(self.pool.pick(ROLE_PREFILL, candidates=prefills))
        d = self.pool.pick(ROLE_DECODE, candidates=decodes)
        linked = [p for p in prefills if PeerLinker.linked(p, d)]
        if not linked:  # no P holds a handshake with this D yet (it is being linked)
            self.metrics.degraded.labels("no_kv_link").inc()
            return whole(d)
        p = self.pool.pick(ROLE_PREFILL, candidates=linked)
        # min_tokens stays <= 1 so P masks EOS for token 1 exactly when D would.
        p_params = dataclasses.replace(job.params, max_tokens=1,
                                       min_tokens=min(job.params.min_tokens, 1))
        d_kv = {"do_remote_prefill": True}
        p_kv = {"do_remote_decode": True, "remote_kv_addr": d.kv_endpoint}
        return [Leg(d, EngineRequest(params=job.params, kv_transfer_params=d_kv,
                                      **base), max_tokens + 1, final=True),
                Leg(p, EngineRequest(params=p_params, kv_transfer_params=p_kv, **base),
                     n_prompt, final=False)]

    # ---- one attempt -----------------------------------------------------------------------
    async def _run(self, job: GenerateJob, legs: list[Leg], sent: Sent
                   ) -> AsyncIterator[StreamEvent]:
        q: asyncio.Queue[tuple[Leg, list[EngineDelta], Exception | None]] = asyncio.Queue()
        for leg in legs:
            self.pool.acquire(leg.engine, leg.work)
        tasks = [asyncio.create_task(self._pump(leg, q, job.deadline)) for leg in legs]
        try:
            while True:
                try:
                        leg, batch, failure = await _get(q, job.deadline)
                except asyncio.TimeoutError:
                    raise timeout_error("request timed out waiting for the engines") from None
                if failure is not None:
                    if isinstance(failure, APIError) or leg.final or not sent.any:
                        raise failure
                    continue  # P failed after its token went out: D prefills by itself
                for delta in batch:
                    if delta.error:
                        self._raise_for(leg, delta, sent)
                    leg.apply(delta)
                for event in self._events(leg, legs, job, sent):
                    yield event
                    if event.finish_reason is not None:
                        return
        finally:
            for t in tasks:
                t.cancel()
            for leg in legs:
                self.pool.release(leg.engine, leg.work)
                if not leg.finished:  # abort on every engine still holding the request
                    asyncio.ensure_future(_quietly(leg.engine.handle.abort.remote(
                        [leg.request.request_id])))

    def _events(self, leg: Leg, legs: list[Leg], job: GenerateJob, sent: Sent
                ) -> list[StreamEvent]:
        """What the client gets after ``leg`` got deltas. Output waiting for the prompt's
        logprobs (computed by P, while D may be ahead) is released with them, P's part first."""
        order = [leg]
        prompt_logprobs = None
        if job.params.prompt_logprobs is not None and not sent.prompt_logprobs_sent:
            prompt_logprobs = next((lg.prompt_logprobs for lg in legs
                                    if lg.prompt_logprobs is not None), None)
            order = sorted(legs, key=lambda lg: lg.final)
        events = []
        if leg.final and job.prefix is not None and job.leads_prefix:
            job.prefix.announce(leg.engine.name)  # it has the prompt's KV now
        for lg in order:
            if lg.last is None:
                continue
            event = self._advance(lg, job, sent, prompt_logprobs)
            if event is not None:
                self.metrics.proxy_overhead.observe(max(time.time() - lg.last.emit_time, 0.0))
                events.append(event)
                if event.finish_reason is not None:
                    break
        return events

    def _advance(self, leg: Leg, job: GenerateJob, sent: Sent,
                 prompt_logprobs: list[dict[int, float] | None] | None) -> StreamEvent | None:
        """What the client gets next from ``leg``, given everything it produced so far."""
        last = leg.last
        assert last is not None
        if job.params.prompt_logprobs is not None and not sent.prompt_logprobs_sent:
            if prompt_logprobs is None:
                return None  # nothing goes out before the prompt's logprobs
        else:
            prompt_logprobs = None
        if not leg.final:
            if sent.any:
                return None  # D got there first: P's token only matters for the KV it ships
            done = leg.finished and last.finish_reason == "stop" and job.params.min_tokens <= 1
            if leg.finished and not done and last.finish_reason != "length":
                return None  # P stopped under a larger min_tokens: D has the real answer
            sent.first_from_prefill = True
        else:
            done = leg.finished
            if sent.first_from_prefill and leg.token_ids:
                sent.first_from_prefill = False  # compare once: D must continue P's token
                if leg.token_ids[0] != sent.token_ids[0]:
                    # D recomputed the prompt (its KV did not arrive) and disagrees with the
                    # token the client already has: never continue a different sequence.
                    # The request resumes elsewhere from the client's tokens.
                    self.metrics.first_token_mismatch.inc()
                    raise EngineFailed(leg.engine, f"its first token {leg.token_ids[0]} differs "
                                                   f"from the prefill engine's "
                                                   f"{sent.token_ids[0]}", dead=False)
        new_tokens = leg.token_ids[len(sent.token_ids):]
        end = len(leg.text)
        if not done and job.params.stop:
            # Hold back what could be the start of a stop string: once sent, text cannot be
            # taken back if the engine later truncates it at the match (as vLLM does).
            end = max(end - (job.params.max_stop_len - 1), len(sent.text))
        if not leg.final and not done and _REPLACEMENT_CHAR in leg.text:
            new_text = ""  # P flushed a partial character; D's text will carry it whole
        else:
            new_text = leg.text[len(sent.text):end]
        if not new_tokens and not new_text and not done:
            return None
        new_logprobs = None
        if job.params.logprobs is not None:  # leg.logprobs runs parallel to leg.token_ids
            new_logprobs = leg.logprobs[len(sent.token_ids):len(leg.token_ids)]
            sent.logprobs.extend(new_logprobs)
        sent.token_ids.extend(new_tokens)
        sent.text += new_text
        sent.prompt_logprobs_sent = sent.prompt_logprobs_sent or prompt_logprobs is not None
        reason = (last.finish_reason or "stop") if done else None
        return StreamEvent(new_text, new_tokens, reason, last.num_prompt_tokens,
                           last.num_cached_tokens, new_logprobs, prompt_logprobs)

    def _raise_for(self, leg: Leg, d: EngineDelta, sent: Sent) -> None:
        if d.error_type == ERROR_INVALID_REQUEST:  # the request's fault: engine stays healthy
            raise invalid_request(d.error or "invalid request")
        if d.error_type == ERROR_TIMEOUT:
            raise timeout_error(f"{leg.engine.name}: {d.error}")
        raise EngineFailed(leg.engine, d.error or "engine error", dead=False)

    async def _pump(self, leg: Leg, q: asyncio.Queue, deadline: float) -> None:
        """Feed one engine's stream into the shared queue; every outcome becomes an item."""
        try:  # one bound for the whole stream (not a wait_for task per item: the hot path)
            await asyncio.wait_for(self._pump_items(leg, q),
                                   max(deadline - time.monotonic(), 0.001))
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            q.put_nowait((leg, [], timeout_error(f"{leg.engine.name}: no output in time")))
        except StopAsyncIteration:
            q.put_nowait((leg, [], EngineFailed(leg.engine, "stream ended early", dead=False)))
        except EngineFailed as e:
            q.put_nowait((leg, [], e))
        except Exception as e:  # noqa: BLE001 - classified: actor death vs anything else
            q.put_nowait((leg, [], EngineFailed(leg.engine, f"{type(e).__name__}: {e}",
                                                dead=_is_actor_death(e))))

    @staticmethod
    async def _pump_items(leg: Leg, q: asyncio.Queue) -> None:
        gen = leg.engine.handle.generate.options(num_returns="streaming").remote(
            encode(leg.request))
        while True:
            batch = decode_deltas(await (await gen.__anext__()))
            if not batch:
                raise EngineFailed(leg.engine, "empty delta batch", dead=False)
            q.put_nowait((leg, batch, None))
            if batch[-1].finished:
                return


async def _get(q: asyncio.Queue, deadline: float) -> Any:
    if _timeout_at is not None:  # Python 3.11+: a cheap deadline, no extra task per item
        async with _timeout_at(deadline):
            return await q.get()
    return await asyncio.wait_for(q.get(), max(deadline - time.monotonic(), 0.001))


_timeout_at = getattr(asyncio, "timeout_at", None)  # loop.time() is time.monotonic()


def _is_actor_death(e: BaseException) -> bool:
    import ray.exceptions
    return isinstance(e, ray.exceptions.RayActorError)


async def _quietly(ref: Any, timeout: float = 10.0) -> None:
    # An abort sent to a dead or restarting actor fails; nobody needs its result.
    try:
        await asyncio.wait_for(ref, timeout)
    except Exception:  # noqa: BLE001 - best effort only
        pass
