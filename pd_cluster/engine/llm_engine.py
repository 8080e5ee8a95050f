"""The engine: step() = schedule -> run the model -> process outputs."""
from __future__ import annotations

import logging
import time
from typing import Any

from connectors.transfer_params import KVTransferParams, check_transfer_params
from kernels.cpu_build import kernel_stats
from pd_cluster import start_trace
from pd_cluster.config import EngineConfig, read_hf_config
from pd_cluster.engine.block_manager import BlockManager
from pd_cluster.engine.executor import Executor, max_model_len_of
from pd_cluster.engine.kv_tiers.setup import tier_manager
from pd_cluster.engine.output_processor import OutputProcessor
from pd_cluster.engine.scheduler import Scheduler
from pd_cluster.engine.spec.hidden_head import target_rows
from pd_cluster.engine.spec.setup import make_proposer, proposer_through_pd
from pd_cluster.engine.step_input import batch_order
from pd_cluster.engine.stop_checker import eos_ids
from pd_cluster.engine.structured.compiler import GrammarCompilerPool
from pd_cluster.engine.structured.masks import split_broken
from pd_cluster.engine.structured.waitlist import GrammarWaitlist
from pd_cluster.models.generation_config import read_eos_token_ids
from pd_cluster.outputs import RequestOutput
from pd_cluster.request import Request, RequestStatus
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.tokenizer_loader import load_tokenizer
from pd_cluster.validation import InvalidRequest, check_prompt

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


