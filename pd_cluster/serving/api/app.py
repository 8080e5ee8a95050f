"""The HTTP front door: an OpenAI-compatible FastAPI app over the engine actors.

The proxy reads the body (up to proxy.max_body_bytes, else 413) and validates it, admits up
to ``max_inflight`` requests at once (up to ``max_queue`` more wait for a slot; beyond that
429 with Retry-After), then tokenizes an admitted request off the event loop (so it can count
prompt tokens and enforce max_model_len: tokenizing is bounded by admission too), and hands
token ids to the Dispatcher. Streaming
responses are primed with the first event before the SSE headers go out, so failures that
happen before any output (no engine: 503, bad request found by an engine: 400) are plain
HTTP errors and can still be retried; later failures end the stream with an error event.
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import uuid
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pd_cluster.serving.api.admin_routes import add_admin_routes
from pd_cluster.serving.api.auth import APIKeyAuth, resolve_api_keys
from pd_cluster.serving.api.choices import choice_jobs, merged
from pd_cluster.serving.api.client_watch import ClientDisconnected, ClientWatch, SSEResponse
from pd_cluster.serving.api.errors import APIError, model_not_found
from pd_cluster.serving.api.openai_format import (ChatFormatter, CompletionFormatter, Formatter,
                                                  Result, sse, usage)
from pd_cluster.serving.api.openai_schemas import (ChatCompletionRequest, CompletionRequest,
                                                   ModelCard, ModelList, parse_request)
from pd_cluster.serving.api.proxy_state import ProxyState
from pd_cluster.serving.api.request_body import read_body
from pd_cluster.serving.api.request_deadline import within_deadline
from pd_cluster.serving.api.responses import ResponsesRequest, parse_responses
from pd_cluster.serving.api.responses_format import ResponsesFormatter
from pd_cluster.serving.api.shutdown import Drain, DrainGate, until_shutdown
from pd_cluster.serving.api.tool_format import ToolChatFormatter
from pd_cluster.serving.api.tools import tool_plan
from pd_cluster.serving.api.utility_routes import add_utility_routes
from pd_cluster.serving.cluster.cluster_config import ClusterConfig
from pd_cluster.serving.routing.legs import StreamEvent
from pd_cluster.serving.routing.request_tracker import RequestTracker

logger = logging.getLogger(__name__)


async def _prompt_only(events: AsyncIterator[tuple[int, StreamEvent]]
                       ) -> AsyncIterator[tuple[int, StreamEvent]]:
    """The events of an echo with max_tokens 0: the prompt's logprobs, no generated output."""
    try:
        async for index, ev in events:
            if ev.prompt_logprobs is not None or ev.finish_reason is not None:
                yield index, StreamEvent("", [], ev.finish_reason and "length",
                                         ev.num_prompt_tokens, ev.num_cached_tokens,
                                         None, ev.prompt_logprobs)
    finally:
        await events.aclose()


async def _collect(events: AsyncIterator[tuple[int, StreamEvent]], results: list[Result],
                   tracker: RequestTracker) -> None:
    async for index, ev in events:
        tracker.on_event(ev)
        r = results[index]
        r.text += ev.text
        r.token_ids.extend(ev.token_ids)
        r.finish_reason = ev.finish_reason or r.finish_reason
        r.num_cached_tokens = ev.num_cached_tokens or r.num_cached_tokens
        if ev.logprobs is not None:
            r.logprobs.extend(ev.logprobs)
        if ev.prompt_logprobs is not None:
            r.prompt_logprobs = ev.prompt_logprobs


async def _sse(first: tuple[int, StreamEvent] | None,
               events: AsyncIterator[tuple[int, StreamEvent]], fmt: Formatter,
               results: list[Result], tracker: RequestTracker, include_usage: bool,
               continuous_usage: bool) -> AsyncIterator[bytes]:
    outcome = "aborted"  # unless we get to the end: the client went away mid-stream
    try:
        for chunk in fmt.opening_chunks(len(results)):
            yield sse(chunk)
        item = first
        try:
            while item is not None:
                index, ev = item
                tracker.on_event(ev)
                r = results[index]
                r.token_ids.extend(ev.token_ids)
                r.finish_reason = ev.finish_reason
                r.num_cached_tokens = ev.num_cached_tokens or r.num_cached_tokens
                if continuous_usage:
                    chunk = fmt.chunk(ev.text, ev.token_ids, ev.finish_reason, index,
                                      ev.logprobs, ev.prompt_logprobs)
                    if chunk is not None:
                        chunk["usage"] = usage(results).model_dump()
                        yield sse(chunk)
                else:
                    data = fmt.chunk_sse(ev.text, ev.token_ids, ev.finish_reason, index,
                                         ev.logprobs, ev.prompt_logprobs)
                    if data is not None:
                        yield data
                item = await anext(events, None)
            if include_usage:
                yield sse(fmt.usage_chunk(results))
            outcome = "success"
        except APIError as e:  # after output was sent: report in-band, then end the stream
            if e.code == "server_shutting_down":
                logger.info("%s ended mid-stream: server shutting down", fmt.id)
                outcome = "shutdown"
            else:
                logger.warning("%s failed mid-stream: %s", fmt.id, e.message)
                outcome = "error"
            yield sse(e.body())
        yield sse("[DONE]")
    finally:
        await events.aclose()  # cancels the engine streams and aborts on every engine
        tracker.close(outcome)


