"""Which engines run an attempt at a request, with which instructions (its legs).

A fresh request runs on P and D in parallel (or one colocated engine, or one engine of the
role that is left when the other is down); a request the client already has output of resumes
on one engine from that output (migration); a choice whose prompt a sibling already prefilled
runs where that prompt's KV is.
"""
from __future__ import annotations

import dataclasses
import time

from connectors.transfer_params import RecvKV, SendKV
from pd_cluster.driver.messages import ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL, EngineRequest
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.engine_pool import EnginePool, EngineState, NoHealthyEngine
from pd_cluster.serving.routing.legs import GenerateJob, Leg, LegKind, Sent
from pd_cluster.serving.routing.peer_linker import PeerLinker


class Planner:
    def __init__(self, pool: EnginePool, mode: str, metrics: ProxyMetrics):
        self.pool, self.mode, self.metrics = pool, mode, metrics

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
        return [Leg(engine, request, len(job.prompt_token_ids) + (job.params.max_tokens or 1),
                    LegKind.WHOLE, token_ids=list(sent.token_ids), text=sent.text,
                    logprobs=list(sent.logprobs))]

    def plan(self, job: GenerateJob, excluded: set[str], rid: str,
             pinned: str | None = None) -> list[Leg]:
        """A fresh attempt: the legs, the one that ends the request first."""
        n_prompt = len(job.prompt_token_ids)
        max_tokens = job.params.max_tokens or 1
        base = dict(request_id=rid, prompt_token_ids=job.prompt_token_ids,
                    timeout=max(1.0, job.deadline - time.monotonic()))

        def whole(e: EngineState) -> list[Leg]:  # one engine computes the whole answer
            return [Leg(e, EngineRequest(params=job.params, **base), n_prompt + max_tokens,
                        LegKind.WHOLE)]

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
        d_kv, p_kv = RecvKV(), SendKV(to=d.kv_endpoint)
        return [Leg(d, EngineRequest(params=job.params, kv_transfer_params=d_kv, **base),
                    max_tokens + 1, LegKind.DECODE),
                Leg(p, EngineRequest(params=p_params, kv_transfer_params=p_kv, **base),
                    n_prompt, LegKind.PREFILL)]
