"""The step's input tensors, written once per step into persistent buffers.

A ``StepInput`` arrives as plain lists (the executor's broadcast message). Each step writes them
into host buffers allocated once (grown, never shrunk, if a step is larger than any before) and
derives the slot mapping and RoPE lengths there with vectorised numpy. Layers then read views of
these tensors through ``AttentionMetadata``; nothing is rebuilt per layer.

On a GPU the host buffers are pinned and copied into device buffers with ``non_blocking``
copies, which run when the stream reaches them, not when they are issued. A step that samples
nothing (a chunk of a long prompt) never syncs, so the CPU can prepare the next step while this
step's copies still wait in the stream: rewriting the same host memory then would feed the
previous step the next step's token ids and slots (silent KV corruption). So the host buffers
come in two slots used in turn, and an event recorded after a slot's copies is waited on before
that slot is written again: step n+2 waits for step n's copies, never for step n+1's, so the
CPU still runs one step ahead. The copier (copies and events) is a parameter: CUDA's by
default, a fake one in tests (tests/test_input_buffers.py) that runs copies late on purpose.

On the CPU there is no copy: the "device" buffers are the one host slot (no event, no cost).
The views stay valid until the next ``prepare``: whoever keeps one across steps must copy it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

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
    # Per KV cache group, its metadata (its own block tables and slots); [meta] with one.
    group_metas: list[AttentionMetadata]


class CopyEvent(Protocol):
    def record(self) -> None: ...  # marks the copies issued so far on the stream

    def synchronize(self) -> None: ...  # returns once they ran


class AsyncCopier(Protocol):
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...  # may run later

    def event(self) -> CopyEvent: ...


class CudaCopier:
    """Host-to-device copies and events on the current CUDA stream (the forward's)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def event(self) -> CopyEvent:
        return torch.cuda.Event()


# name -> (dtype, per-token | per-request | per-request + 1 | table)
_FIELDS = {
    "token_ids": (torch.int64, "token"), "positions": (torch.int64, "token"),
    "slot_mapping": (torch.int64, "token"), "rope_lens": (torch.int64, "token"),
    "query_start_loc": (torch.int32, "req+1"), "seq_lens": (torch.int32, "req"),
    "block_tables": (torch.int32, "table"),
}
Sizes = tuple[int, int, int]  # (tokens, requests, blocks per request)


def _group_fields(num_groups: int) -> dict[str, tuple[torch.dtype, str]]:
    """The fields, and each further KV cache group's slots and tables (``..._k``)."""
    fields = dict(_FIELDS)
    for k in range(1, num_groups):
        fields[f"slot_mapping_{k}"] = (torch.int64, "token")
        fields[f"block_tables_{k}"] = (torch.int32, "table")
    return fields


def _zeros(sizes: Sizes, device: torch.device, pin: bool = False,
           fields: dict[str, tuple[torch.dtype, str]] = _FIELDS) -> dict[str, torch.Tensor]:
    tokens, reqs, blocks = sizes
    shapes = {"token": (tokens,), "req": (reqs,), "req+1": (reqs + 1,), "table": (reqs, blocks)}
    return {name: torch.zeros(shapes[kind], dtype=dtype, device=device, pin_memory=pin)
            for name, (dtype, kind) in fields.items()}


class _HostSlot:
    """One set of host buffers, and the event after the copies that last read them."""

    def __init__(self, sizes: Sizes, pin: bool, event: CopyEvent | None,
                 fields: dict[str, tuple[torch.dtype, str]]) -> None:
        self.pin, self.event, self.fields = pin, event, fields
        self.pending = False  # copies reading these buffers were issued after the last wait
        self.allocate(sizes)

    def allocate(self, sizes: Sizes) -> None:
        """New buffers (call after ``wait``; pinned memory still read by a copy is reused by
        the caching host allocator only after that copy)."""
        self.sizes = sizes
        self.tensors = _zeros(sizes, torch.device("cpu"), self.pin, self.fields)
        self.arrays = {name: t.numpy() for name, t in self.tensors.items()}

    def wait(self) -> None:
        if self.pending and self.event is not None:
            self.event.synchronize()
        self.pending = False


class InputBuffers:
    """Persistent buffers for ``max_tokens`` tokens of ``max_reqs`` requests, each with up to
    ``max_blocks`` blocks (sizes grow when a step needs more). ``copier``: how host buffers
    reach ``device`` (default: CUDA's on a CUDA device; none on the CPU, where the host
    buffers are the inputs). ``num_groups``: KV cache groups, each with its tables and
    slots."""

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks: int, block_size: int,
                 device: torch.device, copier: AsyncCopier | None = None,
                 num_groups: int = 1) -> None:
        self.block_size, self.device = block_size, device
        self.num_groups = num_groups
        self.fields = _group_fields(num_groups)
        if copier is None and device.type == "cuda":
            copier = CudaCopier()
        self.copier = copier
        self._pin = device.type == "cuda"
        self.sizes: Sizes = (max(1, max_tokens), max(1, max_reqs), max(1, max_blocks))
        # Two slots only when copies are asynchronous: one being read by the stream while
        # the CPU writes the other.
        self._slots = [_HostSlot(self.sizes, self._pin, copier.event() if copier else None,
                                 self.fields) for _ in range(2 if copier else 1)]
        self._next = 0
        self.dev = _zeros(self.sizes, device, fields=self.fields) if copier \
            else self._slots[0].tensors
        self._arange = np.arange(self.sizes[1])

    @property
    def max_tokens(self) -> int:
        return self.sizes[0]

    @property
    def max_reqs(self) -> int:
        return self.sizes[1]

    @property
    def max_blocks(self) -> int:
        return self.sizes[2]

    def _grow(self, need: Sizes) -> None:
        self.sizes = tuple(max(a, b) for a, b in zip(self.sizes, need))  # type: ignore[assignment]
        self._arange = np.arange(self.sizes[1])
        if self.copier is not None:
            # The old device buffers may still be read by queued work: the caching allocator
            # reuses their memory only after it (stream order).
            self.dev = _zeros(self.sizes, self.device, fields=self.fields)

    def _slot(self) -> _HostSlot:
        """The host slot this step writes, once the copies that read it last have run."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        slot.wait()
        if slot.sizes != self.sizes:
            slot.allocate(self.sizes)
            if self.copier is None:
                self.dev = slot.tensors
        return slot

    def prepare(self, step: StepInput) -> StepTensors:
        n_tok, n_req = len(step.tokens), len(step.seq_lens)
        if len(step.group_tables) != self.num_groups - 1:
            raise ValueError(f"group_tables: {len(step.group_tables) + 1} KV cache groups, "
                             f"the buffers have {self.num_groups}")
        width = max(len(t[0]) for t in [step.block_tables, *step.group_tables])
        if n_tok > self.sizes[0] or n_req > self.sizes[1] or width > self.sizes[2]:
            self._grow((n_tok, n_req, width))
        slot = self._slot()
        a = slot.arrays
        a["token_ids"][:n_tok] = step.tokens
        pos = a["positions"][:n_tok]
        pos[:] = step.positions
        qsl = a["query_start_loc"][:n_req + 1]
        qsl[:] = step.query_start
        a["seq_lens"][:n_req] = step.seq_lens
        req_index = np.repeat(self._arange[:n_req], np.diff(qsl))
        bs = self.block_size
        for k, step_tables in enumerate([step.block_tables, *step.group_tables]):
            suffix = f"_{k}" if k else ""
            tables = a["block_tables" + suffix][:n_req, :width]
            tables[:] = 0
            tables[:, :len(step_tables[0])] = step_tables
            np.add(tables[req_index, pos // bs].astype(np.int64) * bs, pos % bs,
                   out=a["slot_mapping" + suffix][:n_tok])
        # HF's RoPE sees max(prompt length, position + 1) tokens when computing a position.
        np.maximum(np.asarray(step.prompt_lens, dtype=np.int64)[req_index], pos + 1,
                   out=a["rope_lens"][:n_tok])
        sizes = {"token": n_tok, "req": n_req, "req+1": n_req + 1}
        views = {}
        for name, (_, kind) in self.fields.items():
            dev = self.dev[name]
            dev = dev[:n_req, :width] if kind == "table" else dev[:sizes[kind]]
            if self.copier is not None:
                host = slot.tensors[name]
                host = host[:n_req, :width] if kind == "table" else host[:sizes[kind]]
                self.copier.copy(dev, host)
            views[name] = dev
        if self.copier is not None:
            slot.event.record()  # type: ignore[union-attr]
            slot.pending = True
        lens = step.seq_lens
        meta = AttentionMetadata(
            slot_mapping=views["slot_mapping"], query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"], block_tables=views["block_tables"],
            num_decodes=step.num_decodes,
            max_query_len=max(b - a for a, b in zip(step.query_start, step.query_start[1:])),
            max_seq_len=max(lens), block_size=bs, query_start_loc_cpu=step.query_start,
            seq_lens_cpu=lens)
        metas = [meta] + [replace(meta, slot_mapping=views[f"slot_mapping_{k}"],
                                  block_tables=views[f"block_tables_{k}"])
                          for k in range(1, self.num_groups)]
        return StepTensors(views["token_ids"], views["positions"], views["rope_lens"], meta,
                           metas)
