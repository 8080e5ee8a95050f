"""Which engines run an attempt at a request, with which instructions (its legs).

A fresh request runs on P and D in parallel (or one colocated engine, or one engine of the
role that is left when the other is down); a request the client already has output of resumes
on one engine from that output (migration); a choice whose prompt a sibling already prefilled
runs where that prompt's KV is.

Engines are picked by the routing policy, with each candidate's cached prefix of the prompt
from the proxy's CacheIndex (cache_aware weighs it against load). In a disaggregated cluster
each request then goes through P (remote prefill, KV shipped to D) or to D alone, whichever
the TTFT model (ttft_model.py) expects to answer first, from the rates measured online
(engine_load.py). The choice and its reason go into metrics and the access log.

A block an engine holds only in a lower KV tier (host, disk) is restored there by a copy, not
recomputed: routing and the prefill estimates count it at proxy.lower_tier_hit_weight of a
device hit; the KV a decode engine holds in any tier is not shipped to it (it restores it).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from connectors.transfer_params import RecvKV, SendKV
from pd_cluster import ttft_trace
from pd_cluster.driver.messages import (ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL, EngineDelta,
                                        EngineRequest)
from pd_cluster.engine.block_hash import hash_blocks
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.cache_index import PrefixHit
from pd_cluster.serving.routing.engine_pool import EnginePool, EngineState, NoHealthyEngine
from pd_cluster.serving.routing.legs import GenerateJob, Leg, LegKind, Sent
from pd_cluster.serving.routing.peer_linker import PeerLinker
from pd_cluster.serving.routing.ttft_model import (LOCAL, REMOTE, Bias, Decision, Link, Side,
                                                   decide)


class Planner:
    def __init__(self, pool: EnginePool, mode: str, metrics: ProxyMetrics):
        self.pool, self.mode, self.metrics = pool, mode, metrics
        self.bias = Bias()  # the TTFT model's error per path, from what was delivered

    def resume(self, job: GenerateJob, excluded: set[str], sent: Sent, rid: str) -> list[Leg]:
        """One engine continues the request from what the client already has (no legs:
        everything was generated already)."""
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
        leg = Leg(engine, request, len(job.prompt_token_ids) + (job.params.max_tokens or 1),
                  LegKind.WHOLE, token_ids=list(sent.token_ids), text=sent.text,
                  logprobs=list(sent.logprobs))
        if engine.role == ROLE_DECODE:
            engine.decoding.watch(leg)
        return [leg]

    def plan(self, job: GenerateJob, excluded: set[str], rid: str,
             pinned: str | None = None) -> list[Leg]:
        """A fresh attempt: the legs, the one that ends the request first."""
        n_prompt = len(job.prompt_token_ids)
        max_tokens = job.params.max_tokens or 1
        base = dict(request_id=rid, prompt_token_ids=job.prompt_token_ids,
                    timeout=max(1.0, job.deadline - time.monotonic()))
        hashes = self._hashes(job)

        def whole(e: EngineState, why: str) -> list[Leg]:  # one engine computes the answer
            hit = self.pool.held(hashes, [e])[e.name]
            cached = self.pool.weighted_tokens(hit)
            leg = Leg(e, EngineRequest(params=job.params, **base), n_prompt + max_tokens,
                      LegKind.WHOLE)
            self._computes(leg, n_prompt - cached)
            if e.role == ROLE_DECODE:
                e.decoding.watch(leg)
            self._routed(job, e, hit, hashes, f"{e.name} {why}".strip())
            _trace(self.pool.config, rid, leg, "first", e.name, why, n_prompt - cached)
            return [leg]

        if pinned is not None:
            engine = next((e for role in (ROLE_DECODE, ROLE_PREFILL, ROLE_COLOCATED)
                           for e in self.pool.available(role, excluded) if e.name == pinned),
                          None)
            if engine is not None:  # its prefix cache holds the prompt's full blocks
                self.metrics.shared_prefills.inc()
                return whole(engine, "shared_prefill")
        if self.mode == "colocated":
            return whole(self._pick(ROLE_COLOCATED, self.pool.available(ROLE_COLOCATED,
                                                                        excluded), hashes), "")
        prefills = self.pool.available(ROLE_PREFILL, excluded)
        decodes = self.pool.available(ROLE_DECODE, excluded)
        if not prefills and not decodes:
            raise NoHealthyEngine("no healthy prefill or decode engine available")
        if not decodes:  # degraded: prefill engines serve whole requests
            self.metrics.degraded.labels("no_decode").inc()
            return whole(self._pick(ROLE_PREFILL, prefills, hashes), "degraded(no_decode)")
        if not prefills:  # degraded: decode engines prefill by themselves, no KV to wait for
            self.metrics.degraded.labels("no_prefill").inc()
            return whole(self._pick(ROLE_DECODE, decodes, hashes), "degraded(no_prefill)")
        if max_tokens == 1:  # P alone computes the whole answer: no KV to ship
            return whole(self._pick(ROLE_PREFILL, prefills, hashes), "prefill_only")
        d = self._pick(ROLE_DECODE, decodes, hashes)
        linked = [p for p in prefills if PeerLinker.linked(p, d)]
        if not linked:  # no P holds a handshake with this D yet (it is being linked)
            self.metrics.degraded.labels("no_kv_link").inc()
            return whole(d, "degraded(no_kv_link)")
        p = self._pick(ROLE_PREFILL, linked, hashes)
        hits = self.pool.held(hashes, [p, d])
        cached = {name: self.pool.weighted_tokens(hit) for name, hit in hits.items()}
        d_held = hits[d.name].blocks * (self.pool.cache.block_size or 0)  # in any tier
        decision = self._decide(n_prompt, p, d, cached[p.name], cached[d.name], d_held,
                                max_tokens)
        self.metrics.disagg_decisions.labels(decision.path, decision.reason).inc()
        if decision.path == LOCAL:
            legs = whole(d, decision.describe())
            self._learn_bias(legs[0], decision)
            return legs
        # min_tokens stays <= 1 so P masks EOS for token 1 exactly when D would.
        p_params = dataclasses.replace(job.params, max_tokens=1,
                                       min_tokens=min(job.params.min_tokens, 1))
        d_kv = RecvKV(reuse_prefix=self.pool.config.decode_prefix_reuse)
        # Blocks past what the index says D holds stream at once; the ones before wait for
        # D's answer (what it really holds). Reuse off: D holds nothing, nothing waits.
        p_kv = SendKV(to=d.kv_endpoint, expect_held=d_held * d_kv.reuse_prefix)
        d_leg = Leg(d, EngineRequest(params=job.params, kv_transfer_params=d_kv, **base),
                    max_tokens + 1, LegKind.DECODE)
        p_leg = Leg(p, EngineRequest(params=p_params, kv_transfer_params=p_kv, **base),
                    n_prompt, LegKind.PREFILL)
        self._computes(p_leg, n_prompt - cached[p.name])
        self._time_link(p_leg, d_leg, n_prompt - d_held)
        d.decoding.watch(d_leg)
        self._learn_bias(p_leg, decision)
        self._routed(job, p, hits[p.name], hashes, "")
        self._routed(job, d, hits[d.name], hashes, f"{p.name}->{d.name} {decision.describe()}")
        _trace(self.pool.config, rid, p_leg, "p_first", p.name, decision.describe(),
               n_prompt - cached[p.name])
        _trace(self.pool.config, rid, d_leg, "d_first", d.name, "", n_prompt - cached[d.name])
        return [d_leg, p_leg]

    # ---- cache-aware routing and the TTFT model ---------------------------------------------
    def _hashes(self, job: GenerateJob) -> list[int]:
        """The prompt's block hashes, as the engines report theirs (none before a report, and
        none when the prompt's logprobs are asked for: engines then compute it all)."""
        bs = self.pool.cache.block_size
        if not bs or job.params.prompt_logprobs is not None:
            return []
        return hash_blocks(job.prompt_token_ids, bs)

    def _pick(self, role: str, candidates: list[EngineState], hashes: list[int]) -> EngineState:
        if not candidates:
            raise NoHealthyEngine(f"no healthy {role} engine available")
        cached = self.pool.cached_tokens(hashes, candidates) if hashes else None
        return self.pool.pick(role, candidates=candidates, cached=cached)

    def _decide(self, n_prompt: int, p: EngineState, d: EngineState, p_cached: int,
                d_cached: int, d_held: int, max_tokens: int) -> Decision:
        """``*_cached``: prompt tokens each side need not prefill (lower-tier hits weighed);
        ``d_held``: the tokens D holds in any tier, which P does not ship to it."""
        if self.pool.config.disaggregation == "always":
            return Decision(REMOTE, "always")
        link, config = self.pool.link, self.pool.config
        ship = n_prompt - d_held if config.decode_prefix_reuse else n_prompt
        local = Side(n_prompt - d_cached, d.load.backlog(), self._rate(d))
        # Each request D is running waits out the local prefill's own seconds.
        stall = config.local_prefill_stall_weight * d.inflight * (
            local.uncached_tokens / max(local.prefill_rate, 1e-9))
        slo = config.slo
        # What D's requests (and one arriving during the pause, as long as this one) absorb.
        slack = d.decoding.slack(slo.tpot_ms / 1e3, slo.percentile, d.stats,
                                 newcomer_tokens=max_tokens)
        return decide(Side(n_prompt - p_cached, p.load.backlog(), self._rate(p)), local,
                      Link(ship, link.bytes_per_token or 0.0, link.bandwidth.get(),
                           link.latency.get()), config.local_prefill_margin_ms / 1e3,
                      self.bias, stall, slack, slo.ttft_ms / 1e3)

    def _rate(self, e: EngineState) -> float:
        """``e``'s measured prefill rate. Before its first sample: the mean of the engines
        measured so far (same model), else the default. A stale rate is raised to that mean:
        an engine the model stopped choosing (after a slow spell) gets chosen again, and its
        next sample replaces the old rate."""
        own = e.load.prefill_rate
        known = [x.load.prefill_rate.value for x in self.pool.engines
                 if x.load.prefill_rate.value is not None]
        mean = sum(known) / len(known) if known else own.get()
        if own.value is None:
            return mean
        if own.is_stale():
            return max(own.value, mean)
        return own.value

    def _computes(self, leg: Leg, tokens: int) -> None:
        """``leg`` queues ``tokens`` of prefill on its engine until its first output."""
        load, n_prompt, key = leg.engine.load, len(leg.request.prompt_token_ids), id(leg)
        load.add(leg, max(tokens, 1))
        # The callback holds the leg's id, not the leg: no cycle keeps a finished leg alive.
        leg.on_first = lambda delta: load.first_output(key, n_prompt, delta.num_cached_tokens)

    def _learn_bias(self, leg: Leg, decision: Decision) -> None:
        """The client's first token is ``leg``'s: its delay from now against the estimate."""
        if not (decision.remote_s or decision.local_s):  # not estimated ("always")
            return
        t0, inner, bias = time.monotonic(), leg.on_first, self.bias
        estimate = decision.remote_s if decision.path == REMOTE else decision.local_s
        # the estimate as decide() returned it includes the bias learnt so far
        raw = estimate - bias.get(decision.path)

        def on_first(delta: EngineDelta) -> None:
            bias.add(decision.path, time.monotonic() - t0, raw)
            if inner is not None:
                inner(delta)
        leg.on_first = on_first

    def _time_link(self, p_leg: Leg, d_leg: Leg, ship_tokens: int) -> None:
        """D's first output after P's: the link's latency beyond the bytes it carried."""
        link, p_first = self.pool.link, p_leg.on_first
        marks: list[float] = []

        def on_p(delta: EngineDelta) -> None:
            marks.append(time.monotonic())
            if p_first is not None:
                p_first(delta)

        def on_d(_delta: EngineDelta) -> None:
            if marks:
                nbytes = ship_tokens * (link.bytes_per_token or 0.0)
                link.latency.add(max(time.monotonic() - marks[0]
                                     - nbytes / link.bandwidth.get(), 0.0))
        p_leg.on_first, d_leg.on_first = on_p, on_d

    def _routed(self, job: GenerateJob, e: EngineState, hit: PrefixHit, hashes: list[int],
                route: str) -> None:
        """Count the expected prefix hit (in any tier); ``e`` holds the prompt's blocks on its
        device from now on."""
        bs = self.pool.cache.block_size or 0
        self.metrics.route_cached_tokens.labels(e.role).inc(hit.blocks * bs)
        self.metrics.route_lower_tier_tokens.labels(e.role).inc(hit.lower * bs)
        self.metrics.route_prompt_tokens.labels(e.role).inc(len(job.prompt_token_ids))
        if hashes:
            self.pool.cache.record(e.name, hashes)
        if route:
            job.route = route


def _trace(config: Any, rid: str, leg: Leg, ev: str, engine: str, route: str,
           uncached: int) -> None:
    """PD_TTFT_TRACE: the plan (estimates in ``route``) and the leg's first output."""
    if not ttft_trace.enabled():
        return
    ttft_trace.mark(rid, "plan", leg=ev, engine=engine, route=route, uncached=uncached,
                    backlog=leg.engine.load.backlog(),
                    mode=f"{config.routing}/{config.disaggregation}")
    inner = leg.on_first

    def on_first(delta: EngineDelta) -> None:
        ttft_trace.mark(rid, ev)
        if inner is not None:
            inner(delta)
    leg.on_first = on_first
