"""The proxy's P/D orchestration and routing, against scripted fake engines (no Ray, no
model) that answer over the real token path: each fake has an OutputSender and a
RequestReader (tests/token_path_fakes.py), the Dispatcher reads them through a TokenChannel."""
from __future__ import annotations

import asyncio
import collections
import os
import traceback
from typing import Any, Callable

import msgspec
import pytest
import ray.exceptions

from connectors.transfer_params import RecvKV, SendKV
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.cluster.cluster_config import ProxyConfig
from pd_cluster.serving.routing.dispatch import Dispatcher, GenerateJob
from pd_cluster.serving.routing.engine_pool import EnginePool
from pd_cluster.serving.routing.legs import StreamEvent
from pd_cluster.serving.routing.token_channel import TokenChannel
from pd_cluster.serving.api.errors import APIError
from pd_cluster.driver.messages import ERROR_ENGINE, EngineDelta, EngineRequest
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.router import create_router, router_names
from tests.token_path_fakes import FakeEngineActor, until

Script = list[Any]  # EngineDelta | BaseException | float (sleep seconds) | a condition to await


class _Gen:
    """Plays a script written with cumulative deltas (readable) as an engine does: incremental
    deltas numbered from 0, never emitting text that a later step cuts (stop strings); a
    resumed request's output starts after what it was given."""

    def __init__(self, script: Script, request: EngineRequest):
        self.items = list(script)
        deltas = [i for i in script if isinstance(i, EngineDelta)]
        self.final_text = deltas[-1].text if deltas else ""
        self.tokens = len(request.resume_token_ids)
        self.chars = request.resume_text_len
        self.seq = 0

    def __iter__(self) -> Any:
        for item in self.items:
            yield self._increment(item) if isinstance(item, EngineDelta) else item

    def _increment(self, d: EngineDelta) -> EngineDelta:
        stable = len(os.path.commonprefix([d.text, self.final_text]))
        text = d.text[self.chars:stable] if stable > self.chars else ""
        inc = msgspec.structs.replace(d, seq=self.seq, token_ids=d.token_ids[self.tokens:],
                                      text=text)
        self.seq, self.tokens, self.chars = self.seq + 1, len(d.token_ids), max(stable, self.chars)
        return inc


class FakeEngine(FakeEngineActor):
    """A script per request, played on the token path: a float sleeps, a callable is waited on
    until it is true (an order between engines), a delta is emitted (one engine step each:
    the next waits until the proxy has read it), an exception is the engine's death (its watch call fails as Ray's does, the proxy's link to it is lost). An
    assert inside a script would only look like an engine failure (and trigger a retry): it
    is recorded in ``failures``, and ``run`` fails the test on it."""

    def __init__(self, script: Callable[[EngineRequest], Script], gen: type[_Gen] = _Gen):
        super().__init__()
        self.script, self.gen = script, gen
        self.requests: list[EngineRequest] = []
        self.failures: list[str] = []
        self.playing: set[asyncio.Task] = set()
        self.sent = 0  # frames written to the proxy
        self.read: Callable[[], int] = lambda: 0  # frames the proxy read (set by ``play``)
        self.handle.fake = self

    def accept(self, req: EngineRequest) -> None:
        self.requests.append(req)
        try:
            items: Script = list(self.gen(self.script(req), req))
        except AssertionError:
            self.failures.append(f"{req.request_id}: {traceback.format_exc(limit=-1).strip()}")
            items = [EngineDelta(req.request_id, finished=True, error="script assert failed",
                                 error_type=ERROR_ENGINE)]
        self.sender.route(req.request_id, req.output_session)
        task = asyncio.get_running_loop().create_task(self._play(req.request_id, items))
        self.playing.add(task)
        task.add_done_callback(self.playing.discard)

    def _abort(self, ids: list[str]) -> None:
        super()._abort(ids)
        for rid in ids:  # an aborted request's output goes nowhere (nor is it aborted again)
            self.sender._routes.pop(rid, None)

    async def _play(self, rid: str, items: Script) -> None:
        for item in items:
            # The previous step's frame reached the proxy first (as a real step takes time).
            await until(lambda: self.read() >= self.sent or rid in self._stop)
            if rid in self._stop:  # aborted (or this engine died)
                return
            if isinstance(item, float):
                await asyncio.sleep(item)
            elif callable(item):
                await until(item)
            elif isinstance(item, BaseException):
                self.die()
                return
            elif rid in self.sender._routes:  # else its session closed
                self.sent += 1
                self.sender.emit([item])


