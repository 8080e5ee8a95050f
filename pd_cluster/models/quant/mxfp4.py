"""gpt-oss MXFP4 expert weights (``quant_method: "mxfp4"``), dequantised on load.

gpt-oss checkpoints store each MoE layer's ``experts.gate_up_proj`` / ``experts.down_proj`` as
``<name>_blocks`` uint8 [E, N, G, 16] and ``<name>_scales`` uint8 [E, N, G]: for each of the N
output rows, G groups of 32 FP4 (E2M1) values, two per byte (low nibble first), sharing one
E8M0 exponent (value = fp4 * 2 ** (scale - 127)). Dequantised rows [E, N, G * 32] are the
transpose of the checkpoint's unquantised layout, so the result is handed on as ``<name>``
[E, G * 32, N] (gate/up interleaved, as in bf16 gpt-oss checkpoints). Everything else in the
checkpoint (attention, router, biases, sinks, embeddings) is unquantised and passes through.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

BLOCKS, SCALES = "_blocks", "_scales"
# E2M1: sign bit 3, exponent bits 2-1, mantissa bit 0; index = the nibble.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_ROWS_PER_CHUNK = 1 << 16  # groups of 32 per step: fp32 temporaries of a few MB
ARCHITECTURE = "GptOssForCausalLM"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     name: str = "weight") -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] in ``dtype``
    (exact in fp32/bf16: an FP4 value times a power of two), computed in fp32 chunks."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} "
                         f"and {scales.dtype}")
    if blocks.dim() < 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}{BLOCKS} {tuple(blocks.shape)} does not match "
                         f"{name}{SCALES} {tuple(scales.shape)} (blocks are [..., G, 16])")
    *prefix, groups, width = blocks.shape
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    flat_b, flat_s = blocks.reshape(-1, width), scales.reshape(-1, 1)
    out = torch.empty(flat_b.shape[0], width * 2, dtype=dtype, device=blocks.device)
    for r0 in range(0, flat_b.shape[0], _ROWS_PER_CHUNK):
        b = flat_b[r0:r0 + _ROWS_PER_CHUNK].long()
        vals = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(1)  # low nibble first
        exp = flat_s[r0:r0 + _ROWS_PER_CHUNK].to(torch.int32) - 127
        out[r0:r0 + _ROWS_PER_CHUNK] = torch.ldexp(vals, exp).to(dtype)
    return out.view(*prefix, groups * width * 2)


@dataclass(frozen=True)
class Mxfp4Format:
    @classmethod
    def from_config(cls, quant: dict[str, Any], cfg: dict[str, Any]) -> "Mxfp4Format":
        # The layout (transposed, interleaved experts) is gpt-oss's: refuse it elsewhere.
        archs = cfg.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise ValueError(f"quantization_config 'mxfp4' is supported for {ARCHITECTURE} "
                             f"only, not {archs}")
        return cls()

    def is_companion(self, name: str) -> bool:
        return name.endswith(SCALES)

    def companions(self, name: str, tensor: torch.Tensor) -> list[str]:
        return [name[:-len(BLOCKS)] + SCALES] if name.endswith(BLOCKS) else []

    def dequantize(self, name: str, tensor: torch.Tensor, companions: dict[str, torch.Tensor],
                   dtype: torch.dtype) -> tuple[str, torch.Tensor]:
        stem = name[:-len(BLOCKS)]
        rows = dequantize_mxfp4(tensor, companions[stem + SCALES], dtype, stem)
        return stem, rows.transpose(-1, -2)
