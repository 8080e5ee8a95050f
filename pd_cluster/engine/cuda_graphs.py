"""Decode steps on CUDA replayed from CUDA graphs, one captured per (batch size, context bucket).

A decode step's forward is hundreds of small kernel launches whose CPU cost exceeds their GPU
time at small batches; a captured graph replays them with one launch. Each graph reads its
inputs from static buffers (token ids, positions, slots, block tables, sequence lengths) that
a step fills before the replay, and writes the hidden states into its own output; a step of
``n`` decodes replays the smallest captured size >= n, its padding rows marked so attention
neither writes them (slot -1) nor reads past block 0 (length 1).

The decode kernel's split plan (how many partitions a context is cut into) is fixed at capture
by the ``max_seq_len`` it sees, so each batch size is captured once per context bucket (powers
of two from the kernel's shortest partition up to the model's length): a step replays the
graph of the smallest bucket >= its longest context, not a plan sized for the full model length.
Graphs are captured at start, largest first, into one shared memory pool, until the pool passes
its bound; a step whose graph was cut off replays a larger one or runs eagerly (``pick_graph``).

Tensor parallelism: the warm-ups run every rank's collectives for real, the captures only record
them, so each phase ends with the ranks agreeing (``agree``): a rank whose capture failed makes
every rank run eagerly, and all keep the same graphs (a replay's padded collectives must meet
the same replay on the other ranks). A model whose decode cannot be captured (an op that reads
host values, e.g. a torch attention path) keeps running eagerly: logged once, nothing else.
Off by default (engine.cuda_graphs) until scripts/gpu_check.sh has passed them on a GPU.
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable, Collection

import torch
import torch.distributed as dist

from pd_cluster.attention import AttentionBackend, AttentionMetadata
from pd_cluster.models.context import ForwardContext
from pd_cluster.models.layers.tp import TPGroup

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]
GraphKey = tuple[int, int]  # (batch size, context bucket)
# The decode kernel's shortest partition (kernels/paged_decode_attention.py MIN_PARTITION):
# contexts up to it run one split whatever their length, so finer buckets change nothing.
MIN_CONTEXT_BUCKET = 256


def batch_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64 and every 16 beyond, and ``max_num_seqs`` itself
    (padding a step to the next size wastes at most 15 rows)."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, max_num_seqs + 1, 16), max_num_seqs]
    return sorted({min(s, max_num_seqs) for s in sizes})


def context_ladder(max_model_len: int, smallest: int = MIN_CONTEXT_BUCKET) -> list[int]:
    """Powers of two from ``smallest`` below ``max_model_len``, then ``max_model_len``."""
    buckets, c = [], smallest
    while c < max_model_len:
        buckets.append(c)
        c *= 2
    return buckets + [max_model_len]


def capture_order(batch_sizes: list[int], buckets: list[int]) -> list[GraphKey]:
    """Largest first: the first graph sizes the shared pool (the others reuse its memory), and
    what the pool's bound cuts off are small graphs whose steps can replay a larger one."""
    return [(b, c) for b in reversed(batch_sizes) for c in reversed(buckets)]


def pick_graph(n: int, max_seq_len: int, captured: Collection[GraphKey]) -> GraphKey | None:
    """The graph a step of ``n`` decodes whose longest context is ``max_seq_len`` replays: the
    smallest captured batch size >= n, with its smallest bucket >= max_seq_len (padding rows
    cost more than a coarser split plan). None: no graph fits, the step runs eagerly."""
    return min((k for k in captured if k[0] >= n and k[1] >= max_seq_len), default=None)


def capture_within(keys: list[GraphKey], capture_one: Callable[[GraphKey], None],
                   used_bytes: Callable[[], int], max_bytes: int) -> tuple[bool, int]:
    """Capture ``keys`` in order until one fails (False, its index) or the pool has grown past
    ``max_bytes`` (True, how many were captured); (True, len(keys)) when all were."""
    start = used_bytes()
    for i, key in enumerate(keys):
        if i and used_bytes() - start > max_bytes:
            logger.info("CUDA graphs: %d of %d captured (the pool's bound, %d MiB, is reached; "
                        "the other steps replay larger graphs)", i, len(keys), max_bytes >> 20)
            return True, i
        try:
            capture_one(key)
        except Exception as exc:  # an op this model's decode uses is not capturable
            logger.warning("CUDA graphs off for this model (decode runs eagerly): capturing "
                           "batch %d, context %d: %s", key[0], key[1], exc)
            return False, i
    return True, len(keys)


def pool_bound(total_bytes: int, utilization: float) -> int:
    """The graphs' pool bound: half of what ``gpu_memory_utilization`` leaves outside the
    engine's budget (the pool is not in the KV budget), at least 256 MiB."""
    return max(256 << 20, int(total_bytes * (1 - utilization) / 2))


