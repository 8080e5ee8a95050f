"""The token path with real Ray engine actors (hosting the model-free NullEngine): an engine
killed mid-stream (its watch call fails, the request migrates exactly), Ray restarting it (the
health check re-attaches the new incarnation and it serves again), and a proxy restart while
the engines live (the old session closes, the new one streams)."""
from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest

from pd_cluster.driver.messages import EngineSpec
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.cluster.cluster_config import ProxyConfig
from pd_cluster.serving.cluster.testing import ensure_ray
from pd_cluster.serving.engine.null_engine import null_engine_actor_class, token_id
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.dispatch import Dispatcher
from pd_cluster.serving.routing.engine_pool import EnginePool
from pd_cluster.serving.routing.legs import GenerateJob
from pd_cluster.serving.routing.token_channel import TokenChannel

NAMESPACE = "pd-cluster-tests"


pytestmark = pytest.mark.timeout(900)  # Ray actors started, killed and restarted


@pytest.fixture(scope="module")
def actors():
    import ray
    ensure_ray()
    names = [f"colocated-{i}-tp{os.getpid()}" for i in range(2)]
    handles = {}
    for name in names:
        spec = EngineSpec(name, "colocated", "tiny-llama", {}, num_cpus=1.0)
        handles[name] = null_engine_actor_class().options(
            name=name, namespace=NAMESPACE, num_cpus=0, max_restarts=1).remote(spec.to_dict())
    ray.get([h.ready.remote() for h in handles.values()], timeout=120)
    ray.get([h.pace.remote(0.004) for h in handles.values()], timeout=60)
    yield handles
    for h in handles.values():
        ray.kill(h, no_restart=True)


class Proxy:
    """The proxy's token-path parts over the actors, as ProxyState wires them."""

    def __init__(self, handles: dict[str, Any]):
        self.pool = EnginePool([(n, "colocated", h) for n, h in handles.items()],
                               ProxyConfig(health_check_interval=0.2, health_check_timeout=5.0))
        self.channel = TokenChannel(5.0, self.pool.mark_failed)
        self.pool.token_channel = self.channel
        self.metrics = ProxyMetrics(lambda: self.pool.engines)
        self.dispatcher = Dispatcher(self.pool, "colocated", self.metrics, self.channel, 1, 2)

    async def tokens(self, rid: str, n: int, on_token: Any = None) -> list[int]:
        job = GenerateJob(rid, [1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True),
                          time.monotonic() + 60)
        out: list[int] = []
        async for ev in self.dispatcher.stream(job):
            out += ev.token_ids
            if on_token is not None:
                on_token(out)
        return out


async def _until(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_engine_killed_mid_stream_migrates_exactly_and_comes_back(actors) -> None:
    import ray

    async def go() -> None:
        proxy = Proxy(actors)
        await proxy.pool.start()
        killed: list[str] = []

        def kill_at_20(out: list[int]) -> None:
            if len(out) >= 20 and not killed:
                victim = next(e for e in proxy.pool.engines if e.inflight)
                killed.append(victim.name)
                ray.kill(victim.handle, no_restart=False)  # Ray restarts it (max_restarts=1)
        tokens = await proxy.tokens("kill-me", 150, kill_at_20)
        assert tokens == [token_id(i) for i in range(150)]  # nothing lost or repeated
        assert proxy.metrics.migrations._value.get() == 1
        victim = next(e for e in proxy.pool.engines if e.name == killed[0])
        await _until(lambda: victim.healthy and victim.restarts == 1
                     and proxy.channel.linked(victim, victim.incarnation))
        await asyncio.wait_for(victim.handle.pace.remote(0.004), 30)
        proxy.pool.routers["colocated"].pick = \
            lambda cands, *_: next(c for c in cands if c.name == victim.name)
        assert await proxy.tokens("after-restart", 30) == [token_id(i) for i in range(30)]
        await proxy.pool.close()
    asyncio.run(go())
    for h in actors.values():
        ray.get(h.check_no_leaks.remote(), timeout=30)  # raises AssertionError on a leak


def test_proxy_restart_while_engines_live(actors) -> None:
    import ray

    async def go() -> None:
        old = Proxy(actors)
        await old.pool.start()
        streamed: list[int] = []
        held = asyncio.ensure_future(old.tokens("held", 100_000,
                                                lambda out: streamed.append(len(out))))
        await _until(lambda: streamed)  # streaming when it goes
        await old.pool.close()  # closes its sessions: the engines abort what it had running
        with pytest.raises(Exception):
            await asyncio.wait_for(held, 30)  # its legs failed with the token path
        new = Proxy(actors)
        await new.pool.start()
        assert new.channel.session != old.channel.session
        assert all(new.channel.linked(e, e.incarnation) for e in new.pool.engines)
        outs = await asyncio.gather(*(new.tokens(f"new-{i}", 40) for i in range(4)))
        assert outs == [[token_id(i) for i in range(40)]] * 4
        await new.pool.close()
    asyncio.run(go())
    for h in actors.values():
        ray.get(h.check_no_leaks.remote(), timeout=30)  # raises AssertionError on a leak


def test_requests_and_aborts_go_over_the_session_socket(actors) -> None:
    """No Ray call per request: requests reach the engine over its session's request socket,
    and the abort of an abandoned request follows it there (it cannot overtake it)."""
    import ray

    def taken() -> dict[str, int]:
        stats = [ray.get(h.stats.remote(), timeout=30) for h in actors.values()]
        return {k: sum(st[f"session_{k}"] for st in stats) for k in ("requests", "aborts")}

    async def go() -> None:
        proxy = Proxy(actors)
        await proxy.pool.start()
        before = taken()
        assert await proxy.tokens("over-zmq", 20) == [token_id(i) for i in range(20)]
        job = GenerateJob("abandoned", [1, 2, 3], SamplingParams(max_tokens=100_000,
                                                                 ignore_eos=True),
                          time.monotonic() + 60)
        events = proxy.dispatcher.stream(job)
        await anext(events)
        await events.aclose()  # the client went away: abort it on its engine
        await _until(lambda: taken()["aborts"] == before["aborts"] + 1)
        assert taken()["requests"] == before["requests"] + 2
        await proxy.pool.close()
    asyncio.run(go())
    for h in actors.values():
        ray.get(h.check_no_leaks.remote(), timeout=30)  # raises AssertionError on a leak


def test_check_no_leaks_raises_over_ray_as_the_engine_does(actors) -> None:
    """One contract: EngineActor.check_no_leaks raises AssertionError (as LLMEngine's does)
    while a request is held, and returns once it is gone."""
    async def go() -> None:
        proxy = Proxy(actors)
        await proxy.pool.start()
        job = GenerateJob("held", [1, 2, 3], SamplingParams(max_tokens=100_000,
                                                            ignore_eos=True),
                          time.monotonic() + 60)
        events = proxy.dispatcher.stream(job)
        await anext(events)
        holder = next(e for e in proxy.pool.engines if e.inflight)
        with pytest.raises(AssertionError, match="held"):
            await asyncio.wait_for(holder.handle.check_no_leaks.remote(), 30)
        await events.aclose()  # aborts it on the engine
        deadline = time.monotonic() + 30
        while True:
            try:
                await asyncio.wait_for(holder.handle.check_no_leaks.remote(), 30)
                break
            except AssertionError:
                assert time.monotonic() < deadline, "the aborted request is still held"
                await asyncio.sleep(0.05)
        await proxy.pool.close()
    asyncio.run(go())
