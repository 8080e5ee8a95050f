"""Engines added, removed and switched between roles on a running cluster, in the proxy.

The LiveActuator runs on the proxy's event loop (it moves the proxy's engine pool):
- add: an engine actor is started as the launcher starts one (engine_starter.py: the cluster
  secret, the role's resources; the autoscaler asked where it does not fit), joins the pool as
  STARTING, gets its token path and its KV links (P -> D handshakes, proven with the cluster
  secret) and is made SERVING;
- remove: the engine is drained (routing/engine_drain.py: its prefills finish and ship, its
  decodes move to the other engines, every KV hold is released), its producers forget it, and
  it is stopped;
- switch a role: drained as for removal, its connector flipped in place (weights and KV cache
  kept; engine_actor.switch_role), linked again under its new role, SERVING again.
One operation at a time. `pd-cluster scale` and the admin routes (api/admin_routes.py) call
the async methods; a controller on another thread calls ``scale``/``switch_role``.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any, Coroutine

from pd_cluster.driver.messages import ROLE_DECODE, ROLE_PREFILL
from pd_cluster.planner.actuator import EngineView
from pd_cluster.serving.cluster.cluster_config import ClusterConfig
from pd_cluster.serving.cluster.engine_starter import EngineStarter, ScaleError, kill
from pd_cluster.serving.routing.decode_watch import DecodeWatch
from pd_cluster.serving.routing.engine_drain import drain
from pd_cluster.serving.routing.engine_load import EngineLoad
from pd_cluster.serving.routing.engine_pool import (DRAINING, SERVING, STARTING, EnginePool,
                                                    EngineState)
from pd_cluster.serving.routing.peer_linker import PeerLinker
from pd_cluster.serving.routing.router import create_router

logger = logging.getLogger(__name__)

_STOP_TIMEOUT = 15.0  # s
_SYNC_CALL_TIMEOUT = 1800.0  # s: the planner's blocking calls (engine loads included)


class LiveActuator:
    def __init__(self, pool: EnginePool, config: ClusterConfig,
                 starter: EngineStarter | None = None, metrics: Any = None,
                 drain_timeout: float | None = None, link_timeout: float = 30.0):
        self.pool, self.config, self.starter, self.metrics = pool, config, starter, metrics
        # A drain waits for running prefills and the KV they ship (bounded by the transfer
        # timeout) and for moved requests' aborts to land.
        self.drain_timeout = drain_timeout or (config.proxy.shutdown_timeout
                                               + config.kv_transfer.kv_transfer_timeout)
        self.link_timeout = link_timeout
        self._lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- the controller's protocol (planner/actuator.py) ------------------------------------
    def engines(self) -> list[EngineView]:
        # the planner's view (its switches pick the least loaded donor: load is needed)
        return [EngineView(e.name, e.role, e.state, float(e.inflight))
                for e in list(self.pool.engines)]

    def scale(self, role: str, count: int) -> None:
        """Blocking: ``count`` engines of ``role`` (from a thread other than the proxy's loop)."""
        self._blocking(self.scale_to({role: count}))

    def switch_role(self, engine_id: str, role: str) -> None:
        """Blocking: engine ``engine_id`` serves as ``role`` (see ``switch``)."""
        self._blocking(self.switch(engine_id, role))

    def _blocking(self, coro: Coroutine[Any, Any, Any]) -> Any:
        loop = self._loop
        if loop is None:
            coro.close()
            raise RuntimeError("the actuator has not been bound to the proxy's event loop")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise RuntimeError("on the proxy's event loop: await scale_to / switch instead")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(_SYNC_CALL_TIMEOUT)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    # ---- checks -------------------------------------------------------------------------------
    def check_counts(self, counts: dict[str, Any]) -> None:
        """ValueError naming the field for a count this cluster cannot be scaled to."""
        roles = self.config.roles
        for role, count in counts.items():
            if role not in roles:
                raise ValueError(f"{role}: this {self.config.mode} cluster has no {role} "
                                 f"engines (its roles: {', '.join(roles)})")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"{role}: expected an engine count >= 0, got {count!r}")
            if count < 1:
                raise ValueError(f"{role}: at least 1 {role} engine is needed (got {count}); "
                                 f"to stop the cluster use `pd-cluster stop`")

    def _active(self, role: str) -> list[EngineState]:
        return [e for e in self.pool.engines if e.role == role and e.state != DRAINING]

    # ---- scaling ------------------------------------------------------------------------------
    async def scale_to(self, counts: dict[str, Any]) -> list[str]:
        """Add or drain-and-remove engines until each role in ``counts`` has that many;
        returns what was done, one line per engine."""
        self.check_counts(counts)
        async with self._lock:
            done: list[str] = []
            jobs = []
            after = {r: counts.get(r, len(self._active(r))) for r in self.config.roles}
            for role, count in counts.items():
                have = self._active(role)
                if count > len(have):
                    keep = {**after, role: len(have)}  # what the cluster holds besides the new
                    jobs.append(self._add(role, count - len(have), done, keep))
                elif count < len(have):
                    jobs += [self._remove(e, done) for e in self._victims(have, len(have) - count)]
            results = await asyncio.gather(*jobs, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0] if len(errors) == 1 else ScaleError(
                    "; ".join(str(e) for e in errors))
            return done

    def _victims(self, have: list[EngineState], n: int) -> list[EngineState]:
        """The engines to remove: the least busy, the newest first among equals."""
        return sorted(have, key=lambda e: (e.inflight, -_index(e.name)))[:n]

    async def _add(self, role: str, n: int, done: list[str], keep: dict[str, int]) -> None:
        if self.starter is None:
            raise ScaleError(f"{role}: this proxy cannot start engines (it was not launched "
                             f"by `pd-cluster launch`)")
        wait = await asyncio.to_thread(self.starter.make_room, role, n, keep)
        names = self._new_names(role, n)
        added = []
        try:
            for name in names:
                handle = self.starter.start(self.starter.spec(role, name))
                added.append(self.pool.add(name, role, handle))
            await asyncio.gather(*(self.starter.wait_ready(e.name, e.handle, wait)
                                   for e in added))
            await asyncio.gather(*(self._join(e) for e in added))
        except BaseException:
            for e in added:
                self.pool.remove(e)
                kill(e.handle)
            raise
        finally:
            self.starter.settled()
        for e in added:
            e.state = SERVING
            self._count("add")
            done.append(f"added {e.name} ({role})")
            logger.info("scaling: %s (%s) added and serving", e.name, role)

    def _new_names(self, role: str, n: int) -> list[str]:
        taken = {e.name for e in self.pool.engines}
        first = max((_index(name) for name in taken if name.startswith(f"{role}-")),
                    default=-1) + 1
        out, i = [], first
        while len(out) < n:
            if f"{role}-{i}" not in taken:
                out.append(f"{role}-{i}")
            i += 1
        return out

    async def _remove(self, e: EngineState, done: list[str]) -> None:
        moved = await drain(self.pool, e, self.drain_timeout)
        await self._forget_consumer(e)
        self.pool.remove(e)
        channel = self.pool.token_channel
        if channel is not None:  # this proxy's session closes first
            await _quietly(e.handle.close_output.remote(channel.session))
        await _quietly(e.handle.shutdown.remote())  # its engine thread and connector stop
        kill(e.handle)
        self._count("remove")
        done.append(f"removed {e.name} ({e.role}; {moved} request(s) moved off it)")
        logger.info("scaling: %s (%s) drained (%d moved) and stopped", e.name, e.role, moved)

    # ---- role switching -------------------------------------------------------------------------
    async def switch(self, engine_id: str, role: str) -> list[str]:
        """Drain ``engine_id``, flip it to ``role`` in place (no weights reloaded), link it
        again and serve. ValueError naming the field for a bad engine or role."""
        async with self._lock:
            e = next((x for x in self.pool.engines if x.name == engine_id), None)
            if e is None:
                raise ValueError(f"engine: no engine named {engine_id!r} (engines: "
                                 f"{', '.join(x.name for x in self.pool.engines)})")
            if self.config.mode != "disaggregated" or role not in (ROLE_PREFILL, ROLE_DECODE):
                raise ValueError(f"role: expected prefill or decode in a disaggregated "
                                 f"cluster, got {role!r}")
            if e.role == role:
                return [f"{e.name} is a {role} engine already"]
            if e.state != SERVING:
                raise ValueError(f"engine: {e.name} is {e.state}, not serving")
            if len(self._active(e.role)) <= 1:
                raise ValueError(f"role: switching {e.name} would leave no {e.role} engine")
            old = e.role
            moved = await drain(self.pool, e, self.drain_timeout)
            try:
                await self._flip(e, role)
            except BaseException:
                if e.role == old:  # not flipped: it serves as before
                    e.state = SERVING
                raise
            e.state = SERVING
            self._count("switch")
            logger.info("scaling: %s switched %s -> %s (%d moved)", e.name, old, role, moved)
            return [f"switched {e.name} {old} -> {role} ({moved} request(s) moved off it)"]

    async def _flip(self, e: EngineState, role: str) -> None:
        if e.role == ROLE_DECODE:
            await self._forget_consumer(e)  # its producers stop sending to it
        elif e.kv_peers:  # a producer no more: its own links go
            await asyncio.wait_for(e.handle.connect_peers.remote({}, self.link_timeout,
                                                                 list(e.kv_peers)),
                                   self.link_timeout + 5)
            e.kv_peers = {}
        spec = self.config.engine_spec(role, e.name).engine_args
        info = await asyncio.wait_for(e.handle.switch_role.remote(
            role, spec["kv_transfer"]["role"], spec.get("max_prefill_tokens_per_step"),
            self.link_timeout), self.link_timeout + 5)
        e.role, e.state = role, STARTING
        e.kv_endpoint, e.kv_peers = info["kv_endpoint"], dict(info["kv_peers"])
        e.load, e.decoding = EngineLoad(), DecodeWatch()  # rates measured in the old role
        self.pool.routers.setdefault(role, create_router(self.pool.config.routing))
        await self._join(e)

    # ---- joining: health, token path, KV links --------------------------------------------
    async def _join(self, e: EngineState) -> None:
        """Until ``e`` is healthy (its token path open) and KV-linked with every serving
        engine of the other role (bounded)."""
        deadline = time.monotonic() + self.link_timeout
        while True:
            await self.pool.check(e)
            if e.healthy:
                self.pool.peers.sync()
                if self._linked(e):
                    return
            if time.monotonic() > deadline:
                errors = [f"{p} -> {ep}: {why}" for (p, ep), why in
                          self.pool.peers.last_errors.items() if e.name == p
                          or ep == e.kv_endpoint]
                raise ScaleError(f"{e.name}: not {'linked' if e.healthy else 'healthy'} "
                                 f"within {self.link_timeout:.0f}s: "
                                 f"{'; '.join(errors) or e.last_error or 'no answer'}")
            await asyncio.sleep(0.1)

    def _linked(self, e: EngineState) -> bool:
        others = [x for x in self.pool.engines if x is not e and x.healthy
                  and x.state == SERVING]
        if e.role == ROLE_DECODE:
            return all(PeerLinker.linked(p, e) for p in others if p.role == ROLE_PREFILL)
        if e.role == ROLE_PREFILL:
            return all(PeerLinker.linked(e, d) for d in others if d.role == ROLE_DECODE)
        return True

    async def _forget_consumer(self, e: EngineState) -> None:
        """Every producer drops its link to decode engine ``e`` (now, not at the next sync)."""
        if e.role != ROLE_DECODE or not e.kv_endpoint:
            return
        ep = e.kv_endpoint
        producers = [p for p in self.pool.engines if p.role == ROLE_PREFILL and ep in p.kv_peers]
        calls = [asyncio.wait_for(p.handle.connect_peers.remote({}, self.link_timeout, [ep]),
                                  self.link_timeout + 5) for p in producers]
        await asyncio.gather(*calls, return_exceptions=True)
        for p in producers:
            p.kv_peers = {k: v for k, v in p.kv_peers.items() if k != ep}

    def _count(self, action: str) -> None:
        if self.metrics is not None:
            self.metrics.scaling.labels(action).inc()


async def _quietly(ref: Any) -> None:
    try:
        await asyncio.wait_for(ref, _STOP_TIMEOUT)
    except Exception:  # noqa: BLE001 - the engine is killed next anyway
        pass


def _index(name: str) -> int:
    m = re.search(r"-(\d+)$", name)
    return int(m.group(1)) if m else -1
