"""Rank 0: verifying one request whose output follows a grammar, row by row: row j's mask is
the matcher's after d1..dj, so each row is masked only once the drafts before it were kept,
then drawn as the sampler draws (verify.py's sample-then-compare; it decides every other
request of the batch at once)."""
from __future__ import annotations

from typing import Any

import torch

from pd_cluster.engine.sampler import Sampler
from pd_cluster.engine.structured.masks import apply_grammar_masks
from pd_cluster.request import Request


def verify_one(rows: torch.Tensor, req: Request, d: list[int], sampler: Sampler,
               views: list[Any]) -> tuple[list[int], int, list[dict[int, float] | None]]:
    """(accepted drafts, the token after them, each kept token's logprobs); ``views[j]``: the
    request as row j sees it (its output followed by d1..dj), for the grammar mask."""
    accepted: list[int] = []
    logprobs: list[dict[int, float] | None] = []
    for j in range(len(d) + 1):
        # Row j's mask after d1..dj (the matcher catches up with the view's output).
        apply_grammar_masks(rows[j:j + 1], [views[j]])
        if req.grammar.failure:
            return accepted, int(rows[j].argmax()), logprobs + [None]  # the engine ends it
        gen = req.generator_for_token(rows.device, len(req.output_token_ids) + j)
        drawn = sampler.sample(rows[j:j + 1], [req.sampling_params], [gen])
        token = drawn.token_ids[0]
        logprobs.append(drawn.logprobs[0])
        if j < len(d) and token == d[j]:
            accepted.append(token)
            continue
        req.grammar.advance(token)
        return accepted, token, logprobs
    raise AssertionError("unreachable: the last row always decides")
