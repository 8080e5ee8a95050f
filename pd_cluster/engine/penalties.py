"""Logit adjustments before sampling, with vLLM's semantics (OpenAI's for the first three):

- ``logit_bias``: {token id: bias} added to that token's logit;
- ``presence_penalty``: subtracted once from every token that appeared in the output;
- ``frequency_penalty``: subtracted per occurrence in the output;
- ``repetition_penalty``: tokens seen in the prompt or the output have a positive logit divided
  by it and a negative one multiplied by it.
They depend only on the request's own tokens, so prefill and decode engines (and a resumed
request) adjust identically.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


def needs_adjusting(params: Any) -> bool:
    return bool(params.logit_bias or params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0)


def apply_penalties(logits: torch.Tensor, requests: Sequence[Any]) -> torch.Tensor:
    """In place on the rows whose request asks for it; ``requests`` have sampling_params,
    prompt_token_ids and output_token_ids."""
    vocab = logits.shape[1]
    for i, req in enumerate(requests):
        p = req.sampling_params
        if not needs_adjusting(p):
            continue
        row = logits[i]
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long,
                               device=row.device)
            if ids.numel():
                row.index_add_(0, ids, torch.tensor([p.logit_bias[t] for t in ids.tolist()],
                                                    dtype=row.dtype, device=row.device))
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
            for tokens in (req.prompt_token_ids, req.output_token_ids):
                if tokens:
                    seen[torch.tensor(tokens, dtype=torch.long, device=row.device)] = True
            penalized = torch.where(row > 0, row / p.repetition_penalty,
                                    row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalized, row))
        if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
            counts = torch.bincount(torch.tensor(req.output_token_ids, dtype=torch.long,
                                                 device=row.device), minlength=vocab)[:vocab]
            row -= p.frequency_penalty * counts.to(row.dtype)
            row -= p.presence_penalty * (counts > 0).to(row.dtype)
    return logits
