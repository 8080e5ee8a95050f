"""The step's input tensors, written once per step into persistent buffers.

A ``StepInput`` arrives as plain lists (the executor's broadcast message). Each step writes them
into host buffers allocated once (grown, never shrunk, if a step is larger than any before) and
derives the slot mapping and RoPE lengths there with vectorised numpy; on a GPU the result is
copied into device buffers that are reused the same way. Layers then read views of these
tensors through ``AttentionMetadata``; nothing is rebuilt per layer.

The views stay valid until the next ``prepare``: whoever keeps one across steps must copy it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pd_cluster.attention import AttentionMetadata
from pd_cluster.engine.step_input import StepInput


@dataclass
class StepTensors:
    """One step's model inputs (views of the persistent buffers)."""
    token_ids: torch.Tensor  # int64 [tokens]
    positions: torch.Tensor  # int64 [tokens]
    rope_lens: torch.Tensor  # int64 [tokens]: max(prompt length, position + 1)
    meta: AttentionMetadata


# name -> (dtype, per-token | per-request | per-request + 1 | table)
_FIELDS = {
    "token_ids": (torch.int64, "token"), "positions": (torch.int64, "token"),
    "slot_mapping": (torch.int64, "token"), "rope_lens": (torch.int64, "token"),
    "query_start_loc": (torch.int32, "req+1"), "seq_lens": (torch.int32, "req"),
    "block_tables": (torch.int32, "table"),
}


class InputBuffers:
    """Persistent buffers for ``max_tokens`` tokens of ``max_reqs`` requests, each with up to
    ``max_blocks`` blocks (sizes grow when a step needs more)."""

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size, self.device = block_size, device
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        self._np: dict[str, np.ndarray] = {}
        self._allocate(max(1, max_tokens), max(1, max_reqs), max(1, max_blocks))

    def _allocate(self, tokens: int, reqs: int, blocks: int) -> None:
        self.max_tokens, self.max_reqs, self.max_blocks = tokens, reqs, blocks
        pin = self.device.type == "cuda"
        shapes = {"token": (tokens,), "req": (reqs,), "req+1": (reqs + 1,),
                  "table": (reqs, blocks)}
        for name, (dtype, kind) in _FIELDS.items():
            self.host[name] = torch.zeros(shapes[kind], dtype=dtype, pin_memory=pin)
            self._np[name] = self.host[name].numpy()
            self.dev[name] = (self.host[name] if self.device.type == "cpu"
                              else torch.zeros(shapes[kind], dtype=dtype, device=self.device))
        self._arange = np.arange(reqs)

    def prepare(self, step: StepInput) -> StepTensors:
        n_tok, n_req = len(step.tokens), len(step.seq_lens)
        width = len(step.block_tables[0])
        if n_tok > self.max_tokens or n_req > self.max_reqs or width > self.max_blocks:
            self._allocate(max(n_tok, self.max_tokens), max(n_req, self.max_reqs),
                           max(width, self.max_blocks))
        a = self._np
        a["token_ids"][:n_tok] = step.tokens
        pos = a["positions"][:n_tok]
        pos[:] = step.positions
        qsl = a["query_start_loc"][:n_req + 1]
        qsl[:] = step.query_start
        a["seq_lens"][:n_req] = step.seq_lens
        tables = a["block_tables"][:n_req, :width]
        tables[:] = step.block_tables
        req_index = np.repeat(self._arange[:n_req], np.diff(qsl))
        bs = self.block_size
        np.add(tables[req_index, pos // bs].astype(np.int64) * bs, pos % bs,
               out=a["slot_mapping"][:n_tok])
        # HF's RoPE sees max(prompt length, position + 1) tokens when computing a position.
        np.maximum(np.asarray(step.prompt_lens, dtype=np.int64)[req_index], pos + 1,
                   out=a["rope_lens"][:n_tok])
        sizes = {"token": n_tok, "req": n_req, "req+1": n_req + 1}
        views = {}
        for name, (_, kind) in _FIELDS.items():
            host = self.host[name]
            host = host[:n_req, :width] if kind == "table" else host[:sizes[kind]]
            dev = self.dev[name]
            dev = dev[:n_req, :width] if kind == "table" else dev[:sizes[kind]]
            if dev.data_ptr() != host.data_ptr():
                dev.copy_(host, non_blocking=True)
            views[name] = dev
        lens = step.seq_lens
        meta = AttentionMetadata(
            slot_mapping=views["slot_mapping"], query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"], block_tables=views["block_tables"],
            num_decodes=step.num_decodes,
            max_query_len=max(b - a for a, b in zip(step.query_start, step.query_start[1:])),
            max_seq_len=max(lens), block_size=bs, query_start_loc_cpu=step.query_start,
            seq_lens_cpu=lens)
        return StepTensors(views["token_ids"], views["positions"], views["rope_lens"], meta)
