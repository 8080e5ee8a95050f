"""The draft model of ``speculative: {method: draft_model}``: its weights, its own paged KV cache
and block pool, and batched forwards that return each sequence's next greedy token.

Its own cache and pool, not a share of the target's blocks: the target's blocks are prefix-cached
(shared between requests), received from a prefill engine (target layers only), spilled to KV
tiers and preempted; the draft writes positions past the request's tokens (its own drafts) before
the scheduler gives the target any lookahead slot. A pool of its own with a free list has none
of those couplings, and its leak check is a count. It holds as many tokens as the target's cache
plus k per sequence (``num_blocks``), so the draft never runs out before the target does; when it
does anyway, the request simply gets no drafts that step (still lossless).

It runs on rank 0, in the engine process, unsharded (a draft is small), through its own
compiled graph where the engine compiles (``engine.compile``, compiled_model.py: one dynamic
graph for every forward, made at start and kept on disk under the draft's own key): a draft
forward is a step's worth of Python dispatch for a few tokens, which eager mode paid k times a
step. The draft only proposes, so its numerics never reach the output (the target verifies)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from pd_cluster.config import EngineConfig, SpeculativeConfig, read_hf_config
from pd_cluster.engine.cache_engine import KVCacheSpec, allocate_kv_caches
from pd_cluster.engine.compiled_model import CompiledModel, compile_enabled
from pd_cluster.engine.input_buffers import InputBuffers
from pd_cluster.engine.spec.block_pool import BlockPool
from pd_cluster.engine.step_input import StepInput
from pd_cluster.models.context import ForwardContext
from pd_cluster.models.layers.cpu_gemm import prepare_model
from pd_cluster.models.loader import load_model
from pd_cluster.tokenizer_loader import load_tokenizer

logger = logging.getLogger(__name__)

# One draft forward: (sequence's block ids, first position, its tokens from there, prompt length,
# whether its last position's next token is wanted).
Chunk = tuple[list[int], int, list[int], int, bool]


def draft_model_dir(spec: SpeculativeConfig) -> str:
    """The draft's checkpoint directory; ValueError naming ``speculative.model``."""
    from pd_cluster.serving.cluster.model_source import resolve_model
    try:
        return resolve_model(str(spec.model))
    except ValueError as e:
        raise ValueError(f"speculative.{e}") from None


def check_draft(draft_dir: str, target: dict[str, Any], draft: dict[str, Any],
                target_tokenizer: Any, max_model_len: int) -> None:
    """The draft must score the same token ids as the target (same vocabulary size and
    tokenizer) and cover its positions; ValueError naming ``speculative.model``."""
    if draft.get("vocab_size") != target.get("vocab_size"):
        raise ValueError(f"speculative.model: the draft's vocab_size {draft.get('vocab_size')} "
                         f"differs from the served model's {target.get('vocab_size')}")
    tok = load_tokenizer(draft_dir)
    if tok.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError("speculative.model: the draft's tokenizer differs from the served "
                         "model's (a draft must map text to the same token ids)")
    positions = int(draft.get("max_position_embeddings") or max_model_len)
    if positions < max_model_len:
        raise ValueError(f"speculative.model: the draft covers {positions} positions, fewer than "
                         f"max_model_len {max_model_len}")


class DraftRunner(BlockPool):
    def __init__(self, config: EngineConfig, target_hf: dict[str, Any], target_tokenizer: Any,
                 max_model_len: int, num_blocks: int, backend: Any) -> None:
        spec = config.speculative
        assert spec is not None
        self.model_dir = draft_model_dir(spec)
        if not Path(self.model_dir, "config.json").is_file():
            raise ValueError(f"speculative.model: {self.model_dir} has no config.json")
        hf = read_hf_config(self.model_dir)
        check_draft(self.model_dir, target_hf, hf, target_tokenizer, max_model_len)
        super().__init__(num_blocks, config.block_size)
        self.device, dtype = config.torch_device, config.torch_dtype
        self.max_tokens = config.max_num_batched_tokens  # one draft forward's tokens at most
        self.model = load_model(self.model_dir, hf, dtype, self.device)
        prepare_model(self.model, dtype, self.device, config.cpu_gemm)
        self.forward_model: Any = (CompiledModel(self.model, self.device)
                                   if compile_enabled(config.compile, self.device)
                                   else self.model)
        self.kv_spec = KVCacheSpec(self.block_size, tuple(self.model.kv_cache_specs(dtype)))
        self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, self.device)
        self.backend = backend  # the target's attention backend (a callable's result)
        self.inputs = InputBuffers(self.max_tokens, config.max_num_seqs,
                                   -(-max_model_len // self.block_size), self.block_size,
                                   self.device)
        logger.info("draft model %s: %d layers, %d KV blocks (%.1f MiB)", self.model_dir,
                    self.kv_spec.num_layers, num_blocks,
                    num_blocks * self.kv_spec.block_bytes / 2**20)

    # ---- forwards ------------------------------------------------------------------------
    @torch.inference_mode()
    def next_tokens(self, chunks: list[Chunk]) -> list[int | None]:
        """Runs each chunk's tokens into the draft cache (in forwards of at most
        ``max_tokens`` tokens, a long prompt over several) and returns, per chunk, the greedy
        next token after its last position if wanted, else None."""
        out: list[int | None] = [None] * len(chunks)
        pending = [(i, c[1], 0) for i, c in enumerate(chunks)]  # (chunk, position, done)
        while pending:
            batch, budget, rest = [], self.max_tokens, []
            for i, pos, done in pending:
                take = min(len(chunks[i][2]) - done, budget)
                if take <= 0:
                    rest.append((i, pos, done))
                    continue
                batch.append((i, pos, done, take))
                budget -= take
            tokens = self._forward(chunks, batch)
            for (i, pos, done, take), token in zip(batch, tokens):
                if done + take < len(chunks[i][2]):
                    rest.append((i, pos + take, done + take))
                elif chunks[i][4]:
                    out[i] = token
            pending = rest
        return out

    def _forward(self, chunks: list[Chunk], wanted: list[tuple[int, int, int, int]]
                 ) -> list[int]:
        """One forward of (chunk, position, tokens done, tokens now) items: the greedy token
        after each item's last position, in ``wanted``'s order."""
        batch = sorted(wanted, key=lambda b: b[3] != 1)  # decodes first (the backends' order)
        tokens: list[int] = []
        positions: list[int] = []
        query_start, seq_lens, tables, prompt_lens = [0], [], [], []
        for i, pos, done, take in batch:
            blocks, _, ids, prompt_len, _ = chunks[i]
            tokens += ids[done:done + take]
            positions += range(pos, pos + take)
            query_start.append(query_start[-1] + take)
            seq_lens.append(pos + take)
            tables.append(blocks)
            prompt_lens.append(prompt_len)
        width = max(len(t) for t in tables)
        tables = [t + [0] * (width - len(t)) for t in tables]
        num_decodes = sum(1 for b in batch if b[3] == 1)
        step = StepInput(tokens, positions, query_start, seq_lens, tables, num_decodes,
                         prompt_lens)
        t = self.inputs.prepare(step)
        ctx = ForwardContext(t.meta, self.kv_caches, self.backend(), rope_lens=t.rope_lens)
        hidden = self.forward_model(t.token_ids, t.positions, ctx)
        last = torch.tensor([q - 1 for q in query_start[1:]], device=hidden.device)
        picked = self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
        by_chunk = {b[0]: tok for b, tok in zip(batch, picked)}
        return [by_chunk[b[0]] for b in wanted]
