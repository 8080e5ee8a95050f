"""Decode steps on CUDA replayed from CUDA graphs, one captured per batch size of a ladder.

A decode step's forward is hundreds of small kernel launches whose CPU cost exceeds their GPU
time at small batches; a captured graph replays them with one launch. Each graph reads its
inputs from static buffers (token ids, positions, slots, block tables, sequence lengths) that
a step fills before the replay, and writes the hidden states into its own output; a step of
``n`` decodes replays the smallest captured size >= n, its padding rows marked so attention
neither writes them (slot -1) nor reads past block 0 (length 1).

Captured with ``max_seq_len`` = the model's length, so the attention kernels' launch grid
covers any context; they stop at each request's own length. A model whose decode cannot be
captured (an op that reads host values, e.g. a torch attention path) keeps running eagerly:
the failure is logged once, and nothing else changes.
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch

from pd_cluster.attention import AttentionBackend, AttentionMetadata
from pd_cluster.models.context import ForwardContext

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]


def batch_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64 and every 16 beyond, and ``max_num_seqs`` itself
    (padding a step to the next size wastes at most 15 rows)."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, max_num_seqs + 1, 16), max_num_seqs]
    return sorted({min(s, max_num_seqs) for s in sizes})


class DecodeGraphs:
    def __init__(self, forward: Forward, backend: AttentionBackend, kv_caches: list[torch.Tensor],
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.forward, self.backend, self.kv_caches = forward, backend, kv_caches
        self.max_model_len, self.block_size = max_model_len, block_size
        self.sizes = batch_ladder(max_num_seqs)
        n, width = self.sizes[-1], -(-max_model_len // block_size)
        self.width = width
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.rope_lens = torch.ones(n, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _context(self, bs: int) -> ForwardContext:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], num_decodes=bs,
            max_query_len=1, max_seq_len=self.max_model_len, block_size=self.block_size,
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[self.max_model_len] * bs)
        return ForwardContext(meta, self.kv_caches, self.backend, None,
                              rope_lens=self.rope_lens[:bs])

    @torch.inference_mode()
    def capture(self) -> bool:
        """Capture every size, largest first (the smaller ones share its memory pool).
        False (and nothing captured) when this model's decode cannot be captured."""
        pool = torch.cuda.graph_pool_handle()
        try:
            for bs in reversed(self.sizes):
                ctx = self._context(bs)
                args = (self.input_ids[:bs], self.positions[:bs])
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up: lazy inits, compilation
                    for _ in range(2):
                        self.forward(*args, ctx)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.forward(*args, ctx)
                self._graphs[bs] = (graph, out)
        except Exception as exc:  # an op this model's decode uses is not capturable
            logger.warning("CUDA graphs off for this model (decode runs eagerly): %s", exc)
            self._graphs.clear()
            return False
        torch.cuda.synchronize()
        return True

    def ready(self, num_tokens: int) -> bool:
        return bool(self._graphs) and num_tokens <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor,
            rope_lens: torch.Tensor) -> torch.Tensor:
        """One decode token per request (``n`` of them): the hidden states [n, hidden]."""
        n, w = input_ids.shape[0], block_tables.shape[1]
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.rope_lens[:n].copy_(rope_lens, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)  # padding rows: nothing written
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.seq_lens[n:bs].fill_(1)  # ... and one key read, in block 0
        self.block_tables[:n, :w].copy_(block_tables, non_blocking=True)
        self.block_tables[n:bs].zero_()
        graph, out = self._graphs[bs]
        graph.replay()
        self.replays += 1
        return out[:n]
