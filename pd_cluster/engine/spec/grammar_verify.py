"""Rank 0: verifying one request whose output follows a grammar, row by row: row j's mask is
the matcher's after d1..dj, so each row is masked only once the drafts before it were kept
(verify.py decides every other request of the batch at once)."""
from __future__ import annotations

from typing import Any

import torch

from pd_cluster.engine.sampler import Sampler
from pd_cluster.engine.spec.rejection import accept_or_resample, sample_from, target_probs
from pd_cluster.engine.structured.masks import apply_grammar_masks
from pd_cluster.request import Request


def verify_one(rows: torch.Tensor, req: Request, d: list[int], sampler: Sampler,
               views: list[Any]) -> tuple[list[int], int]:
    """(accepted drafts, the token after them); ``views[j]``: the request as row j sees it
    (its output followed by d1..dj), for the grammar mask."""
    params = req.sampling_params
    accepted: list[int] = []
    for j in range(len(d) + 1):
        # Row j's mask after d1..dj (the matcher catches up with the view's output).
        apply_grammar_masks(rows[j:j + 1], [views[j]])
        if req.grammar.failure:
            return accepted, int(rows[j].argmax())  # the engine ends it
        gen = req.generator_for_token(rows.device, len(req.output_token_ids) + j) \
            or sampler.default_generator(rows.device)
        if params.is_greedy:
            token = int(rows[j].argmax())
            if j < len(d) and token == d[j]:
                accepted.append(token)
                continue
        else:
            p = target_probs(rows[j:j + 1], params)[0]
            if j == len(d):
                token = sample_from(p, gen)
            else:
                token, ok = accept_or_resample(p, d[j], gen)
                if ok:
                    accepted.append(token)
                    continue
        req.grammar.advance(token)
        return accepted, token
    raise AssertionError("unreachable: the last row always decides")
