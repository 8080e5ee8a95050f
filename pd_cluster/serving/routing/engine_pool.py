"""The proxy's view of every engine: health, load, KV endpoint; picks engines via the router.

A background task health-checks each engine every ``health_check_interval``. An engine is
routed around after ``unhealthy_threshold`` failed checks, or at once when its actor dies or
a request sees it fail; it comes back when a check succeeds again (e.g. after Ray restarted
it, with a new incarnation and therefore a fresh KV endpoint). After each round, producers
are asked to handshake with consumers they do not hold a link to (PeerLinker). With a token
channel, a check that sees a new engine incarnation opens the channel to it before the engine
is routable, and an engine found down has its open legs failed (their requests move on).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from pd_cluster.serving.cluster.cluster_config import ProxyConfig
from pd_cluster.driver.messages import EngineInfo, EngineStatus
from pd_cluster.serving.engine.output_sender import SHUTTING_DOWN
from pd_cluster.serving.routing.cache_feed import CacheFeed
from pd_cluster.serving.routing.cache_index import CacheIndex, PrefixHit
from pd_cluster.serving.routing.decode_watch import DecodeWatch
from pd_cluster.serving.routing.engine_load import EngineLoad, LinkStats
from pd_cluster.serving.routing.peer_linker import PeerLinker
from pd_cluster.serving.routing.router import Router, create_router
from pd_cluster.serving.observability.stats_log import StatsLog

logger = logging.getLogger(__name__)


class NoHealthyEngine(RuntimeError):
    pass


# An engine's place in the pool (serving/cluster/scaling.py moves it): only a serving engine
# is routed to; a starting one is health-checked and KV-linked first; a draining one finishes
# or hands over its work before it is removed or switches role.
SERVING, STARTING, DRAINING = "serving", "starting", "draining"
_RECHECK_DELAY = 0.05  # s after a lost token link before the engine is checked again


@dataclass
class EngineState:
    name: str
    role: str
    handle: Any
    state: str = SERVING
    healthy: bool = False
    failures: int = 0
    incarnation: str | None = None
    restarts: int = 0
    # Every incarnation a check has seen: a restart counts once even when two checks (the
    # loop, /cluster/status) see the new one before either has linked it.
    seen_incarnations: set[str] = field(default_factory=set)
    kv_endpoint: str | None = None
    kv_peers: dict[str, Any] = field(default_factory=dict)  # producer: endpoint -> D incarnation
    node_ip: str = ""
    node_id: str = ""
    pid: int = 0
    max_model_len: int = 0
    inflight: int = 0
    outstanding_work: int = 0
    last_error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    load: EngineLoad = field(default_factory=EngineLoad)  # queued prefill work, its rate
    decoding: DecodeWatch = field(default_factory=DecodeWatch)  # its requests' TPOT progress

    @property
    def queued_prefill(self) -> int:
        return self.load.backlog()


class EnginePool:
    def __init__(self, engines: list[tuple[str, str, Any]], config: ProxyConfig):
        self.engines = [EngineState(name, role, handle) for name, role, handle in engines]
        self.config = config
        # One router per role: a policy's rotation state must not be shared between roles.
        self.routers: dict[str, Router] = {e.role: create_router(config.routing)
                                           for e in self.engines}
        self._task: asyncio.Task | None = None
        self.token_channel: Any = None  # TokenChannel: set by the proxy that reads tokens
        self.peers = PeerLinker(self.engines, config.health_check_timeout)
        self.stats_log = StatsLog(config.log_stats_interval)
        self.cache = CacheIndex(config.cache_index_max_blocks)
        self.link = LinkStats()
        self.cache_feed = CacheFeed(self.cache, self.link, config.cache_events_interval,
                                    config.health_check_timeout)
        self._rechecks: dict[str, asyncio.Task] = {}  # engines checked again after a lost link

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.create_task(self._loop())
        if self.config.routing == "cache_aware" or self.config.disaggregation == "auto":
            self.cache_feed.start(self.engines)  # else nothing reads the index

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._rechecks.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.cache_feed.close()
        await self.peers.close()
        if self.token_channel is not None:
            await self.token_channel.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            try:
                await self.check_all()
                self.stats_log.maybe_log(self.engines)
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad check
                logger.exception("health check round failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(e) for e in self.engines))
        self.peers.sync()  # new or restarted consumers: producers handshake in the background

    async def check(self, e: EngineState) -> None:
        import ray.exceptions
        try:
            info = EngineInfo.from_dict(await asyncio.wait_for(
                e.handle.health.remote(), self.config.health_check_timeout))
        except Exception as exc:  # noqa: BLE001 - any failure counts against the engine
            dead = isinstance(exc, ray.exceptions.RayActorError)
            self.mark_failed(e, f"health check: {type(exc).__name__}: {exc}"[:500], dead)
            if not e.healthy and self.token_channel is not None:  # down: move its requests
                self.token_channel.detach(e, "engine down (health check)", dead)
            return
        if e.incarnation is not None:
            e.seen_incarnations.add(e.incarnation)
        if info.incarnation not in e.seen_incarnations:
            if e.seen_incarnations:
                e.restarts += 1
                self.cache_feed.forget(e)  # a restarted engine's prefix cache starts empty
                logger.warning("%s restarted (pid %d -> %d)", e.name, e.pid, info.pid)
            e.seen_incarnations.add(info.incarnation)
        channel = self.token_channel
        if channel is not None and not channel.linked(e, info.incarnation):
            try:
                await channel.attach(e, info.incarnation)
            except Exception as exc:  # noqa: BLE001 - not routable without its token path
                self.mark_failed(e, f"token path: {type(exc).__name__}: {exc}"[:500],
                                 dead=False)
                return
        if not e.healthy:
            logger.info("%s is healthy", e.name)
        e.incarnation, e.kv_endpoint, e.pid = info.incarnation, info.kv_endpoint, info.pid
        e.node_ip, e.node_id, e.kv_peers = info.node_ip, info.node_id, dict(info.kv_peers)
        e.max_model_len, e.stats = info.max_model_len, info.stats
        self.link.engine_stats(e.name, info.stats)
        e.healthy, e.failures = True, 0

    def mark_failed(self, e: EngineState, error: str, dead: bool) -> None:
        e.failures += 1
        e.last_error = error
        if e.healthy and (dead or e.failures >= self.config.unhealthy_threshold):
            logger.warning("%s marked unhealthy: %s", e.name, error)
            e.healthy = False
        if dead and self.token_channel is not None:  # its requests are gone with it
            self.token_channel.detach(e, error, dead=True)

    def token_path_lost(self, e: EngineState, error: str, dead: bool) -> None:
        """The token channel lost its link to ``e`` (its legs failed and move on). An engine
        that is not dead is checked again at once, which opens a new link, instead of at the
        next round: a broken link (a malformed frame, a closed session) takes it out of
        routing for a moment, not for a health check interval."""
        if error.endswith(SHUTTING_DOWN) and not dead:  # it stops in order: not a failure
            if e.healthy:
                logger.info("%s is shutting down: not routable", e.name)
            e.healthy, e.last_error = False, error
        else:
            self.mark_failed(e, error, dead)
        if e.healthy:  # not routable without its token path, until a check links it again
            logger.warning("%s marked unhealthy: %s", e.name, error)
            e.healthy = False
        if dead or e.name in self._rechecks or e not in self.engines:
            return
        task = asyncio.get_running_loop().create_task(self._recheck(e))
        self._rechecks[e.name] = task
        task.add_done_callback(lambda _: self._rechecks.pop(e.name, None))

    async def _recheck(self, e: EngineState) -> None:
        # A short pause: an engine whose new links keep breaking is checked at most this often.
        await asyncio.sleep(min(_RECHECK_DELAY, self.config.health_check_interval))
        if e in self.engines:
            await self.check(e)

    # ---- routing ----------------------------------------------------------------------------
    def available(self, role: str, excluded: set[str] | frozenset[str] = frozenset()
                  ) -> list[EngineState]:
        return [e for e in self.engines if e.role == role and e.healthy and e.state == SERVING
                and e.name not in excluded]

    def add(self, name: str, role: str, handle: Any) -> EngineState:
        """A new engine, not routed to until it is made SERVING (scaling.py)."""
        e = EngineState(name, role, handle, state=STARTING)
        self.routers.setdefault(role, create_router(self.config.routing))
        self.engines.append(e)  # in place: the peer linker, cache feed and metrics see it
        return e

    def remove(self, e: EngineState) -> None:
        """Forget a drained engine (its producers drop their links at the next sync)."""
        if e in self.engines:
            self.engines.remove(e)
        self.cache_feed.forget(e)
        if self.token_channel is not None:
            self.token_channel.detach(e, "engine removed", dead=False)

    def pick(self, role: str, excluded: set[str] | frozenset[str] = frozenset(),
             candidates: list[EngineState] | None = None,
             cached: dict[str, int] | None = None) -> EngineState:
        """An engine of ``role`` by the routing policy; ``cached``: prompt tokens each
        engine's prefix cache is believed to hold (cache_aware routing weighs them)."""
        if candidates is None:
            candidates = self.available(role, excluded)
        if not candidates:
            raise NoHealthyEngine(f"no healthy {role} engine available")
        return self.routers[role].pick(candidates, cached)  # type: ignore[return-value]

    def held(self, hashes: list[int], engines: list[EngineState]) -> dict[str, PrefixHit]:
        """Per engine: the leading blocks of ``hashes`` it holds, per tier."""
        return {e.name: self.cache.prefix(e.name, hashes) for e in engines}

    def cached_tokens(self, hashes: list[int], engines: list[EngineState]) -> dict[str, int]:
        """Per engine: the prompt tokens (whole blocks) of ``hashes`` it need not prefill, a
        lower-tier block counted at proxy.lower_tier_hit_weight (its restore is a copy)."""
        return {name: self.weighted_tokens(hit)
                for name, hit in self.held(hashes, engines).items()}

    def weighted_tokens(self, hit: PrefixHit) -> int:
        bs = self.cache.block_size or 0
        return round(hit.weighted_blocks(self.config.lower_tier_hit_weight) * bs)

    def acquire(self, e: EngineState, work: int) -> None:
        e.inflight += 1
        e.outstanding_work += work

    def release(self, e: EngineState, work: int) -> None:
        e.inflight -= 1
        e.outstanding_work -= work

    def ready_roles(self) -> dict[str, bool]:
        """Per role: is at least one engine healthy (and serving)."""
        out: dict[str, bool] = {}
        for e in self.engines:
            out[e.role] = out.get(e.role, False) or (e.healthy and e.state == SERVING)
        return out

    def status(self) -> list[EngineStatus]:
        return [EngineStatus(name=e.name, role=e.role, state=e.state, healthy=e.healthy,
                             inflight=e.inflight,
                             restarts=e.restarts, pid=e.pid, node_ip=e.node_ip,
                             node_id=e.node_id, kv_endpoint=e.kv_endpoint,
                             kv_peers=len(e.kv_peers),
                             last_error=e.last_error, stats=dict(e.stats))
                for e in self.engines]