async def handle_generate(state: ProxyState, request: Request, chat: bool,
                          responses: bool = False) -> Response:
    """Completions, chat completions, and (``responses``) the Responses API run as a chat."""
    raw = await read_body(request, state.cfg.proxy.max_body_bytes)
    resp_req = None
    if responses:
        resp_req, req = parse_responses(raw)
    else:
        req = parse_request(ChatCompletionRequest if chat else CompletionRequest, raw,
                            state.unknown_fields)
    if req.model not in state.cfg.served_names:
        raise model_not_found(req.model, state.cfg.served_names)
    if chat:  # before tokenizing: the chat template renders the tools
        proxy = state.cfg.proxy
        req.use_tools(tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                                proxy.enable_auto_tool_choice, proxy.tool_call_parser))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    tracker = RequestTracker(state, rid)
    request.state.tracked = True
    deadline = tracker.start + state.cfg.proxy.request_timeout  # queue time included
    watch = ClientWatch(request.receive)  # one watch for the request's whole life
    try:
        adm = state.admission
        if adm.running < adm.max_inflight and not adm.queued:  # a free slot: no wait
            await tracker.admit(adm, deadline)
        else:
            await watch.guard(tracker.admit(adm, deadline))
        # Admitted: tokenizing is the request's work, off the event loop (proxy_state.py).
        prompts, texts = await watch.guard(state.tokenize(req))
        await watch.guard(state.grammar_check.check(req))  # off the loop, bounded
        tracker.count_prompt(sum(len(ids) for ids in prompts))
        fmt, jobs, events = _plan(state, req, chat, rid, prompts, texts, deadline, resp_req)
        tracker.planned(jobs)
        results = [Result(prompt_token_ids=job.prompt_token_ids) for job in jobs]
        if isinstance(fmt, ResponsesFormatter):
            fmt.results = results  # its response.completed event carries the usage
        if not req.stream:
            await watch.guard(_collect(events, results, tracker))
            tracker.close("success")
            return JSONResponse(fmt.full(results))
        first = await watch.guard(anext(events, None))
    except ClientDisconnected:
        watch.close()
        tracker.close("aborted")
        return Response(status_code=499)
    except APIError as e:
        watch.close()
        tracker.close("rejected" if e.status == 429 else
                      "shutdown" if e.code == "server_shutting_down" else
                      "client_error" if e.is_client_error else "error", e.status)
        raise
    except BaseException:
        watch.close()
        tracker.close("error")
        raise
    finally:
        if not req.stream:
            watch.close()
    opts = req.stream_options
    return SSEResponse(_sse(first, events, fmt, results, tracker,
                            bool(opts and opts.include_usage),
                            bool(opts and opts.continuous_usage_stats)), watch,
                       headers={"Cache-Control": "no-cache", "X-Request-Id": rid})


