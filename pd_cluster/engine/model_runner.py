"""Turns a SchedulerOutput into one forward pass and sampled tokens (a ModelRunnerOutput)."""
from __future__ import annotations

import logging
from typing import Any

import torch

from pd_cluster.attention import AttentionMetadata, create_backend
from pd_cluster.config import EngineConfig
from pd_cluster.engine.cache_engine import (DeviceMemory, KVCacheSpec, allocate_kv_caches,
                                            determine_num_blocks)
from pd_cluster.engine.penalties import apply_penalties
from pd_cluster.engine.sampler import Sampler, apply_min_tokens_mask, token_logprobs
from pd_cluster.engine.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pd_cluster.models.llama import ForwardContext
from pd_cluster.models.loader import load_model

logger = logging.getLogger(__name__)
_LOGITS_CHUNK = 512  # prompt positions whose logits are materialised at once


def profile_batch(num_tokens: int, max_model_len: int, max_num_seqs: int
                  ) -> tuple[list[int], int]:
    """The worst step the scheduler can build: (prompt lengths, logits rows). ``num_tokens``
    (max_num_batched_tokens) split into prompts no longer than the model's positions, and one
    logits row per sequence that may sample in a step (max_num_seqs)."""
    lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lens.append(num_tokens % max_model_len)
    return lens, min(max_num_seqs, num_tokens)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: dict[str, Any],
                 max_model_len: int | None = None):
        self.config = config
        self.max_model_len = max_model_len or int(hf_config.get("max_position_embeddings", 2048))
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        before = self._allocated()
        self.model = load_model(config.model, hf_config, self.dtype, self.device)
        self.weights_bytes = self._allocated() - before  # this engine's, not the process's
        args = self.model.args
        self.kv_spec = KVCacheSpec(args.num_layers, config.block_size, args.num_kv_heads,
                                   args.head_dim, self.dtype)
        self.backend = create_backend(config.attention_backend, self.device)
        self.sampler = Sampler(seed=config.seed)
        self.kv_caches: list[torch.Tensor] = []
        self.connector: Any = None  # worker-side KV connector

    # ---- set-up --------------------------------------------------------------------------
    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def init_kv_cache(self, reserved_bytes: int = 0) -> int:
        """Allocate the paged KV cache; ``reserved_bytes``: device memory the KV connector
        will hold (sized before it exists)."""
        memory = None
        if self.device.type == "cuda" and self.config.num_kv_blocks is None:
            memory = DeviceMemory.measure(self.device, self.weights_bytes,
                                          self._profile_peak_bytes(), reserved_bytes)
        num_blocks = determine_num_blocks(
            self.kv_spec, self.device, self.config.num_kv_blocks, self.config.kv_cache_memory,
            self.config.gpu_memory_utilization, memory)
        self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, self.device)
        return num_blocks

    def _profile_peak_bytes(self) -> int:
        """Peak activation bytes of the worst step, measured on a throwaway cache."""
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.profile_forward()
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def profile_forward(self) -> None:
        """One forward (and the logits) of the largest batch the scheduler may run."""
        lens, rows = profile_batch(self.config.max_num_batched_tokens, self.max_model_len,
                                   self.config.max_num_seqs)
        bs = self.config.block_size
        per_seq = [-(-n // bs) for n in lens]
        caches = allocate_kv_caches(self.kv_spec, sum(per_seq), self.device)
        width, first = max(per_seq), 0
        tables = []
        for nb in per_seq:
            tables.append(list(range(first, first + nb)) + [0] * (width - nb))
            first += nb
        tables_t = torch.tensor(tables, dtype=torch.int32)
        positions = torch.cat([torch.arange(n) for n in lens])
        seq_of = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        slots = tables_t[seq_of, positions // bs].long() * bs + positions % bs
        query_start = [0]
        for n in lens:
            query_start.append(query_start[-1] + n)
        meta = self._metadata(slots, query_start, list(lens), tables_t, num_decodes=0)
        ctx = ForwardContext(meta, caches, self.backend)
        hidden = self.model(torch.zeros(len(positions), dtype=torch.long, device=self.device),
                            positions.to(self.device), ctx)
        self.model.compute_logits(hidden[:rows])
        del caches, hidden

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        if self.connector is not None and out.kv_connector_metadata is not None:
            self.connector.bind_connector_metadata(out.kv_connector_metadata)
            if self.connector.loads_layerwise:
                self.connector.start_load_kv(self.kv_caches)
        try:
            if out.scheduled:
                self._forward_and_sample(out.scheduled, result)
            if self.connector is not None:
                self.connector.wait_for_save()
        finally:
            if self.connector is not None:
                self.connector.clear_connector_metadata()
        if self.connector is not None:
            sending, recving = self.connector.get_finished()
            result.finished_sending, result.finished_recving = set(sending), dict(recving)
        return result

    def _forward_and_sample(self, scheduled: list[ScheduledRequest],
                            result: ModelRunnerOutput) -> None:
        # Decodes first: backends batch the one-token queries at the front.
        batch = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        tokens: list[int] = []
        positions: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sampling: list[int] = []  # batch indices whose step ends at the sequence end
        for i, item in enumerate(batch):
            req, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            tokens.extend(req.token_ids_range(start, end))
            positions.extend(range(start, end))
            query_start.append(query_start[-1] + item.num_new_tokens)
            seq_lens.append(end)
            if end == req.num_tokens:
                sampling.append(i)
        width = max(len(s.request.block_ids) for s in batch)
        tables = torch.tensor([s.request.block_ids + [0] * (width - len(s.request.block_ids))
                               for s in batch], dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.long)
        req_index = torch.repeat_interleave(
            torch.arange(len(batch)), torch.tensor([s.num_new_tokens for s in batch]))
        bs = self.config.block_size
        slots = tables[req_index, pos // bs].long() * bs + pos % bs
        num_decodes = sum(1 for s in batch if s.num_new_tokens == 1)
        meta = self._metadata(slots, query_start, seq_lens, tables, num_decodes)
        ctx = ForwardContext(meta, self.kv_caches, self.backend, self.connector)
        hidden = self.model(torch.tensor(tokens, device=self.device), pos.to(self.device), ctx)
        self._prompt_logprobs(batch, query_start, hidden)
        if not sampling:
            return
        last = torch.tensor([query_start[i + 1] - 1 for i in sampling], device=self.device)
        logits = self.model.compute_logits(hidden[last])
        reqs = [batch[i].request for i in sampling]
        if any(r.sampling_params.min_tokens for r in reqs):
            logits = apply_min_tokens_mask(logits, [r.sampling_params for r in reqs],
                                           [r.num_output_tokens for r in reqs], reqs[0].eos_token_id)
        logits = apply_penalties(logits, reqs)
        sampled = self.sampler.sample(logits, [r.sampling_params for r in reqs],
                                      [r.generator_for_next_token(logits.device) for r in reqs])
        for req, token, logprobs in zip(reqs, sampled.token_ids, sampled.logprobs):
            result.sampled_token_ids[req.request_id] = token
            result.logprobs[req.request_id] = logprobs

    def _prompt_logprobs(self, batch: list[ScheduledRequest], query_start: list[int],
                         hidden: torch.Tensor) -> None:
        """Extend each prompt_logprobs request's list with the prompt positions run now
        (position p's logits score prompt token p + 1)."""
        for i, item in enumerate(batch):
            req = item.request
            k = req.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = req.num_computed_tokens
            if start == 0:  # (re)computed from the beginning, e.g. after a preemption
                req.prompt_logprobs = [None]
            if len(req.prompt_logprobs) != start + 1:
                continue  # earlier positions were not computed here (their KV came from P)
            stop = min(start + item.num_new_tokens, req.num_prompt_tokens - 1)
            for a in range(start, stop, _LOGITS_CHUNK):  # bounds the [rows, vocab] logits
                b = min(a + _LOGITS_CHUNK, stop)
                first = query_start[i] + a - start
                logits = self.model.compute_logits(hidden[first:first + b - a])
                req.prompt_logprobs.extend(token_logprobs(
                    logits, req.prompt_token_ids[a + 1:b + 1], [k] * (b - a)))

    def _metadata(self, slots: torch.Tensor, query_start: list[int], seq_lens: list[int],
                  tables: torch.Tensor, num_decodes: int) -> AttentionMetadata:
        dev = self.device
        return AttentionMetadata(
            slot_mapping=slots.to(dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev, torch.int32), num_decodes=num_decodes,
            max_query_len=max(b - a for a, b in zip(query_start, query_start[1:])),
            max_seq_len=max(seq_lens), block_size=self.config.block_size,
            query_start_loc_cpu=list(query_start), seq_lens_cpu=list(seq_lens))
