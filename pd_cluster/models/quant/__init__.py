"""Quantised checkpoints, dequantised on load to the engine's dtype (one file per format).

``quant_format(cfg)`` reads ``quantization_config``: None for an unquantised checkpoint, the
format for a supported ``quant_method``, a one-line ValueError naming the method otherwise.
A format tells the loader which tensors are *companions* (scales, read together with the tensor
they scale and never loaded on their own), which companions a tensor needs, and how to turn a
tensor and its companions into the full-precision tensor its parameter loads.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from pd_cluster.models.quant.fp8_block import Fp8BlockFormat
from pd_cluster.models.quant.mxfp4 import Mxfp4Format


class QuantFormat(Protocol):
    def is_companion(self, name: str) -> bool: ...

    def companions(self, name: str, tensor: torch.Tensor) -> list[str]: ...

    def dequantize(self, name: str, tensor: torch.Tensor, companions: dict[str, torch.Tensor],
                   dtype: torch.dtype) -> tuple[str, torch.Tensor]: ...


_FORMATS: dict[str, Callable[[dict[str, Any], dict[str, Any]], QuantFormat]] = {
    "fp8": Fp8BlockFormat.from_config,  # DeepSeek-V3/R1, Qwen3-FP8: block-scaled e4m3
    "mxfp4": Mxfp4Format.from_config,  # gpt-oss experts
}


def quant_format(cfg: dict[str, Any]) -> QuantFormat | None:
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in _FORMATS:
        raise ValueError(f"quantization_config {method!r} is not supported (dequantised on "
                         f"load: {', '.join(sorted(_FORMATS))}; else unquantised fp32/fp16/bf16 "
                         f"checkpoints)")
    return _FORMATS[method](quant, cfg)
