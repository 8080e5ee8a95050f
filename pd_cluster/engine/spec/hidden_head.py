"""The hook for proposers that read the target's hidden states (EAGLE-style heads, DeepSeek's
MTP layers): "last hidden state in, tokens out".

A ``HiddenStateHead`` is a small model over its own paged KV cache. At position p it reads
the target's hidden state h_p (the served model's output there, after its final norm) and
token p+1, and returns its own state o_p, whose logits score token p+2; chained, o_p stands in
for the target's hidden state at p+1 (so one head proposes k tokens). DeepSeek-V3's MTP layer
(models/mtp.py) is one; an EAGLE head (fc over [embedding, hidden] + a decoder layer + the
target's lm_head) has the same shape and would plug in beside it (head_runner.py runs any,
hidden_proposer.py proposes with any).

``TargetHidden`` is what the engine hands the proposer after each step: the target's hidden
states, and per scheduled request which rows hold which positions (the step's batch order,
step_input.batch_order)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pd_cluster.models.context import ForwardContext


class HiddenStateHead(Protocol):
    def kv_cache_specs(self, dtype: torch.dtype) -> list[Any]:
        """What each of its layers caches per token (engine/kv_spec.py)."""
        ...

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """token_ids[i] = t_{p+1}, hidden[i] = h_p at positions[i] = p -> o_p [T, hidden]."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """o_p -> fp32 logits over the vocabulary (scoring t_{p+2})."""
        ...


@dataclass
class TargetRows:
    """One scheduled request's part of a step: positions start .. start + count - 1 in
    rows first .. first + count - 1 of the step's hidden states."""
    request: Any
    start: int
    first: int
    count: int


def target_rows(batch: list[Any]) -> list[TargetRows]:
    """Per item of a step's batch (in its order), where its hidden states are."""
    out, first = [], 0
    for item in batch:
        out.append(TargetRows(item.request, item.request.num_computed_tokens, first,
                              item.num_new_tokens))
        first += item.num_new_tokens
    return out
