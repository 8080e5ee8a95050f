"""Where each KV block lives in a cache registered with NIXL: the one place that turns block
ids into addresses for a WRITE's descriptors, with the bounds checked here.

A layer's cache is one contiguous tensor [parts, num_blocks, block_size, heads, head_dim]
(parts: K and V, or one latent), so block b of part p starts at
addr + (p * num_blocks + b) * block_bytes. Both ends describe their caches this way at the
handshake; a producer writes whole blocks of every part of a layer, never anything else.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Iterator

import msgspec
import numpy as np
import torch


class LayerLayout(msgspec.Struct, frozen=True, array_like=True):
    addr: int
    parts: int
    num_blocks: int
    block_bytes: int
    device: int  # CUDA device index (VRAM), 0 for host memory


class CacheLayout(msgspec.Struct, frozen=True):
    mem: str  # NIXL's memory type: "DRAM" (host) or "VRAM" (CUDA)
    layers: list[LayerLayout]

    @classmethod
    def of(cls, caches: Sequence[torch.Tensor]) -> "CacheLayout":
        """The layout of an engine's per-layer caches (all on one device kind)."""
        if not caches:
            raise ValueError("no KV caches to register")
        kinds = {c.device.type for c in caches}
        if kinds - {"cpu", "cuda"} or len(kinds) > 1:
            raise ValueError(f"nixl pipe: KV caches on {sorted(kinds)}; expected all on cpu "
                             f"or all on cuda")
        layers = []
        for i, c in enumerate(caches):
            if c.dim() != 5 or not c.is_contiguous():
                raise ValueError(f"nixl pipe: layer {i}'s cache is not a contiguous "
                                 f"[parts, blocks, block_size, heads, head_dim] tensor")
            layers.append(LayerLayout(c.data_ptr(), c.shape[0], c.shape[1], c[0, 0].nbytes,
                                      c.device.index or 0))
        return cls("VRAM" if kinds == {"cuda"} else "DRAM", layers)

    def regions(self) -> list[tuple[int, int, int, str]]:
        """What to register: (addr, bytes, device, "") per layer, once per tensor (with KV
        cache groups several layers share one: cache_engine.py)."""
        return list(dict.fromkeys((lay.addr, lay.parts * lay.num_blocks * lay.block_bytes,
                                   lay.device, "") for lay in self.layers))

    def mismatch(self, other: "CacheLayout") -> str | None:
        """Why blocks of ``self`` cannot be written into ``other``'s, or None."""
        if len(self.layers) != len(other.layers):
            return f"{len(other.layers)} layers against {len(self.layers)}"
        for i, (a, b) in enumerate(zip(self.layers, other.layers)):
            if (a.parts, a.block_bytes) != (b.parts, b.block_bytes):
                return (f"layer {i} has {b.parts} parts of {b.block_bytes} bytes per block "
                        f"against {a.parts} of {a.block_bytes}")
        return None

    def _rows(self, layer: int, block_ids: Sequence[int]) -> tuple[LayerLayout, np.ndarray]:
        """The layer and the block-sized rows (``p * num_blocks + b``) of every part of
        ``block_ids``, part by part; ValueError for a layer or block out of range."""
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"layer {layer} out of range")
        lay = self.layers[layer]
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size == 0:
            raise ValueError("no block ids")
        if ids.min() < 0 or ids.max() >= lay.num_blocks:
            raise ValueError(f"block ids out of range 0..{lay.num_blocks - 1}")
        return lay, (np.arange(lay.parts, dtype=np.int64)[:, None] * lay.num_blocks
                     + ids).ravel()

    def descs(self, layer: int, block_ids: Sequence[int]) -> np.ndarray:
        """Nx3 (address, bytes, device) of every part of ``block_ids`` of ``layer``, part
        by part, blocks in the order given. ValueError for a layer or block out of range."""
        lay, rows = self._rows(layer, block_ids)
        return _table(lay, rows, np.ones(rows.size, dtype=np.int64))

    def write_descs(self, remote: "CacheLayout", layer: int, src_ids: Sequence[int],
                    dst_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The descriptors of a WRITE of every part of our ``src_ids`` of ``layer`` into
        ``remote``'s ``dst_ids``: one pair per run of rows consecutive on both sides (a run
        may cross from K into V where both caches' last and first blocks meet), so the
        same bytes as ``descs`` block by block in fewer descriptors (UCX's cost is per
        descriptor). ValueError for blocks out of range or sides that differ."""
        if len(src_ids) != len(dst_ids):
            raise ValueError("source and destination blocks differ in number")
        here, src = self._rows(layer, src_ids)
        there, dst = remote._rows(layer, dst_ids)
        if (here.parts, here.block_bytes) != (there.parts, there.block_bytes):
            raise ValueError(f"layer {layer}'s blocks differ between the caches")
        breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
        starts = np.flatnonzero(np.concatenate(([True], breaks)))
        lengths = np.diff(np.append(starts, src.size))
        return _table(here, src[starts], lengths), _table(there, dst[starts], lengths)

    def staged_descs(self, layer: int, src_ids: Sequence[int], addr: int
                     ) -> tuple[np.ndarray, np.ndarray]:
        """The descriptors of a staged WRITE (nixl_staging.py): every part of our ``src_ids``
        of ``layer`` laid out contiguously from ``addr`` (host memory) in block_chunks'
        order, one pair per run of our rows: as many descriptors as our own runs, whatever
        the consumer's grant looks like."""
        here, src = self._rows(layer, src_ids)
        starts = np.flatnonzero(np.concatenate(([True], np.diff(src) != 1)))
        lengths = np.diff(np.append(starts, src.size))
        far = np.empty((starts.size, 3), dtype=np.uint64)
        far[:, 0] = addr + starts.astype(np.uint64) * here.block_bytes
        far[:, 1] = lengths.astype(np.uint64) * here.block_bytes
        far[:, 2] = 0
        return _table(here, src[starts], lengths), far

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, raw: Any) -> "CacheLayout":
        """ValueError on anything malformed (it comes from a peer)."""
        try:
            layout = msgspec.msgpack.decode(bytes(raw), type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
            raise ValueError(f"malformed cache layout: {e}") from None
        if layout.mem not in ("DRAM", "VRAM"):
            raise ValueError(f"unknown memory type {layout.mem!r:.20}")
        return layout


class BlockChunks(Sequence):
    """block_chunks' buffers (made on first use), ``blocks``: (the layer as [parts, blocks,
    bytes] uint8, the block ids), so a hash kernel may take them in one call without the
    buffers ever being made (written_check: ~2 us a block of Python saved per check), and
    ``nbytes``."""

    def __init__(self, rows: torch.Tensor, block_ids: list[int]) -> None:
        self.blocks = (rows, block_ids)
        self.nbytes = rows.shape[0] * len(block_ids) * rows.shape[2]
        self._views: list[memoryview] | None = None

    def _made(self) -> list[memoryview]:
        if self._views is None:
            rows, ids = self.blocks
            arr = rows.numpy()
            size = arr.shape[2]
            runs, i = [], 0
            while i < len(ids):
                j = i + 1
                while j < len(ids) and ids[j] == ids[j - 1] + 1:
                    j += 1
                runs.append((ids[i] * size, (ids[j - 1] + 1) * size))
                i = j
            views: list[memoryview] = []
            for part in range(arr.shape[0]):
                # Slices of one memoryview per part: ~0.1 us each against ~3 us for a numpy
                # slice made a memoryview (3 ms a layer of 2k scattered blocks here).
                whole = memoryview(arr[part].reshape(-1))
                views += [whole[lo:hi] for lo, hi in runs]
            self._views = views
        return self._views

    def __len__(self) -> int:
        return len(self._made())

    def __getitem__(self, i: Any) -> Any:
        return self._made()[i]

    def __iter__(self) -> Iterator[memoryview]:
        return iter(self._made())


def _table(lay: LayerLayout, rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Nx3 (address, bytes, device): ``lengths[i]`` rows from row ``rows[i]`` of ``lay``."""
    out = np.empty((rows.size, 3), dtype=np.uint64)
    out[:, 0] = lay.addr + rows.astype(np.uint64) * lay.block_bytes
    out[:, 1] = lengths.astype(np.uint64) * lay.block_bytes
    out[:, 2] = lay.device
    return out


def block_chunks(kv_layer: torch.Tensor, block_ids: Sequence[int]) -> BlockChunks:
    """The bytes of every part of ``block_ids`` in the order ``descs`` lists them, as few
    buffers as ascending runs allow (what the MAC of a write is computed over). Host caches
    are sliced as numpy arrays (torch's per-slice overhead cost ~15 us a block: 90 ms per
    4k-token transfer of scattered 16 KiB blocks); CUDA caches are copied to host memory
    first (marked cuda: untested here)."""
    if kv_layer.device.type != "cpu" or not kv_layer.is_contiguous():
        kv_layer = kv_layer.cpu().contiguous()
    rows = kv_layer.reshape(kv_layer.shape[0], kv_layer.shape[1], -1).view(torch.uint8)
    return BlockChunks(rows, [int(b) for b in block_ids])
