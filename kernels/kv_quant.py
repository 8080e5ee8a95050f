"""FP8 KV cache blocks: the stored layout, the quantising write and the dequantising read.

An FP8 layer cache is ``[parts, num_blocks, block_size + 1, heads, width]`` in the FP8 dtype:
rows ``0..block_size-1`` hold the tokens, the extra row holds each head's scale (fp32, in its
first 4 bytes). Keeping the scales inside their block means everything that moves blocks
(the P/D connector and its integrity tags, the host/disk tiers, block copies, a head slice for
another TP size) moves them with it, unchanged. The value a token stands for is
``stored * scale[part, block, head]``.

Scales: a layer with checkpoint scales (``k_scale``/``v_scale``, vLLM's per-tensor static
scales) writes them into every block it fills; otherwise a block's scale per head is computed
when it is written (amax / fp8 max, rounded up to a power of two) and only grows: a later token
larger than the block's scale re-quantises the block's earlier tokens to the new scale
(``stored * old / new``). Powers of two make that exact: the ratio moves only the exponent, so
an earlier token stores what it would have stored had the block been written at once (no
drift from re-rounding; FP8 keeps the same relative precision at any scale below its max, so
rounding the scale up costs nothing). Measured on bench-50m (8 prompts x 32 tokens): mean
KL(auto || fp8) 0.100 -> 0.079 nats, where a per-token exact scale (the floor of any scale rule) gives 0.080. A block
is fresh when its first slot is written (slots are filled in order), so a recycled block's
stale scale is never kept.
"""
from __future__ import annotations

import torch

from pd_cluster.config import KV_CACHE_DTYPES

FP8_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn,
                                      "fp8_e5m2": torch.float8_e5m2}
_TINY = 1e-12  # floor of a dynamic scale (an all-zero block still divides by something)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES.values()


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``engine.kv_cache_dtype``'s tensor dtype (``auto``: the model's)."""
    if name == "auto":
        return model_dtype
    if name not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype: {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return FP8_DTYPES[name]


def split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 cache's token rows [parts, blocks, block_size, heads, width] (a view) and its
    scales [parts, blocks, heads] fp32 (a view: writing it writes the cache)."""
    if kv_cache.shape[-1] < 4:
        raise ValueError(f"an FP8 KV cache needs head dim >= 4, got {kv_cache.shape[-1]}")
    bs = kv_cache.shape[2] - 1
    scales = kv_cache[:, :, bs, :, :4].view(torch.uint8).view(torch.float32).squeeze(-1)
    return kv_cache[:, :, :bs], scales


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as raw bytes (a view), for copies torch has no FP8 kernel for (e.g.
    index_copy_ on CPU); any other tensor as it is."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def block_size_of(kv_cache: torch.Tensor) -> int:
    """Tokens per block of a layer cache, FP8 (one scale row more) or not."""
    return kv_cache.shape[2] - (1 if is_fp8(kv_cache.dtype) else 0)


def write_fp8(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor,
              static_scales: tuple[float, float] | None = None) -> None:
    """key/value [T, heads, width] into an FP8 cache at flat slots (-1: padding, skipped)."""
    slots = slot_mapping[:key.shape[0]].long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel() == 0:
        return
    data, scales = split(kv_cache)
    bs, top = data.shape[2], fp8_max(kv_cache.dtype)
    blk, off = slots // bs, slots % bs
    for part, x in enumerate((key, value)):
        x = x.float()
        if static_scales is not None:
            s_tok = torch.full((x.shape[0], x.shape[1]), float(static_scales[part]),
                               device=x.device)
            scales[part].index_copy_(0, blk, s_tok)  # the static scale, in every block filled
        else:
            s_tok = _grow_scales(x, data[part], scales[part], blk, off, top)
        q = (x / s_tok[:, :, None]).clamp(-top, top).to(kv_cache.dtype)
        data[part][blk, off] = q


def pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest power of two >= amax / top (floored at _TINY): a dynamic scale."""
    return torch.exp2(torch.ceil(torch.log2((amax / top).clamp_min(_TINY))))


def _grow_scales(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, blk: torch.Tensor,
                 off: torch.Tensor, top: float) -> torch.Tensor:
    """Each touched block's new per-head scale (re-quantising its earlier tokens where it
    grew); returns the scale of every token's block [T, heads]."""
    ub, inv = torch.unique(blk, return_inverse=True)
    heads = x.shape[1]
    amax = torch.zeros(len(ub), heads, device=x.device).scatter_reduce_(
        0, inv[:, None].expand(-1, heads), x.abs().amax(-1), "amax")
    fresh = torch.zeros(len(ub), dtype=torch.bool, device=x.device)
    fresh[inv[off == 0]] = True
    old = torch.where(fresh[:, None], torch.zeros_like(amax), scales[ub])
    need = pow2_scale(amax, top)
    new = torch.maximum(old, need)  # both powers of two: old / new is exact
    grew = ~fresh[:, None] & (new > old)
    if bool(grew.any()):  # earlier tokens of these blocks move to the larger scale
        rows = grew.any(-1).nonzero().squeeze(-1)
        ratio = torch.where(grew, old / new, torch.ones_like(new))[rows]
        b = ub[rows]
        data[b] = (data[b].float() * ratio[:, None, :, None]).clamp(-top, top).to(data.dtype)
    scales[ub] = new
    return new[inv]


def dequant_blocks(kv_cache: torch.Tensor, part: int, blocks: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``blocks`` of one part as [n, block_size, heads, width] in ``dtype``."""
    data, scales = split(kv_cache)
    vals = data[part].index_select(0, blocks).float()
    return (vals * scales[part].index_select(0, blocks)[:, None, :, None]).to(dtype)


def dequantize(kv_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole cache as [parts, blocks, block_size, heads, width] in ``dtype`` (tests)."""
    data, scales = split(kv_cache)
    return (data.float() * scales[:, :, None, :, None]).to(dtype)


def cache_parts(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                 tuple[torch.Tensor, torch.Tensor] | None]:
    """K and V [blocks, block_size, Hkv, D] of a layer cache, and an FP8 cache's K/V scales
    [blocks, Hkv] (None for other caches): what the Triton kernels take."""
    if not is_fp8(kv_cache.dtype):
        return kv_cache[0], kv_cache[1], None
    data, scales = split(kv_cache)
    return data[0], data[1], (scales[0], scales[1])