class LLMEngine:
    """Streaming interface: add requests, call step() for incremental outputs, abort any time."""

    def __init__(self, config: EngineConfig):
        self.config = config
        hf_config = read_hf_config(config.model)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        start_trace.mark("engine", "tokenizer loaded")
        self.vocab_size = hf_config["vocab_size"]
        self.max_model_len = max_model_len_of(config, hf_config)
        self.eos_token_id = read_eos_token_ids(config.model, hf_config,
                                               self.tokenizer.eos_token_id)
        self.executor = Executor(config, hf_config, self.max_model_len)
        self.runner = self.executor.runner  # rank 0's: its model, cache and connector
        start_trace.mark("engine", "model + KV cache ready")
        caching = config.enable_prefix_caching and self.runner.model.args.prefix_cacheable
        if config.enable_prefix_caching and not caching:
            logger.warning("prefix caching off: this model's RoPE depends on the sequence "
                           "length (longrope), so equal tokens need not have equal KV")
        if caching and config.speculative is not None and config.speculative.method == "mtp":
            # A prefix hit skips the target's forward there: no hidden states for the MTP
            # layer's own KV at those positions (it is not in the prefix cache).
            logger.warning("prefix caching off: speculative method mtp reads the target's "
                           "hidden state at every position")
            caching = False
        self.block_manager = BlockManager(self.executor.num_blocks, config.block_size, caching,
                                          tiers=tier_manager(config, self.runner),
                                          groups=self.runner.kv_spec.kv_groups)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len,
                                   self.executor.scheduler_connector)
        self.proposer = make_proposer(config, hf_config, self.executor, self.tokenizer,
                                      self.max_model_len)
        self.scheduler.proposer = self.proposer
        self.draft_pd = proposer_through_pd(config, hf_config, self.executor, self.proposer)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.grammars = GrammarCompilerPool(config.structured_outputs, self.tokenizer,
                                            self.vocab_size, list(eos_ids(self.eos_token_id)))
        self.compiling = GrammarWaitlist()  # requests waiting for their grammar
        self.num_grammar_failures = 0  # requests ended: grammar did not compile, or broke

    def kv_endpoint(self) -> str | None:
        """Where producers send this engine's prompt KV (None without a consumer connector)."""
        return self.executor.kv_endpoint()

    def connect_kv_peer(self, endpoint: str, tag: str | None = None) -> None:
        """Producer: handshake with a consumer's endpoint. Thread safe, and meant to run off
        the engine thread (it blocks up to the pipe's handshake_timeout)."""
        if self.runner.connector is None:
            raise ValueError("kv_transfer: this engine has no KV connector")
        self.executor.connect_peer(endpoint, tag)

    def disconnect_kv_peer(self, endpoint: str) -> None:
        """Producer: forget a consumer that is gone for good. Thread safe."""
        if self.runner.connector is not None:
            self.executor.disconnect_peer(endpoint)

    def kv_peers(self) -> dict[str, str | None]:
        """Consumers this producer has a working handshake with (endpoint -> tag)."""
        return self.runner.connector.peers() if self.runner.connector else {}

    def set_kv_role(self, role: str, max_prefill_tokens_per_step: int | None = None
                    ) -> str | None:
        """Switch a drained engine's KV role (producer | consumer | both) in place, weights and
        cache kept, and the per-step prefill cap that goes with it; returns the new KV
        endpoint (None for a producer). ValueError while a request is in flight."""
        if self.runner.connector is None:
            raise ValueError("kv_transfer: this engine has no KV connector")
        if self.has_unfinished_requests():
            raise ValueError("role: the engine still has requests in flight; drain it first")
        endpoint = self.executor.set_kv_role(role)
        self.scheduler.config = self.scheduler.config.model_copy(
            update={"max_prefill_tokens_per_step": max_prefill_tokens_per_step})
        return endpoint

    def kv_holds(self) -> dict[str, int]:
        """What the KV connector still holds (staging bytes, receives, send leases)."""
        return self.executor.kv_holds()

    def close(self) -> None:
        """Stop the connector, any tensor-parallel workers and the grammar compilers."""
        self.grammars.close()
        self.executor.close()
        tiers = self.block_manager.tiers
        if tiers is not None and tiers.disk is not None:
            tiers.disk.close()

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt: expected str, list of token ids or dict, got "
                         f"{type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    kv_transfer_params: KVTransferParams | None = None,
                    resume_token_ids: list[int] | None = None,
                    resume_text_len: int = 0) -> Request:
        """``resume_token_ids``: continue a request another engine was generating (its output
        so far; ``resume_text_len`` characters of its text were already delivered). The prompt
        and that output are recomputed here, like a preempted request, and generation goes on
        exactly where it stopped (seeded sampling included: token i is drawn from (seed, i))."""
        text, token_ids = self.tokenize(prompt)
        self._validate(token_ids, params)
        check_transfer_params(kv_transfer_params)
        if request_id in self.compiling:
            raise ValueError(f"request_id {request_id!r} is already in use")
        resume = list(resume_token_ids or [])
        if resume and (len(resume) >= (params.max_tokens or self.max_model_len)
                       or len(token_ids) + len(resume) >= self.max_model_len):
            raise ValueError("resume_token_ids: the request has no tokens left to generate")
        request = Request(request_id, token_ids, params, self.eos_token_id,
                          kv_transfer_params=None if resume else kv_transfer_params,
                          output_token_ids=resume, output_logprobs=[None] * len(resume),
                          prefill_locally=bool(resume))
        if params.structured_outputs is not None:
            request.grammar = self.grammars.start(params.structured_outputs)
        if request.grammar is not None and not request.grammar.ready:
            if request_id in self.scheduler.requests:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self.compiling.hold(request)  # the scheduler gets it once its grammar compiled
        else:
            self.scheduler.add_request(request)
        self.outputs.add(request, text, resume_text_len)
        return request

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        room = check_prompt(token_ids, self.vocab_size, self.max_model_len)
        max_total = len(token_ids) + min(params.max_tokens or room, room)
        bm = self.block_manager
        capacity = bm.num_usable_blocks * self.config.block_size // len(bm.groups)
        chunk = self.config.max_num_batched_tokens
        if bm.blocks_held_at_most(max_total, chunk) > bm.num_usable_blocks:
            raise InvalidRequest(f"prompt + max_tokens: up to {max_total} tokens do not fit the "
                                 f"KV cache ({capacity} tokens); lower max_tokens or add "
                                 f"num_kv_blocks", "max_tokens")

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        aborted = [r for r in map(self.compiling.pop, request_ids) if r is not None]
        for request in aborted:
            request.status = RequestStatus.FINISHED_ABORTED
            request.finish_reason = request.status.value
        aborted += self.scheduler.abort(list(request_ids))
        if self.proposer is not None:
            self.proposer.release(list(request_ids))  # its per-request state (draft KV)
        if self.draft_pd is not None:
            self.draft_pd.sweep(self.scheduler.requests)
        return [self.outputs.finished_output(r) for r in aborted]

    def has_unfinished_requests(self) -> bool:
        # A failed rank counts as work: the engine loop steps, the step raises, and the
        # engine is restarted even when idle.
        return (self.scheduler.has_unfinished() or bool(self.scheduler.sending)
                or bool(self.scheduler.block_manager.fenced) or self.executor.failed
                or bool(self.compiling))

    def prefill_tokens_pending(self) -> int:
        """Prompt tokens left to compute, at most one step's budget: the next step's prefill
        work (a prefill engine borrowing cores sizes its borrow by it)."""
        s = self.scheduler
        n = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0)
                for r in (*s.waiting, *s.running))
        return min(n, self.config.max_num_batched_tokens)

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        failed = self._admit_compiled()
        sched_out = self.scheduler.schedule()
        if not sched_out.scheduled and self.runner.connector is not None:
            # Only waiting on transfers (KV arriving, ACKs): don't spin a core meanwhile.
            time.sleep(0.001)
        cost = getattr(self.proposer, "backoff", None)
        cost = cost.cost if cost is not None and sched_out.scheduled and all(
            item.request.is_decoding for item in sched_out.scheduled) else None
        started = time.perf_counter()
        result = self.executor.execute(sched_out)
        self.scheduler.step_times.add(sched_out.num_tokens, time.perf_counter() - started)
        if cost is not None:  # a decode-only step: what its width cost (spec/step_cost.py)
            cost.record(sum(item.num_new_tokens for item in sched_out.scheduled),
                        time.perf_counter() - started)
        capture = getattr(self.proposer, "capture", None)
        if capture is not None and sched_out.scheduled:  # hidden-state heads (spec/hidden_head.py)
            capture(target_rows(batch_order(sched_out.scheduled)), self.runner.last_hidden)
        if self.draft_pd is not None:  # P: the draft's prefill of the chunks it ships
            self.draft_pd.after_forward(sched_out)
        updated = self.scheduler.update_from_output(sched_out, result)
        updated, broken = split_broken(updated)
        failed += self._end_broken_grammars(broken)
        outputs, to_finish = self.outputs.process(updated)
        for request, status in to_finish:
            self.scheduler.finish(request, status)
        if self.draft_pd is not None:
            self.draft_pd.sweep(self.scheduler.requests)
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        return failed + outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready go to the scheduler; a failed one ends (aborted).
        With nothing else to run, waits a little for a grammar rather than spin."""
        if not self.compiling:
            return []
        idle = not self.scheduler.has_unfinished() and not self.scheduler.sending
        ready, failed = self.compiling.released(wait=0.005 if idle else 0.0)
        for request in ready:
            self.scheduler.add_request(request)
        for request in failed:
            request.status = RequestStatus.FINISHED_ABORTED
            request.finish_reason = request.status.value
        return [self._ended_by_grammar(r, f"structured_outputs: {r.grammar.error()}")
                for r in failed]

    def _end_broken_grammars(self, broken: list[Request]) -> list[RequestOutput]:
        """End requests whose grammar broke this step (request_grammar.py): the token sampled
        without a working grammar is dropped, never emitted; the error says why."""
        for request in broken:
            request.output_token_ids.pop()
            request.output_logprobs.pop()
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return [self._ended_by_grammar(r, r.grammar.failure) for r in broken]

    def _ended_by_grammar(self, request: Request, error: str) -> RequestOutput:
        self.num_grammar_failures += 1
        out = self.outputs.finished_output(request)
        out.outputs[0].error = error
        return out

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {"num_waiting": len(self.scheduler.waiting) + len(self.compiling),
                "num_running": len(self.scheduler.running),
                "num_waiting_for_remote_kv": len(self.scheduler.remote_waiting),
                "num_kv_fenced_blocks": self.scheduler.block_manager.num_fenced_blocks,
                "kv_blocks_total": bm.num_blocks, "kv_blocks_used": bm.num_used_blocks,
                "kv_blocks_free": bm.num_free_blocks,
                "prefix_cache_queried_blocks": bm.stats.queried_blocks,
                "prefix_cache_hit_blocks": bm.stats.hit_blocks,
                "num_preemptions": self.scheduler.num_preemptions,
                "grammar_failures": self.num_grammar_failures,
                "kv_fallbacks": self.scheduler.num_kv_fallbacks,
                **self.scheduler.spec_stats.as_stats(),
                **(self.proposer.stats() if self.proposer is not None else {}),
                **self._kv_bytes(),
                **self._tier_stats(),
                **kernel_stats(),  # C++ CPU kernels: ok / failed: why / off
                **self.runner.compile_stats(),
                **self.executor.rank_stats(),
                **(self.executor.connector_stats() if self.runner.connector else {})}

    def _kv_bytes(self) -> dict[str, Any]:
        """What the engine's KV cache holds per token over all its ranks (an FP8 cache's
        scales included), and its element type."""
        spec = self.runner.kv_spec
        per_token = spec.token_bytes * self.config.tensor_parallel_size
        return {"kv_cache_dtype": self.config.kv_cache_dtype, "kv_bytes_per_token": per_token}

    def _tier_stats(self) -> dict[str, Any]:
        """The KV tiers' counters (absent without tiers); cumulative."""
        tiers = self.block_manager.tiers
        if tiers is None:
            return {}
        return {**tiers.stats(),
                "kv_offload_restore_seconds": self.runner.tier_store.restore_seconds}

    def check_no_leaks(self) -> None:
        """AssertionError unless no request is left, every KV block is free and no KV tier
        op is pending (no host slot pinned)."""
        self.scheduler.check_no_leaks()
        if self.draft_pd is not None:
            self.draft_pd.check_no_leaks()
        if self.proposer is not None:
            self.proposer.check_no_leaks()
        if self.compiling:
            raise AssertionError("requests left waiting for their grammar")
        if self.outputs.states:
            raise AssertionError(f"output state left for {sorted(self.outputs.states)[:10]}")


__all__ = ["LLMEngine", "PromptType", "RequestStatus"]