def _plan(state: ProxyState, req: Any, chat: bool, rid: str, prompts: list[list[int]],
          texts: list[str], deadline: float, responses: ResponsesRequest | None = None
          ) -> tuple[Formatter, list[Any], AsyncIterator[tuple[int, StreamEvent]]]:
    """The request's formatter, its choices' jobs and their merged events (a 400 for a
    max_tokens the prompts leave no room for)."""
    if chat:
        param = "messages"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
    else:
        param, requested = "prompt", req.max_tokens
    # echo with max_tokens 0 scores the prompt only (lm-eval's loglikelihood may ask so): the
    # engines generate one token, which nobody sees.
    prompt_only = not chat and req.echo and requested == 0
    if prompt_only:
        requested = 1
    base_seed = random.getrandbits(31)  # P and D must sample the same first token
    per_prompt = []
    for ids in prompts:
        params = req.sampling_params(state.max_tokens(requested, ids, param),
                                     state.generation_defaults)
        if not params.is_greedy and params.seed is None:
            params.seed = base_seed
        per_prompt.append((ids, params))
    fmt_cls: Any = ChatFormatter if chat else CompletionFormatter
    if chat and req.tool_plan is not None:
        fmt_cls = partial(ToolChatFormatter, req.tool_plan)
    if responses is not None:
        fmt_cls = partial(ResponsesFormatter, responses, req.tool_plan)
    jobs = choice_jobs(rid, per_prompt, req.n, deadline)
    echo = None if chat or not req.echo else [  # choices are prompt-major, n per prompt
        (texts[i // req.n], job.prompt_token_ids) for i, job in enumerate(jobs)]
    fmt = fmt_cls(rid, state.cfg.model_name, req.return_token_ids, per_prompt[0][1].logprobs,
                  state.token_text, echo)
    events = within_deadline(until_shutdown(merged(jobs, state.dispatcher.stream), state.drain),
                             deadline, rid)
    if prompt_only:
        events = _prompt_only(events)
    return fmt, jobs, events


def create_app(cfg: ClusterConfig, engines: list[tuple[str, str, Any]],
               api_keys: list[str] | None = None, starter: Any = None,
               tokenizer: Any = None) -> FastAPI:
    """The proxy app over ``engines`` = [(name, role, Ray actor handle)]. ``api_keys``: the
    keys clients must send (None: resolved from ``cfg.proxy`` and this process's environment;
    the launcher resolves them in the user's shell and hands them over through Ray).
    ``tokenizer``: proxy_state.load_tokenizer's, loaded ahead (None: loaded here)."""
    if api_keys is None:
        api_keys = resolve_api_keys(cfg.proxy.api_key, cfg.proxy.api_key_env)
    # starter: engines added at run time
    state = ProxyState(cfg, engines, starter, tokenizer)
    state.drain = Drain(lambda: state.inflight)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.pool.start()
        state.actuator.bind(asyncio.get_running_loop())
        state.start_planner()
        # Everything loaded so far (torch, transformers, the tokenizer: millions of objects)
        # lives as long as the proxy: out of the collector's sight, a full collection no
        # longer walks it (it cost ~1 ms per streamed request, measured in bench_proxy).
        gc.freeze()
        yield
        state.stop_planner()
        await state.pool.close()
        state.close()

    app = FastAPI(title="pd-cluster", lifespan=lifespan)
    app.state.proxy = state
    app.add_middleware(DrainGate, drain=state.drain)  # added first: runs after the key check
    app.add_middleware(APIKeyAuth, keys=api_keys, open_paths=cfg.proxy.open_routes,
                       on_reject=state.metrics.auth_failures.labels("api").inc)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        logger.info("%s %s -> %d: %s", request.method, request.url.path, exc.status,
                    exc.message[:200])  # rejected and logged; the server keeps serving
        if not getattr(request.state, "tracked", False):  # else the tracker counted it
            outcome = ("rejected" if exc.status == 429 else
                       "client_error" if exc.is_client_error else "error")
            state.metrics.requests.labels(outcome).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}",
                                     "server_error").body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle_generate(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle_generate(state, request, chat=True)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await handle_generate(state, request, chat=True, responses=True)

    add_utility_routes(app, state)
    add_admin_routes(app, state, bool(api_keys))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[ModelCard(id=name, max_model_len=state.max_model_len)
                               for name in cfg.served_names]).model_dump()

    @app.get("/health")
    async def health() -> JSONResponse:
        # Degraded (one role down) still serves: the other role runs whole requests.
        roles = state.pool.ready_roles()
        status = "ok" if all(roles.values()) else "degraded" if any(roles.values()) else "down"
        return JSONResponse({"status": status, "engines": roles},
                            status_code=503 if status == "down" else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/cluster/status")
    async def cluster_status() -> Response:
        await state.pool.check_all()  # fresh stats, bounded by health_check_timeout
        body = {"mode": cfg.mode, "model": cfg.model_name, "inflight": state.inflight,
                "queued": state.admission.queued,
                # prefix-cache reports read (cache_aware routing is being fed while it grows)
                "proxy": {"node_ip": state.node_ip, "cache_reports": state.pool.cache_feed.reports},
                "engines": [s.to_dict() for s in state.pool.status()],
                "planner": state.planner_status()}  # the plan in force
        return Response(json.dumps(body), media_type="application/json")

    return app
