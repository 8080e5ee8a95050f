"""A HiddenStateHead's (hidden_head.py) own paged KV cache and block pool, and its batched
forwards: each chunk's positions run through the head, which returns the head's state at the
chunk's last position and the greedy token after it.

Its own pool (as the draft model's, draft_runner.py, and for the same reasons: the head writes
positions past the request's tokens, its chained drafts, before the scheduler gives the target
any lookahead slot; its leak check is a count). It holds as many tokens as the target's cache
plus k per sequence, so it never runs out before the target does; when it does anyway, the
request gets no drafts that step (still lossless). Rank 0, unsharded, eager."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from pd_cluster.config import EngineConfig
from pd_cluster.engine.cache_engine import KVCacheSpec, allocate_kv_caches
from pd_cluster.engine.input_buffers import InputBuffers
from pd_cluster.engine.spec.block_pool import BlockPool
from pd_cluster.engine.spec.hidden_head import HiddenStateHead
from pd_cluster.engine.step_input import StepInput
from pd_cluster.models.context import ForwardContext

logger = logging.getLogger(__name__)


@dataclass
class HeadChunk:
    """Positions start .. start + len(tokens) - 1 of one sequence: tokens[i] = t_{p+1},
    hidden[i] = the hidden state at p (the target's, or the head's own when chained)."""
    blocks: list[int]
    start: int
    tokens: list[int]
    hidden: torch.Tensor
    prompt_len: int


class HeadRunner(BlockPool):
    def __init__(self, head: HiddenStateHead, config: EngineConfig, max_model_len: int,
                 num_blocks: int, backend: Any, dtype: torch.dtype) -> None:
        super().__init__(num_blocks, config.block_size)
        self.head = head
        self.device = config.torch_device
        self.max_tokens = config.max_num_batched_tokens  # one forward's tokens at most
        self.kv_spec = KVCacheSpec(self.block_size, tuple(head.kv_cache_specs(dtype)))
        self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, self.device)
        self.backend = backend  # the target's attention backend (a callable's result)
        self.inputs = InputBuffers(self.max_tokens, config.max_num_seqs,
                                   -(-max_model_len // self.block_size), self.block_size,
                                   self.device)
        logger.info("speculative head: %d KV blocks (%.1f MiB)", num_blocks,
                    num_blocks * self.kv_spec.block_bytes / 2**20)

    # ---- forwards ------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, chunks: list[HeadChunk]) -> tuple[torch.Tensor, list[int]]:
        """Every chunk's positions into the head's cache (forwards of at most ``max_tokens``
        tokens: a long catch-up over several); per chunk, the head's state at its last
        position [len(chunks), hidden] and the greedy token after it."""
        out = self.prefill(chunks)
        return out, self.head.compute_logits(out).argmax(dim=-1).tolist()

    @torch.inference_mode()
    def prefill(self, chunks: list[HeadChunk]) -> torch.Tensor:
        """``run`` without the tokens (a prefill engine's, mtp_pd.py: its KV is what ships)."""
        states: list[torch.Tensor | None] = [None] * len(chunks)
        pending = [(i, 0) for i in range(len(chunks))]  # (chunk, tokens done)
        while pending:
            batch, budget, rest = [], self.max_tokens, []
            for i, done in pending:
                take = min(len(chunks[i].tokens) - done, budget)
                if take <= 0:
                    rest.append((i, done))
                    continue
                batch.append((i, done, take))
                budget -= take
            last = self._forward(chunks, batch)
            for (i, done, take), row in zip(batch, last):
                if done + take < len(chunks[i].tokens):
                    rest.append((i, done + take))
                else:
                    states[i] = row
            pending = rest
        return torch.stack([s for s in states if s is not None])

    def _forward(self, chunks: list[HeadChunk], wanted: list[tuple[int, int, int]]
                 ) -> list[torch.Tensor]:
        """One forward of (chunk, tokens done, tokens now) items: the head's state at each
        item's last position, in ``wanted``'s order."""
        order = sorted(range(len(wanted)), key=lambda j: wanted[j][2] != 1)  # decodes first
        tokens: list[int] = []
        positions: list[int] = []
        hidden: list[torch.Tensor] = []
        query_start, seq_lens, tables, prompt_lens = [0], [], [], []
        for j in order:
            i, done, take = wanted[j]
            c = chunks[i]
            tokens += c.tokens[done:done + take]
            positions += range(c.start + done, c.start + done + take)
            hidden.append(c.hidden[done:done + take])
            query_start.append(query_start[-1] + take)
            seq_lens.append(c.start + done + take)
            tables.append(c.blocks)
            prompt_lens.append(c.prompt_len)
        width = max(len(t) for t in tables)
        tables = [t + [0] * (width - len(t)) for t in tables]
        num_decodes = sum(1 for j in order if wanted[j][2] == 1)
        step = StepInput(tokens, positions, query_start, seq_lens, tables, num_decodes,
                         prompt_lens)
        t = self.inputs.prepare(step)
        ctx = ForwardContext(t.meta, self.kv_caches, self.backend(), rope_lens=t.rope_lens)
        n = len(tokens)
        states = self.head(t.token_ids[:n], t.positions[:n], torch.cat(hidden).to(self.device),
                           ctx)
        out: list[torch.Tensor] = [states[0]] * len(wanted)
        for at, j in enumerate(order):
            out[j] = states[query_start[at + 1] - 1]
        return out
