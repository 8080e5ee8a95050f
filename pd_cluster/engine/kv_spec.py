"""What one attention layer caches per token (the design's ``get_kv_cache_spec``).

Every layer's cache is one tensor ``[parts, num_blocks, block_size, heads, width]``: standard
attention caches K and V (parts 2, this rank's KV heads x head_dim), latent attention one
vector per token (parts 1, one "head" of kv_lora_rank + qk_rope_head_dim); an FP8 cache is
``[parts, num_blocks, 1, heads, bytes]``, each head's tokens then its scale (kernels/kv_quant.py).
The cache engine sizes blocks from the sum of the layers' page bytes; the block manager and the
scheduler never see shapes, and the connector moves ``[parts, n, ...]`` slices (heads on dim 3)
whatever they hold. ``describe()`` is the msgpack-able form P and D compare at handshake time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch

from kernels.kv_quant import SCALE_BYTES, is_fp8, row_bytes


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Paged:
    """A layer cache of ``parts`` x ``heads`` x ``width`` values per token, in ``dtype``."""

    parts: int
    heads: int
    width: int
    dtype: torch.dtype

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        if is_fp8(self.dtype):  # each head's tokens then its scale, as bytes (kv_quant.py)
            return (self.parts, num_blocks, 1, self.heads, row_bytes(block_size, self.width))
        return (self.parts, num_blocks, block_size, self.heads, self.width)

    def page_bytes(self, block_size: int) -> int:
        """Bytes one block of this layer occupies (an FP8 block's scales included)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        parts, _, rows, heads, width = self.cache_shape(1, block_size)
        return parts * rows * heads * width * elem


@dataclass(frozen=True)
class FullAttentionSpec(_Paged):
    """K and V of ``num_kv_heads`` (this rank's) x ``head_dim`` per token."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    kind = "full"
    parts = 2

    @property
    def heads(self) -> int:  # type: ignore[override]
        return self.num_kv_heads

    @property
    def width(self) -> int:  # type: ignore[override]
        return self.head_dim

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": dtype_name(self.dtype)}


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Full attention's cache (the whole history is kept) for a layer that attends to the
    last ``window`` tokens only: same bytes, described apart so P and D agree on it."""

    window: int = 0

    kind = "sliding"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "window": self.window}


@dataclass(frozen=True)
class LatentAttentionSpec(_Paged):
    """Multi-head latent attention: one ``latent_dim`` vector per token, the same on every
    tensor-parallel rank (the normed latent then the roped key: kv_lora_rank +
    qk_rope_head_dim)."""

    latent_dim: int
    dtype: torch.dtype

    kind = "latent"
    parts = 1
    heads = 1
    num_kv_heads = 1  # the connector's routing sees one head, held by every rank

    @property
    def width(self) -> int:  # type: ignore[override]
        return self.latent_dim

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "latent_dim": self.latent_dim,
                "dtype": dtype_name(self.dtype)}


LayerKVSpec = Union[FullAttentionSpec, SlidingWindowSpec, LatentAttentionSpec]


def attention_spec(num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   window: int | None = None) -> FullAttentionSpec:
    """A standard attention layer's spec: sliding when it has a window."""
    if window is None:
        return FullAttentionSpec(num_kv_heads, head_dim, dtype)
    return SlidingWindowSpec(num_kv_heads, head_dim, dtype, window)


def check_kv_dtype(spec: "Any", kv_cache_dtype: str) -> None:
    """ValueError naming ``kv_cache_dtype`` where an FP8 cache cannot hold these layers
    (``spec``: a KVCacheSpec): latent attention reads its cache in ways that have no FP8 path
    yet, and a block's fp32 scales need its tokens' bytes to be a multiple of 4."""
    if kv_cache_dtype == "auto":
        return
    for i, layer in enumerate(spec.layers):
        if layer.kind == "latent":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype}: layer {i} uses latent "
                             f"attention, which has no FP8 KV cache here; use auto")
        if (spec.block_size * layer.width) % SCALE_BYTES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype}: layer {i}'s head dim "
                             f"{layer.width} x block_size {spec.block_size} does not align "
                             f"FP8 blocks' scales; use auto or a larger block_size")
