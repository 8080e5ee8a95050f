"""Triton kernels for the paged KV cache, each beside its launcher and a torch reference.

Importing this package touches neither CUDA nor (until a launcher is first used) Triton:
launchers are resolved lazily through ``__getattr__``, and every kernel module guards its
``import triton`` so the torch references keep working where Triton is not installed.
Launchers fall back to the torch reference for tensors Triton cannot run on (CPU tensors
outside ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import importlib
import os
from typing import Any

import torch

_LAZY: dict[str, str] = {
    "paged_decode_attention": "kernels.paged_decode_attention",
    "paged_decode_attention_ref": "kernels.paged_decode_attention",
    "choose_num_splits": "kernels.paged_decode_attention",
    "paged_prefill_attention": "kernels.paged_prefill_attention",
    "paged_prefill_attention_ref": "kernels.paged_prefill_attention",
    "reshape_and_cache": "kernels.reshape_and_cache",
    "reshape_and_cache_ref": "kernels.reshape_and_cache",
    "fused_experts": "kernels.fused_moe",
    "fused_experts_ref": "kernels.fused_moe",
    "gather_kv_blocks": "kernels.block_copy",
    "scatter_kv_blocks": "kernels.block_copy",
}

__all__ = sorted(_LAZY) + ["triton_available", "interpreting", "runs_triton"]


def triton_available() -> bool:
    """True if ``import triton`` works (checked without importing kernels)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install raising something else
        return False
    return True


def interpreting() -> bool:
    """True if Triton kernels defined now will run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def runs_triton(has_triton: bool, interpreted: bool, *tensors: torch.Tensor) -> bool:
    """Whether a launcher should run its Triton kernel on ``tensors`` rather than the torch ref.

    ``interpreted`` is the TRITON_INTERPRET state when the kernel module was imported (it fixes
    whether ``@triton.jit`` made a compiled or an interpreted kernel).
    """
    if not has_triton:
        return False
    if interpreted:
        return True
    return all(t.is_cuda for t in tensors)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
