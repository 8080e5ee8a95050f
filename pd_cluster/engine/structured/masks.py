"""The sampler's grammar masks: one bitmask for the batch, filled on the host by the backend
(its own threads), applied to the logits on their device in one call."""
from __future__ import annotations

from typing import Any

import torch


def apply_grammar_masks(logits: torch.Tensor, requests: list[Any]) -> torch.Tensor:
    """Ban (in place) every token that a row's grammar does not allow next."""
    rows, matchers, backend = [], [], None
    for i, request in enumerate(requests):
        grammar = request.grammar
        if grammar is None:
            continue
        matcher = grammar.matcher(request.output_token_ids)
        if matcher is None:
            continue
        rows.append(i)
        matchers.append(matcher)
        backend = grammar.backend
    if not rows:
        return logits
    bitmask = backend.allocate_bitmask(logits.shape[0])
    backend.fill_bitmask(matchers, bitmask, rows)
    backend.apply_bitmask(logits, bitmask, rows)
    return logits
