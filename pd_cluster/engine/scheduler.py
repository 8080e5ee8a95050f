"""Continuous batching with chunked prefill, preemption by recompute, and remote-KV parking.

Each step gives every scheduled request a number of new tokens to compute (a whole or partial
prompt, or one decode token), within ``max_num_batched_tokens`` and ``max_num_seqs``. Running
requests go first; when blocks run out the newest running request is preempted (its blocks
freed, recomputed later from scratch), so the oldest requests always make progress.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pd_cluster.config import EngineConfig
from pd_cluster import ttft_trace
from pd_cluster.engine import prompt_budget
from pd_cluster.engine.block_manager import BlockManager
from pd_cluster.engine.step_time_model import StepTimeModel
from pd_cluster.engine.spec.stats import SpecStats
from pd_cluster.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # the drafts included
    spec_token_ids: list[int] = field(default_factory=list)  # verified this step


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    kv_connector_metadata: Any = None
    tier_ops: Any = None  # KV tier ops (engine/kv_tiers/ops.py) decided while scheduling

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float] | None] = field(default_factory=dict)
    finished_sending: set[str] = field(default_factory=set)
    # request id -> first token sampled by the producer, or None when the transfer failed
    finished_recving: dict[str, int | None] = field(default_factory=dict)
    # ended receives no producer can write into any more (connectors/base.FinishedTransfers)
    unfenced: set[str] = field(default_factory=set)
    # Speculation: request id -> the drafts accepted (before its sampled token), their logprobs
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[dict[int, float] | None]] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 connector: Any = None):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.connector = connector  # scheduler-side KV connector, or None when colocated
        self.waiting: deque[Request] = deque()
        # Tokens the next step may take at most, once (None: max_num_batched_tokens).
        self.next_step_budget: int | None = None
        self.running: list[Request] = []
        self.remote_waiting: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV
        self.sending: dict[str, Request] = {}  # finished, blocks pinned until the send completes
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_kv_fallbacks = 0
        self.proposer: Any = None  # speculation's proposer (told each verification's outcome)
        self.step_times = StepTimeModel()  # the engine records each step's width and time
        self.clock = time.monotonic  # token times (the mixed steps' TPOT slack)
        self.spec_stats = SpecStats(config.speculative.max_drafts
                                    if config.speculative else 0)

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        ttft_trace.mark(request.request_id, "add", side=_side(request))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.remote_waiting)

    def abort(self, request_ids: list[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is not None and not request.is_finished:
                self.finish(request, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
        return aborted

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take the request out of every queue and release (or pin) its blocks."""
        request.status = status
        request.finish_reason = status.value
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        receiving = self.remote_waiting.pop(request.request_id, None) is not None
        delay_free = False
        if self.connector is not None:
            delay_free = self.connector.request_finished(request, request.block_ids)
        if delay_free and self.block_manager.holds(request.request_id):
            self.sending[request.request_id] = request
        elif receiving:  # its receive is cancelled: a producer may still write into its blocks
            self.block_manager.fence(request)
            self.requests.pop(request.request_id, None)
        else:
            self._release(request)

    def _release(self, request: Request) -> None:
        self.block_manager.free(request)
        self.requests.pop(request.request_id, None)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.next_step_budget is not None:  # one step's own budget (core lending sizes it)
            budget, self.next_step_budget = min(budget, self.next_step_budget), None
        prefill_budget = self._prefill_budget(budget)
        scheduled_ids: set[str] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts(request, num_new, budget, len(self.running) - i - 1)
            if not request.is_decoding:
                num_new = min(num_new, prefill_budget)
                if num_new == 0:  # the cap is spent: this prefill goes on next step
                    i += 1
                    continue
                prefill_budget -= num_new
                ttft_trace.mark(request.request_id, "chunk", n=num_new)
            while not self.block_manager.can_append(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            self.block_manager.append_slots(request, num_new + len(drafts))
            out.scheduled.append(ScheduledRequest(request, num_new + len(drafts), drafts))
            scheduled_ids.add(request.request_id)
            budget -= num_new + len(drafts)
            i += 1

        while (self.waiting and budget > 0 and not out.preempted_ids
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            # Remote KV: the producer samples token 1, so every full prompt block may hit
            # this engine's cache; only the rest is asked for (external tokens).
            remote = self.connector is not None and request.kv_from_remote
            if prefill_budget <= 0 and not remote:
                break  # the prefill cap is spent; remote ones compute nothing here
            # Cached prompt tokens have no logits to score them with.
            use_cache = (request.sampling_params.prompt_logprobs is None
                         and (not remote or request.kv_transfer_params.reuse_prefix))
            num_external, load_async = 0, False
            if self.connector is not None and not request.prefill_locally:
                local = self.block_manager.num_cached_tokens(request, not remote) \
                    if use_cache and remote else 0
                num_external, load_async = self.connector.get_num_new_matched_tokens(
                    request, local)
            # What the first step computes at most (a sliding group's table covers only it).
            first_step = None if remote else min(budget, prefill_budget)
            if not self.block_manager.can_allocate(request, use_cache, not remote, first_step):
                break
            self.waiting.popleft()
            cached = self.block_manager.allocate(request, use_cache, not remote, first_step)
            if request.num_preemptions == 0:
                request.num_cached_tokens = cached
            request.num_computed_tokens = cached
            if self.connector is not None and (num_external or load_async):
                # The split as allocated (a hit can only grow between the two lookups).
                self.connector.update_state_after_alloc(
                    request, request.block_ids,
                    request.num_prompt_tokens - cached if remote else num_external)
            ttft_trace.mark(request.request_id, "admit", side=_side(request), cached=cached,
                            remote=bool(load_async))
            if load_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KV
                self.remote_waiting[request.request_id] = request
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget,
                          prefill_budget)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            ttft_trace.mark(request.request_id, "chunk", n=num_new)
            budget -= num_new
            prefill_budget -= num_new

        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        out.tier_ops = self.block_manager.take_tier_ops()
        return out

    def _prefill_budget(self, budget: int) -> int:
        """Prompt tokens this step may take beside its decodes (prompt_budget.py)."""
        return prompt_budget.prompt_tokens(self.config, self.step_times, self.clock(),
                                           self.running, self.waiting, self.max_model_len,
                                           budget)

    def _drafts(self, request: Request, num_new: int, budget: int, others: int) -> list[int]:
        """The proposed tokens a decoding request verifies this step (taken off it): what
        the budget leaves after one token for each of the ``others`` running after it, and
        only in free blocks those others cannot need (a draft never preempts anyone)."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or not request.is_decoding or num_new != 1:
            return []
        drafts = drafts[:max(0, budget - num_new - others)]
        bm = self.block_manager
        extra = bm.new_blocks_needed(request, request.num_computed_tokens + num_new + len(drafts))
        if drafts and extra > 0 and bm.num_free_blocks - extra < (others + 1) * len(bm.groups):
            return []
        return drafts

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        request.prefill_locally = True  # recompute here: the remote KV will not come again
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s (recompute)", request.request_id)

    # ---- results -------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens; returns requests with a new token."""
        updated = []
        now = self.clock()
        for item in out.scheduled:
            request = item.request
            if request.is_finished:  # aborted between schedule and update
                continue
            token = result.sampled_token_ids.get(request.request_id)
            if item.spec_token_ids and token is not None:
                # KV of the last token and the accepted drafts is kept; the rejected drafts'
                # slots go back (their blocks beyond the kept tokens).
                accepted = result.accepted_token_ids.get(request.request_id, [])
                self.spec_stats.record(len(item.spec_token_ids), len(accepted))
                if self.proposer is not None:
                    self.proposer.observe(request, len(item.spec_token_ids), len(accepted))
                request.num_computed_tokens += item.num_new_tokens - len(item.spec_token_ids) \
                    + len(accepted)
                request.output_token_ids.extend(accepted)
                request.output_logprobs.extend(result.accepted_logprobs[request.request_id])
                self.block_manager.trim(request)
            else:
                request.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(request)
            if token is None:
                continue
            request.output_token_ids.append(token)
            request.output_logprobs.append(result.logprobs.get(request.request_id))
            request.mark_token_time(now)
            if len(request.output_token_ids) == 1:
                ttft_trace.mark(request.request_id, "tok1")
            updated.append(request)
        for rid, first_token in result.finished_recving.items():
            updated.extend(self._remote_kv_ready(rid, first_token))
        for rid in result.unfenced:
            self.block_manager.lift_fence(rid)
        for rid in result.finished_sending:
            request = self.sending.pop(rid, None)
            if request is not None:
                self._release(request)
        return updated

    def _remote_kv_ready(self, request_id: str, first_token: int | None) -> list[Request]:
        request = self.remote_waiting.pop(request_id, None)
        if request is None:
            return []
        if first_token is None:
            self.num_kv_fallbacks += 1
            logger.warning("KV for %s did not arrive; prefilling locally", request_id)
            # KV did not (fully) arrive: the blocks may hold partial data, and a producer
            # may still write into them (in place, late): they are fenced until the
            # connector says none can, and the whole prompt is computed here, in new blocks.
            self.block_manager.fence(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            request.prefill_locally = True
            self.waiting.appendleft(request)
            return []
        ttft_trace.mark(request_id, "kv_ready")
        request.num_computed_tokens = request.num_prompt_tokens
        # Blocks a sliding layer did not receive stay out of the prefix cache.
        self.block_manager.skip_caching(request, self.connector.unshipped_blocks(request))
        self.block_manager.cache_full_blocks(request)
        request.output_token_ids.append(first_token)
        request.output_logprobs.append(None)
        request.mark_token_time(self.clock())
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return [request]

    # ---- introspection -------------------------------------------------------------------
    def check_no_leaks(self) -> None:
        if self.requests or self.has_unfinished() or self.sending:
            raise AssertionError(f"requests left in scheduler: {sorted(self.requests)[:10]}")
        self.block_manager.check_no_leaks()


def _side(request: Request) -> str:
    """For the TTFT trace: D (KV from P), P (KV to D) or W (the whole request here)."""
    if request.kv_from_remote:
        return "D"
    return "P" if type(request.kv_transfer_params).__name__ == "SendKV" else "W"
