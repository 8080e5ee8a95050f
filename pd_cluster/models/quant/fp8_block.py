"""DeepSeek-style FP8 block-quantised weights (``quant_method: "fp8"``), dequantised on load.

Each quantised ``X.weight`` is float8_e4m3fn [..., R, C] and comes with ``X.weight_scale_inv``
[..., ceil(R/bn), ceil(C/bk)] (``weight_block_size: [bn, bk]``): block (i, j) of the weight
times its scale gives the real values; the last block of a dimension that is not a multiple of
the block is partial (DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576 rows: 4.5 blocks of 128).
Without ``weight_block_size`` the scale is one value for the whole tensor. Tensors stored in
higher precision (embeddings, norms, routers, lm_head) have no scale and pass through.
Dequantised = weight.float() * scale in fp32, rounded once to the engine's dtype (as
transformers' and vLLM's dequantisation do).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                            "float8_e5m2fnuz") if hasattr(torch, n))
_ROWS_PER_CHUNK = 1024  # fp32 temporaries stay ~1024 x C, whatever the tensor's size


def _block_size(quant: dict[str, Any]) -> tuple[int, int] | None:
    block = quant.get("weight_block_size")
    if block is None:
        return None
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config weight_block_size {block!r} is not two positive "
                         f"ints")
    return int(block[0]), int(block[1])


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales from a checkpoint's scale tensor: any float dtype as is; uint8 holds E8M0
    exponents (2 ** (byte - 127)), as some newer checkpoints store them."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    if not scale.dtype.is_floating_point:
        raise ValueError(f"fp8 scale dtype {scale.dtype} is not a float or E8M0 (uint8)")
    return scale.float()


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int] | None, dtype: torch.dtype,
                   name: str = "weight") -> torch.Tensor:
    """``weight`` [..., R, C] (fp8) with its per-block scales -> ``dtype``, chunked by rows so
    the fp32 intermediate stays small for large tensors."""
    scale = scale_to_float(scale_inv)
    if block is None:
        if scale.numel() != 1:
            raise ValueError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale.shape)}: without "
                             f"weight_block_size the scale is one value")
        return (weight.float() * scale.reshape(())).to(dtype)
    if weight.dim() < 2:
        raise ValueError(f"{name}: an fp8 block-quantised tensor must have 2+ dims, got "
                         f"{tuple(weight.shape)}")
    (bn, bk), (rows, cols) = block, weight.shape[-2:]
    grid = (-(-rows // bn), -(-cols // bk))
    if tuple(scale.shape) != (*weight.shape[:-2], *grid):
        raise ValueError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale.shape)}, expected "
                         f"{(*weight.shape[:-2], *grid)} for weight {tuple(weight.shape)} in "
                         f"blocks of {list(block)}")
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    w3, s3, o3 = weight.reshape(-1, rows, cols), scale.reshape(-1, *grid), out.view(-1, rows, cols)
    step = max(bn, _ROWS_PER_CHUNK // bn * bn)  # whole row blocks per chunk
    for w2, s2, o2 in zip(w3, s3, o3):
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            s = s2[r0 // bn:-(-r1 // bn)].repeat_interleave(bn, 0)[:r1 - r0]
            s = s.repeat_interleave(bk, 1)[:, :cols]  # partial edge blocks: cut to the weight
            o2[r0:r1] = (w2[r0:r1].float() * s).to(dtype)
    return out


@dataclass(frozen=True)
class Fp8BlockFormat:
    block: tuple[int, int] | None

    @classmethod
    def from_config(cls, quant: dict[str, Any], cfg: dict[str, Any]) -> "Fp8BlockFormat":
        fmt = quant.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config fmt {fmt!r} is not supported for fp8 "
                             f"(only 'e4m3')")
        # Static activation scales quantise activations too: dequantising the weights alone
        # would not compute what the checkpoint was calibrated for.
        scheme = quant.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"quantization_config activation_scheme {scheme!r} is not "
                             f"supported for fp8 (only 'dynamic')")
        return cls(_block_size(quant))

    def is_companion(self, name: str) -> bool:
        return name.endswith(".weight" + SCALE_SUFFIX)

    def companions(self, name: str, tensor: torch.Tensor) -> list[str]:
        if tensor.dtype not in _FLOAT8:
            return []
        if tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: {tensor.dtype} in a quantization_config fmt 'e4m3' "
                             f"checkpoint")
        if not name.endswith(".weight"):
            raise ValueError(f"{name}: an fp8 tensor that is not a .weight has no scale")
        return [name + SCALE_SUFFIX]

    def dequantize(self, name: str, tensor: torch.Tensor, companions: dict[str, torch.Tensor],
                   dtype: torch.dtype) -> tuple[str, torch.Tensor]:
        return name, dequantize_fp8(tensor, companions[name + SCALE_SUFFIX], self.block,
                                    dtype, name)
