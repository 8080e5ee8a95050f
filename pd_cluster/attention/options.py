"""Per-layer attention options every backend honours (the layer passes them on each call)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """scale: softmax scale of q.k (head_dim**-0.5, or query_pre_attn_scalar**-0.5 for Gemma).
    sliding_window: a query at position p sees keys p - window < k <= p (HF's window: the
    last ``window`` positions, itself included); None = full causal attention.
    logit_softcap: scores become cap * tanh(scores / cap) before the mask (Gemma 2).
    sinks: fp32 [num_heads] learned logits that join each head's softmax denominator and
    contribute no value (gpt-oss attention sinks)."""

    scale: float
    sliding_window: int | None = None
    logit_softcap: float | None = None
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"attn_logit_softcapping must be > 0, got {self.logit_softcap}")

    @property
    def plain(self) -> bool:
        """Only a scale: the fused SDPA paths apply."""
        return self.sliding_window is None and self.logit_softcap is None and self.sinks is None