def delta(rid: str, text: str, ids: list[int], reason: str | None = None, **kw: Any) -> EngineDelta:
    return EngineDelta(rid, text=text, token_ids=ids, finished=reason is not None,
                       finish_reason=reason, num_prompt_tokens=3, **kw)


def p_ok(req: EngineRequest) -> Script:
    return [0.01, delta(req.request_id, "a", [5], "length")]


def d_ok(req: EngineRequest) -> Script:
    rid = req.request_id
    return [0.02, delta(rid, "ab", [5, 6]), delta(rid, "abc", [5, 6, 7], "length")]


def make(engines: dict[str, FakeEngine], mode: str = "disaggregated", retries: int = 2):
    for name, e in engines.items():
        e.name, e.role = name, name.split("-")[0]
    pool = EnginePool([(n, e.role, e.handle) for n, e in engines.items()],
                      ProxyConfig(routing="round_robin"))
    for st in pool.engines:
        st.healthy, st.incarnation = True, "i0"
        st.kv_endpoint = f"tcp://{st.name}" if st.role == "decode" else None
    for st in pool.engines:  # every producer linked to every consumer, as after launch
        if st.role == "prefill":
            st.kv_peers = {d.kv_endpoint: d.incarnation for d in pool.engines if d.kv_endpoint}
    channel = TokenChannel(5.0, pool.mark_failed, node_id="here")
    pool.token_channel = channel
    metrics = ProxyMetrics(lambda: pool.engines)
    return Dispatcher(pool, mode, metrics, channel, retries), pool, metrics


def play(dispatcher: Dispatcher, job: GenerateJob) -> list[StreamEvent]:
    """The job's events, its engines attached to the dispatcher's token channel first; then
    (also when the request failed) every script has ended or was aborted, and the channel and
    the engines' sockets are closed."""
    fakes = [st.handle.fake for st in dispatcher.pool.engines]
    channel, read = dispatcher.channel, collections.Counter[str]()
    apply = channel._apply

    def counted(link: Any, payload: memoryview) -> None:  # frames read, per engine
        read[link.engine.name] += 1
        apply(link, payload)
    channel._apply = counted  # type: ignore[method-assign]
    for f in fakes:
        f.read = lambda name=f.name: read[name]

    async def go() -> list[StreamEvent]:
        for st in dispatcher.pool.engines:
            await dispatcher.channel.attach(st, "i0")
        try:
            return [e async for e in dispatcher.stream(job)]
        finally:
            await until(lambda: not any(f.playing for f in fakes))
            await dispatcher.channel.close()
            for f in fakes:
                f.stop()
    try:
        return asyncio.run(go())
    finally:  # also when the request failed: a failed script assert is the test's failure
        failures = [f for fake in fakes for f in fake.failures]
        if failures:
            raise AssertionError("asserts in fake engines' scripts failed:\n" +
                                 "\n".join(failures))


