"""Attention backend interface and the registry that picks one by name."""
from __future__ import annotations

from abc import ABC, abstractmethod
import importlib
import logging

import torch

from pd_cluster.attention.fresh_prefill import forward_fresh
from pd_cluster.attention.metadata import AttentionMetadata
from pd_cluster.attention.options import AttentionOptions

logger = logging.getLogger(__name__)


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged cache and attends over it.

    No per-request dense KV is kept between steps: everything is read from ``kv_cache``.
    """

    name: str = ""

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata,
                 static_scales: tuple[float, float] | None = None) -> None:
        """key/value: [num_tokens, num_kv_heads, head_dim]; slots from ``meta.slot_mapping``.
        An FP8 cache (kernels/kv_quant.py) stores them quantised, with the layer's checkpoint
        ``static_scales`` (K, V) when it has them, else per-block scales."""

    @abstractmethod
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                opts: AttentionOptions) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim] -> output of the same shape (causal,
        with the layer's window, soft-cap and sinks from ``opts``)."""

    def forward_fresh(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      kv_cache: torch.Tensor, meta: AttentionMetadata,
                      opts: AttentionOptions) -> torch.Tensor:
        """``forward`` after ``write_kv(key, value, ...)``; with an FP8 cache the prefill
        chunks attend over this fresh K/V instead of its quantised copy
        (attention/fresh_prefill.py)."""
        return forward_fresh(self, query, key, value, kv_cache, meta, opts)

    # Whether forward_latent also serves prefill chunks (else latent layers decompress them).
    latent_prefill_in_place: bool = False

    @abstractmethod
    def forward_latent(self, query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                       opts: AttentionOptions, value_dim: int, num_reqs: int) -> torch.Tensor:
        """Latent attention in absorbed form for the batch's first ``num_reqs`` requests (only
        decodes unless ``latent_prefill_in_place``): query [their tokens, heads, cache_dim]
        against ``cache`` [1, blocks, block_size, 1, cache_dim] (keys = the whole cached
        vector, values = its first ``value_dim`` entries) -> [their tokens, heads, value_dim]."""


# name -> (module, class): a backend's module is imported when it is first asked for (the
# Triton one imports no CUDA at load, but needs Triton).
_BACKENDS: dict[str, tuple[str, str]] = {
    "cpu": ("pd_cluster.attention.cpu_backend", "CpuAttentionBackend"),
    "torch": ("pd_cluster.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("pd_cluster.attention.triton_backend", "TritonAttentionBackend"),
}


def create_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` means Triton on CUDA, the C++ paged kernel on CPU (the torch reference, with a
    warning, where that kernel cannot be built)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else _cpu_choice()
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend: unknown backend {name!r}; "
                         f"choose one of {sorted(_BACKENDS) + ['auto']}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()


def _cpu_choice() -> str:
    from kernels.cpu_build import load_cpu_kernels, load_error
    if load_cpu_kernels():
        return "cpu"
    # Not a second warning: a failed build already logged one naming the error and this
    # fallback (kernels/cpu_build.py), and the engine's stats report it (cpu_kernels).
    logger.info("attention_backend auto: using the torch reference attention on CPU (%s)",
                load_error())
    return "torch"
