"""Per-request bookkeeping in the proxy: its admission (a running slot, maybe after a wait in
the queue), latency and token metrics (vLLM's series), and one access-log line when the
request ends. The clock starts when the request arrives: queue time counts in its TTFT."""
from __future__ import annotations

import logging
import time
from typing import Any

from pd_cluster.serving.routing.admission import Admission

access_log = logging.getLogger("pd_cluster.access")

_STATUS = {"success": 200, "client_error": 400, "rejected": 429, "aborted": 499, "error": 500,
           "shutdown": 503}


class RequestTracker:
    def __init__(self, state: Any, request_id: str):
        self.state, self.m, self.request_id = state, state.metrics, request_id
        state.inflight += 1
        self.m.inflight.inc()
        self.n_prompt, self.n_output = 0, 0
        self.start = self.last = time.monotonic()
        self.ttft: float | None = None
        self.finish_reason: str | None = None
        self.closed = False
        self._admission: Admission | None = None  # holding a running slot of it
        self.queue_time = 0.0
        self.jobs: list[Any] = []  # GenerateJobs: their routes go in the access log line

    async def admit(self, admission: Admission, deadline: float) -> None:
        """Wait for a running slot (see Admission.enter for what it raises)."""
        self.queue_time = await admission.enter(deadline)
        self._admission = admission

    def count_prompt(self, n_prompt: int) -> None:
        """The request's prompts were tokenized (once admitted): ``n_prompt`` tokens."""
        self.n_prompt = n_prompt
        self.m.vllm.prompt_tokens.inc(n_prompt)

    def planned(self, jobs: list[Any]) -> None:
        """The request's jobs are chosen: it counts as an arrival for the SLO controller."""
        self.jobs = jobs
        window = getattr(self.state, "planner_window", None)
        if window is not None and jobs:
            window.arrived(self.n_prompt, jobs[0].params.max_tokens or 1)

    def on_event(self, ev: Any) -> None:
        now = time.monotonic()
        if ev.token_ids or ev.text:
            if self.ttft is None:
                self.ttft = now - self.start
                self.m.vllm.ttft.observe(self.ttft)
            else:
                self.m.vllm.itl.observe(now - self.last)
            self.last = now
        self.n_output += len(ev.token_ids)
        self.finish_reason = ev.finish_reason or self.finish_reason
        self.m.vllm.generation_tokens.inc(len(ev.token_ids))

    def close(self, outcome: str, status: int | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        self.state.inflight -= 1
        self.m.inflight.dec()
        self.m.requests.labels(outcome).inc()
        latency = time.monotonic() - self.start
        if self._admission is not None:
            self._admission.leave(latency - self.queue_time)
        if outcome == "success":
            self.m.vllm.e2e.observe(latency)
            first = self.jobs[0] if self.jobs else None
            # n: the choices of one prompt (choice_jobs shares its token list between them)
            n = sum(1 for j in self.jobs if j.prompt_token_ids is first.prompt_token_ids) \
                if first is not None else 1
            self.m.vllm.finished(self.queue_time, self.ttft, latency, self.n_prompt,
                                 self.n_output, n,
                                 first.params.max_tokens if first is not None else None)
            self.m.vllm.success.labels(self.m.vllm.model_name, self.finish_reason or "stop").inc()
            self._tell_planner(latency)
        ttft = f"{self.ttft * 1e3:.1f}ms" if self.ttft is not None else "-"
        route = ",".join(job.route for job in self.jobs if job.route) or "-"
        access_log.info("%s %d %s prompt_tokens=%d output_tokens=%d ttft=%s latency=%.1fms "
                        "queued=%.1fms route=%s", self.request_id,
                        status or _STATUS.get(outcome, 500), outcome, self.n_prompt,
                        self.n_output, ttft, latency * 1e3, self.queue_time * 1e3, route)

    def _tell_planner(self, latency: float) -> None:
        window = getattr(self.state, "planner_window", None)
        if window is None or self.ttft is None:
            return
        tpot = (latency - self.ttft) / (self.n_output - 1) if self.n_output > 1 else None
        window.finished(self.n_prompt, self.n_output, self.ttft, tpot, self.start)