def run(dispatcher: Dispatcher, max_tokens: int = 3, **params: Any) -> list[tuple]:
    job = GenerateJob("cmpl-1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                          **params), deadline=1e18)
    return [(e.text, e.token_ids, e.finish_reason) for e in play(dispatcher, job)]


def test_first_token_from_p_rest_from_d() -> None:
    p, d = FakeEngine(p_ok), FakeEngine(d_ok)
    disp, pool, _ = make({"prefill-0": p, "decode-0": d})
    assert run(disp) == [("a", [5], None), ("b", [6], None), ("c", [7], "length")]
    (preq,), (dreq,) = p.requests, d.requests
    assert preq.request_id == dreq.request_id == "cmpl-1"  # one id end to end
    assert preq.params.max_tokens == 1 and dreq.params.max_tokens == 3
    assert preq.kv_transfer_params == SendKV(to="tcp://decode-0")  # expect_held 0: cold cache
    assert dreq.kv_transfer_params == RecvKV()
    assert p.aborted == d.aborted == []  # both finished: nothing to abort
    assert all(e.inflight == 0 and e.outstanding_work == 0 for e in pool.engines)


def test_single_token_and_colocated_use_one_engine() -> None:
    p, d = FakeEngine(p_ok), FakeEngine(d_ok)
    disp, _, _ = make({"prefill-0": p, "decode-0": d})
    assert run(disp, max_tokens=1)[-1][2] == "length" and not d.requests
    assert p.requests[0].kv_transfer_params is None
    c = FakeEngine(d_ok)
    disp, _, _ = make({"colocated-0": c}, mode="colocated")
    assert "".join(t for t, _, _ in run(disp)) == "abc"


def test_decode_death_before_output_retries_on_another_pair() -> None:
    dead = FakeEngine(lambda r: [ray.exceptions.ActorDiedError()])
    slow_p = FakeEngine(lambda r: [lambda: r.request_id in slow_p.aborted,  # until aborted
                                   delta(r.request_id, "a", [5], "length")])
    disp, pool, metrics = make({"prefill-0": slow_p, "prefill-1": FakeEngine(p_ok),
                                "decode-0": dead, "decode-1": FakeEngine(d_ok)})
    events = run(disp)
    assert "".join(t for t, _, _ in events) == "abc" and events[-1][2] == "length"
    assert [i for _, ids, _ in events for i in ids] == [5, 6, 7]
    states = {e.name: e for e in pool.engines}
    assert not states["decode-0"].healthy and states["decode-1"].healthy
    assert states["prefill-0"].healthy  # a peer's death is not P's fault
    assert slow_p.aborted == ["cmpl-1"]  # the abandoned attempt was aborted on P
    assert metrics.retries._value.get() == 1


def test_failure_after_output_ends_with_error() -> None:
    def d_dies(r: EngineRequest) -> Script:
        return [0.02, delta(r.request_id, "ab", [5, 6]), ray.exceptions.ActorDiedError()]
    disp, _, _ = make({"prefill-0": FakeEngine(p_ok), "decode-0": FakeEngine(d_dies),
                       "decode-1": FakeEngine(d_ok)})
    with pytest.raises(APIError) as exc:
        run(disp)
    assert exc.value.status == 502 and "decode-0" in exc.value.message


def test_client_error_from_engine_keeps_it_healthy() -> None:
    def d_rejects(r: EngineRequest) -> Script:
        return [lambda: bool(p.requests),  # P has the request (its reader may come second)
                EngineDelta(r.request_id, finished=True, error="prompt + max_tokens: too long",
                            error_type="invalid_request")]
    # P is still computing when D's rejection arrives (until its abort): its leg is aborted.
    p = FakeEngine(lambda r: [lambda: r.request_id in p.aborted,
                              delta(r.request_id, "a", [5], "length")])
    disp, pool, _ = make({"prefill-0": p, "decode-0": FakeEngine(d_rejects)})
    with pytest.raises(APIError) as exc:
        run(disp)
    assert exc.value.status == 400 and exc.value.param == "prompt"
    assert all(e.healthy for e in pool.engines)
    assert [r.request_id for r in p.requests] == ["cmpl-1"] and p.aborted == ["cmpl-1"]


def test_no_healthy_engine_is_503() -> None:
    disp, pool, _ = make({"prefill-0": FakeEngine(p_ok), "decode-0": FakeEngine(d_ok)})
    for e in pool.engines:
        e.healthy = False
    with pytest.raises(APIError) as exc:
        run(disp)
    assert exc.value.status == 503


def whole_request(req: EngineRequest) -> Script:
    rid = req.request_id
    return [delta(rid, "x", [9]), delta(rid, "xyz", [9, 8, 7], "length")]


def test_degraded_modes_serve_whole_requests_on_the_other_role() -> None:
    """No decode engine: prefill engines serve whole requests (and the reverse); a D that no
    P is linked to yet prefills by itself at once instead of waiting for KV."""
    for down, serving in (("decode-0", "prefill-0"), ("prefill-0", "decode-0")):
        engines = {"prefill-0": FakeEngine(whole_request), "decode-0": FakeEngine(whole_request)}
        disp, pool, metrics = make(engines)
        next(e for e in pool.engines if e.name == down).healthy = False
        assert run(disp) == [("x", [9], None), ("yz", [8, 7], "length")]
        (req,) = engines[serving].requests
        assert req.kv_transfer_params is None and req.params.max_tokens == 3
        assert not engines[down].requests
        reason = "no_decode" if down == "decode-0" else "no_prefill"
        assert metrics.degraded.labels(reason)._value.get() == 1
    engines = {"prefill-0": FakeEngine(p_ok), "decode-0": FakeEngine(whole_request)}
    disp, pool, metrics = make(engines)
    pool.engines[0].kv_peers = {}  # P has no handshake with D (D just restarted, say)
    assert run(disp)[-1] == ("yz", [8, 7], "length")
    assert not engines["prefill-0"].requests
    assert engines["decode-0"].requests[0].kv_transfer_params is None
    assert metrics.degraded.labels("no_kv_link")._value.get() == 1


def test_stop_string_prefix_is_held_back() -> None:
    def d_stop(r: EngineRequest) -> Script:
        rid = r.request_id
        return [delta(rid, "ax", [5, 6]), delta(rid, "a", [5, 6, 7], "stop")]  # "xy" matched
    disp, _, _ = make({"prefill-0": FakeEngine(p_ok), "decode-0": FakeEngine(d_stop)})
    events = run(disp, stop=["xy"])
    assert "".join(t for t, _, _ in events) == "a" and events[-1][2] == "stop"


def test_routers() -> None:
    assert {"least_loaded", "round_robin"} <= set(router_names())
    with pytest.raises(ValueError, match="routing"):
        create_router("nope")

    class E:
        def __init__(self, name: str, work: int):
            self.name, self.outstanding_work, self.inflight = name, work, 0
    busy, idle1, idle2 = E("a", 50), E("b", 0), E("c", 0)
    ll = create_router("least_loaded")
    picks = {ll.pick([busy, idle1, idle2]).name for _ in range(4)}
    assert picks == {"b", "c"}  # never the busy one; ties rotate
    rr = create_router("round_robin")
    assert [rr.pick([busy, idle1]).name for _ in range(4)] == ["a", "b", "a", "b"]


def test_output_waits_for_the_prompt_logprobs_from_p() -> None:
    """With prompt logprobs asked (echo), D's output that is ahead of P's is held until P's
    prompt logprobs arrive; then P's token goes first, with them, and D's follow."""
    plp = [None, {2: -0.5}, {3: -0.25}]
    slow_p = FakeEngine(lambda r: [0.1, delta(r.request_id, "a", [5], "length",
                                              prompt_logprobs=plp)])
    fast_d = FakeEngine(lambda r: [delta(r.request_id, "ab", [5, 6]),
                                   delta(r.request_id, "abc", [5, 6, 7], "length")])
    disp, pool, _ = make({"prefill-0": slow_p, "decode-0": fast_d})
    job = GenerateJob("cmpl-1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3,
                                                          prompt_logprobs=1), deadline=1e18)
    events = play(disp, job)
    assert [(e.text, e.token_ids, e.finish_reason) for e in events] == [
        ("a", [5], None), ("bc", [6, 7], "length")]
    assert events[0].prompt_logprobs == plp and events[1].prompt_logprobs is None
    assert all(e.inflight == 0 for e in pool.engines)
