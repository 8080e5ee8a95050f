"""The token path under the Dispatcher and the HTTP API (no Ray, no model): FakeEngineActors
(token_path_fakes.py) with real OutputSenders, streamed through the TokenChannel.

A slow client costs its leg's output, not a queue per engine step (coalescing, also over
HTTP); a proxy restart aborts the old session's work and the new one streams; an engine dying
mid-stream migrates its requests exactly, with and without proxy.stream_interval.
"""
from __future__ import annotations

import asyncio
from typing import Any

from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.engine.null_engine import token_id
from pd_cluster.serving.routing.legs import GenerateJob
from pd_cluster.serving.routing.token_channel import TokenChannel
from tests.token_path_fakes import FakeEngineActor, TwoEngines, pool_and_dispatcher, until


def test_a_slow_client_gets_everything_new_in_one_event() -> None:
    async def go() -> None:
        engine = FakeEngineActor()
        channel = TokenChannel(5.0, node_id="here")
        pool, disp, _ = pool_and_dispatcher([engine], channel)
        await channel.attach(pool.engines[0], "i0")
        n = 500
        job = GenerateJob("slow", [1, 2, 3], SamplingParams(temperature=0, max_tokens=n,
                                                            ignore_eos=True), 1e18)
        events = disp.stream(job)
        first = await anext(events)
        # The client reads nothing while the engine produces the rest: what the proxy holds
        # for it is the leg's output, not one queued item per engine step.
        await until(lambda: channel.counters["deltas"] >= n)
        rest = [ev async for ev in events]
        assert len(rest) == 1, [len(ev.token_ids) for ev in rest]
        tokens = first.token_ids + rest[0].token_ids
        assert tokens == [token_id(i) for i in range(n)]
        assert rest[0].finish_reason == "length"
        await channel.close()
        engine.stop()
    asyncio.run(go())


def test_proxy_restart_aborts_the_old_sessions_work_and_the_new_one_streams() -> None:
    async def go() -> None:
        engine = FakeEngineActor()
        engine.step_seconds = 0.002
        old = TokenChannel(5.0, node_id="here")
        _, disp, _ = pool_and_dispatcher([engine], old)
        await old.attach(disp.pool.engines[0], "i0")
        job = GenerateJob("long", [1], SamplingParams(max_tokens=100_000, ignore_eos=True),
                          1e18)
        events = disp.stream(job)
        await anext(events)  # streaming, then this proxy goes away with it running
        await old.close()
        await until(lambda: "long" in engine.aborted)
        assert not engine.sender._routes  # nothing routed to the closed session any more
        new = TokenChannel(5.0, node_id="here")
        _, disp2, _ = pool_and_dispatcher([engine], new)
        await new.attach(disp2.pool.engines[0], "i0")
        assert new.session != old.session
        job2 = GenerateJob("after", [1], SamplingParams(max_tokens=20, ignore_eos=True), 1e18)
        tokens = [t async for ev in disp2.stream(job2) for t in ev.token_ids]
        assert tokens == [token_id(i) for i in range(20)]
        await events.aclose()
        await new.close()
        engine.stop()
    asyncio.run(go())


def test_an_engine_dying_mid_stream_migrates_its_requests_exactly() -> None:
    async def go() -> None:
        two = TwoEngines()
        events = await two.stream(60, 10, two.a.die)
        tokens = [t for ev in events for t in ev]
        assert tokens == [token_id(i) for i in range(60)]  # nothing lost, nothing repeated
        assert two.metrics.migrations._value.get() == 1
        assert two.lost == [("colocated-0", True)] and not two.pool.engines[0].healthy
        assert two.b.sender._routes == {}  # finished: nothing held for it on the new engine
        await two.close()
    asyncio.run(go())


def test_stream_interval_chunks_and_a_migration_stay_exact() -> None:
    """proxy.stream_interval 4: the first token goes at once, every later event but the last
    carries at least 4 tokens; tokens held in a leg whose engine dies are not lost (the
    request resumes from what the client has) and none is sent twice."""
    async def go() -> None:
        two = TwoEngines(step_seconds=0.001, stream_interval=4)
        events = await two.stream(61, 9, two.a.die)
        sizes = [len(ev) for ev in events]
        assert [t for ev in events for t in ev] == [token_id(i) for i in range(61)]
        assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]), sizes
        assert two.metrics.migrations._value.get() == 1
        await two.close()
    asyncio.run(go())


def test_a_client_that_stops_reading_gets_the_rest_in_one_chunk() -> None:
    """Over HTTP: a client that reads nothing while its request generates 400 tokens holds
    up its own stream only; the proxy keeps the leg's output (not a chunk per engine step),
    and when the client reads again it gets all of it in one chunk, then [DONE]."""
    import json

    from pd_cluster.serving.api.app import create_app
    from pd_cluster.serving.cluster.cluster_config import parse_config

    cfg = parse_config({"mode": "colocated", "colocated": {"replicas": 1}, "proxy": {"port": 0}})
    n = 400

    async def go() -> None:
        engine = FakeEngineActor()
        engine.step_seconds = 0.001
        app = create_app(cfg, [(engine.name, engine.role, engine.handle)])
        state = app.state.proxy
        await state.pool.start()
        body = json.dumps({"model": cfg.model_name, "prompt": [1, 2, 3], "max_tokens": n,
                           "ignore_eos": True, "stream": True}).encode()
        chunks: list[bytes] = []
        reading = asyncio.Event()
        received = False

        async def receive() -> dict[str, Any]:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never hangs up
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                if len(chunks) == 1:
                    await reading.wait()  # the client stops reading after its first chunk

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions",
                 "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")],
                 "server": ("proxy", 80), "client": ("client", 1234)}
        call = asyncio.ensure_future(app(scope, receive, send))
        try:
            await until(lambda: bool(chunks))
            await until(lambda: channel_deltas(state) >= n)  # the engine finished meanwhile
            reading.set()
            await asyncio.wait_for(call, 30)
        finally:
            await state.pool.close()
            engine.stop()
        events = [json.loads(c[6:]) for c in chunks if c.startswith(b"data: {")]
        assert len(events) == 2, [len(e["choices"][0]["text"]) for e in events]
        text = "".join(e["choices"][0]["text"] for e in events)
        assert text == "".join(f"t{i} " for i in range(n))
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1] == b"data: [DONE]\n\n"
    asyncio.run(go())


def channel_deltas(state: Any) -> int:
    return state.pool.token_channel.counters["deltas"]