def agree(ok: bool, count: int, tp: TPGroup, device: torch.device) -> tuple[bool, int]:
    """Every rank's (all succeeded, fewest captured): a collective on the engine's TP group
    (NCCL on GPUs, Gloo on CPUs), so every rank leaves with the same answer."""
    if tp.size == 1:
        return ok, count
    flags = torch.tensor([int(ok), count], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=tp.group)
    return bool(flags[0].item()), int(flags[1].item())


class DecodeGraphs:
    def __init__(self, forward: Forward, backend: AttentionBackend, kv_caches: list[torch.Tensor],
                 max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, tp: TPGroup = TPGroup(),
                 max_pool_bytes: int = 1 << 30) -> None:
        self.forward, self.backend, self.kv_caches = forward, backend, kv_caches
        self.max_model_len, self.block_size = max_model_len, block_size
        self.device, self.tp, self.max_pool_bytes = device, tp, max_pool_bytes
        self.sizes = batch_ladder(max_num_seqs)
        self.buckets = context_ladder(max_model_len)
        n, width = self.sizes[-1], -(-max_model_len // block_size)
        self.width = width
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.rope_lens = torch.ones(n, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._picks: dict[tuple[int, int], GraphKey | None] = {}  # (n, bucket) -> graph
        self._pool = None
        self.replays: dict[GraphKey, int] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _context(self, key: GraphKey) -> ForwardContext:
        bs, bucket = key
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], num_decodes=bs,
            max_query_len=1, max_seq_len=bucket, block_size=self.block_size,
            query_start_loc_cpu=list(range(bs + 1)), seq_lens_cpu=[bucket] * bs)
        return ForwardContext(meta, self.kv_caches, self.backend, None,
                              rope_lens=self.rope_lens[:bs])

    def _warm_up(self, keys: list[GraphKey]) -> None:
        """Each graph's forward run eagerly first (lazy inits, kernel compilation), on a side
        stream as capture wants. Every rank runs the same collectives here."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for key in keys:
                for _ in range(2):
                    self.forward(self.input_ids[:key[0]], self.positions[:key[0]],
                                 self._context(key))
        torch.cuda.current_stream().wait_stream(stream)

    def _capture_one(self, key: GraphKey) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.forward(self.input_ids[:key[0]], self.positions[:key[0]],
                               self._context(key))
        self._graphs[key] = (graph, out)

    @torch.inference_mode()
    def capture(self) -> bool:
        """Warm up, then capture, every (batch size, bucket), agreeing with the other ranks
        after each phase. False (and nothing kept) when any rank could not capture."""
        keys = capture_order(self.sizes, self.buckets)
        self._pool = torch.cuda.graph_pool_handle()
        try:
            self._warm_up(keys)
            warmed = True
        except Exception as exc:  # e.g. the same op failing on every rank, before a collective
            logger.warning("CUDA graphs off (decode runs eagerly): warm-up failed: %s", exc)
            warmed = False
        ok, _ = agree(warmed, len(keys), self.tp, self.device)
        count = 0
        if ok:  # captures only record collectives: a rank that stops early blocks no one
            ok, count = capture_within(keys, self._capture_one,
                                       lambda: torch.cuda.memory_reserved(self.device),
                                       self.max_pool_bytes)
            ok, count = agree(ok, count, self.tp, self.device)
        kept = set(keys[:count]) if ok else set()
        self._graphs = {k: v for k, v in self._graphs.items() if k in kept}
        self._picks.clear()
        torch.cuda.synchronize(self.device)
        return bool(self._graphs)

    def pick(self, n: int, max_seq_len: int) -> GraphKey | None:
        i = bisect.bisect_left(self.buckets, max_seq_len)
        bucket = self.buckets[i] if i < len(self.buckets) else max_seq_len
        if (n, bucket) not in self._picks:
            self._picks[(n, bucket)] = pick_graph(n, bucket, self._graphs)
        return self._picks[(n, bucket)]

    def ready(self, num_tokens: int, max_seq_len: int) -> bool:
        return bool(self._graphs) and self.pick(num_tokens, max_seq_len) is not None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor, rope_lens: torch.Tensor,
            max_seq_len: int) -> torch.Tensor:
        """One decode token per request (``n`` of them, the longest context ``max_seq_len``;
        ``ready`` said a graph fits): the hidden states [n, hidden]."""
        n, w = input_ids.shape[0], block_tables.shape[1]
        key = self.pick(n, max_seq_len)
        assert key is not None, "run() without ready()"
        bs = key[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.rope_lens[:n].copy_(rope_lens, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)  # padding rows: nothing written
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.seq_lens[n:bs].fill_(1)  # ... and one key read, in block 0
        self.block_tables[:n, :w].copy_(block_tables, non_blocking=True)
        self.block_tables[n:bs].zero_()
        graph, out = self._graphs[key]
        graph.replay()
        self.replays[key] = self.replays.get(key, 0) + 1
        return out[:n]
