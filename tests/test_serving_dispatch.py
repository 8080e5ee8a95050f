"""The proxy's P/D orchestration and routing, against scripted fake engines (no Ray, no model)."""
from __future__ import annotations

import asyncio
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
from pd_cluster.serving.api.errors import APIError
from pd_cluster.driver.messages import EngineDelta, EngineRequest, decode_request, encode
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.router import create_router, router_names

Script = list[Any]  # EngineDelta | BaseException | float (sleep seconds)


class _Ref:
    def __init__(self, item: Any):
        self.item = item

    def __await__(self):
        async def get() -> Any:
            if isinstance(self.item, BaseException):
                raise self.item
            return self.item
        return get().__await__()


class _Gen:
    """Plays a script written with cumulative deltas (readable) as an engine does: incremental
    deltas numbered from 0, never emitting text that a later step cuts (stop strings); a
    resumed request's output starts after what it was given."""

    def __init__(self, script: Script, request: EngineRequest | None = None):
        self.items = list(script)
        deltas = [i for i in script if isinstance(i, EngineDelta)]
        self.final_text = deltas[-1].text if deltas else ""
        self.tokens = len(request.resume_token_ids) if request else 0
        self.chars = request.resume_text_len if request else 0
        self.seq = 0

    async def __anext__(self) -> _Ref:
        while self.items and isinstance(self.items[0], float):
            await asyncio.sleep(self.items.pop(0))
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return _Ref(encode([self._increment(item)]))

    def _increment(self, d: EngineDelta) -> EngineDelta:
        stable = len(os.path.commonprefix([d.text, self.final_text]))
        text = d.text[self.chars:stable] if stable > self.chars else ""
        inc = msgspec.structs.replace(d, seq=self.seq, token_ids=d.token_ids[self.tokens:],
                                      text=text)
        self.seq, self.tokens, self.chars = self.seq + 1, len(d.token_ids), max(stable, self.chars)
        return inc


class _Method:
    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def options(self, **_kw: Any) -> "_Method":
        return self

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeEngine:
    """A script per request. An assert inside a script runs under the dispatcher's ``except
    Exception`` (it would only look like an engine failure and trigger a retry): it is recorded
    in ``failures``, and ``run`` fails the test on it."""

    def __init__(self, script: Callable[[EngineRequest], Script]):
        self.requests: list[EngineRequest] = []
        self.aborted: list[str] = []
        self.failures: list[str] = []

        def generate(req: bytes) -> _Gen:
            r = decode_request(req)
            self.requests.append(r)
            try:
                items = script(r)
            except AssertionError:
                self.failures.append(f"{r.request_id}: {traceback.format_exc(limit=-1).strip()}")
                raise
            return _Gen(items, r)

        def abort(ids: list[str]) -> _Ref:
            self.aborted.extend(ids)
            return _Ref(None)

        self.generate, self.abort = _Method(generate), _Method(abort)


def delta(rid: str, text: str, ids: list[int], reason: str | None = None, **kw: Any) -> EngineDelta:
    return EngineDelta(rid, text=text, token_ids=ids, finished=reason is not None,
                       finish_reason=reason, num_prompt_tokens=3, **kw)


def p_ok(req: EngineRequest) -> Script:
    return [0.01, delta(req.request_id, "a", [5], "length")]


def d_ok(req: EngineRequest) -> Script:
    rid = req.request_id
    return [0.02, delta(rid, "ab", [5, 6]), delta(rid, "abc", [5, 6, 7], "length")]


def make(engines: dict[str, FakeEngine], mode: str = "disaggregated", retries: int = 2):
    pool = EnginePool([(n, n.split("-")[0], e) for n, e in engines.items()],
                      ProxyConfig(routing="round_robin"))
    for st in pool.engines:
        st.healthy, st.incarnation = True, "i0"
        st.kv_endpoint = f"tcp://{st.name}" if st.role == "decode" else None
    for st in pool.engines:  # every producer linked to every consumer, as after launch
        if st.role == "prefill":
            st.kv_peers = {d.kv_endpoint: d.incarnation for d in pool.engines if d.kv_endpoint}
    metrics = ProxyMetrics(lambda: pool.engines)
    return Dispatcher(pool, mode, metrics, retries), pool, metrics


def run(dispatcher: Dispatcher, max_tokens: int = 3, **params: Any) -> list[tuple]:
    job = GenerateJob("cmpl-1", [1, 2, 3], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                          **params), deadline=1e18)

    async def go() -> list[tuple]:
        out = [(e.text, e.token_ids, e.finish_reason) async for e in dispatcher.stream(job)]
        await asyncio.sleep(0.05)  # let fire-and-forget aborts land
        return out
    try:
        return asyncio.run(go())
    finally:  # also when the request failed: a failed script assert is the test's failure
        failures = [f for st in dispatcher.pool.engines
                    for f in getattr(st.handle, "failures", [])]
        if failures:
            raise AssertionError("asserts in fake engines' scripts failed:\n" +
                                 "\n".join(failures))


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
    slow_p = FakeEngine(lambda r: [0.2, delta(r.request_id, "a", [5], "length")])
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
        return [EngineDelta(r.request_id, finished=True, error="prompt + max_tokens: too long",
                            error_type="invalid_request")]
    # P is still computing when D's rejection arrives: its leg must be aborted.
    p = FakeEngine(lambda r: [0.5, delta(r.request_id, "a", [5], "length")])
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

    async def go() -> list:
        return [e async for e in disp.stream(job)]
    events = asyncio.run(go())
    assert [(e.text, e.token_ids, e.finish_reason) for e in events] == [
        ("a", [5], None), ("bc", [6, 7], "length")]
    assert events[0].prompt_logprobs == plp and events[1].prompt_logprobs is None
    assert all(e.inflight == 0 for e in pool.engines)
