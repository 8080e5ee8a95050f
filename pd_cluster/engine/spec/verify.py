"""Rank 0: one step's logits for requests with drafts -> the tokens each keeps.

A request with drafts d1..dk has k+1 logits rows: row j scores the token after d1..dj. Row j
is adjusted as the sampler adjusts a row whose output already ends in d1..dj (min_tokens,
penalties, the grammar mask after those tokens), so every kept token is decided exactly as
without speculation: greedy keeps d(j+1) while it is row j's argmax, and the first row whose
argmax differs gives the last token; sampling accepts or resamples (rejection.py). A grammar
only ever follows accepted tokens: row j's mask is filled after the matcher caught up with
d1..dj, and a draft the mask bans has probability 0, so acceptance ends there."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pd_cluster.engine.penalties import apply_penalties, needs_adjusting
from pd_cluster.engine.sampler import Sampler, apply_min_tokens_mask, token_logprobs
from pd_cluster.engine.spec.rejection import accept_or_resample, sample_from, target_probs
from pd_cluster.engine.structured.masks import apply_grammar_masks
from pd_cluster.request import Request


@dataclass
class Verified:
    """One request's outcome: the drafts accepted, then the token that follows them."""
    accepted: list[int]
    token: int
    logprobs: list[dict[int, float] | None] = field(default_factory=list)  # per kept token


class _Row:
    """A request as row j sees it: its output so far followed by its first j drafts."""

    def __init__(self, request: Request, output: list[int]) -> None:
        self.sampling_params = request.sampling_params
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids = output
        self.grammar = request.grammar
        self.eos_token_id = request.eos_token_id


def verify(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
           sampler: Sampler) -> list[Verified]:
    """``logits`` [sum(len(d) + 1), V]: request i's rows are contiguous, in order."""
    logits = logits.float()
    views: list[_Row] = []
    for req, d in zip(requests, drafts):
        views += [_Row(req, req.output_token_ids + d[:j]) for j in range(len(d) + 1)]
    if any(v.sampling_params.min_tokens for v in views):
        logits = apply_min_tokens_mask(logits, [v.sampling_params for v in views],
                                       [len(v.output_token_ids) for v in views],
                                       requests[0].eos_token_id)
    if any(needs_adjusting(v.sampling_params) for v in views):
        logits = apply_penalties(logits, views)
    # Greedy rows without a grammar: one argmax for all of them.
    argmax = logits.argmax(dim=-1).tolist()
    out, start = [], 0
    for req, d in zip(requests, drafts):
        rows = logits[start:start + len(d) + 1]
        result = _verify_one(rows, req, d, argmax[start:start + len(d) + 1], sampler,
                             views[start:start + len(d) + 1])
        start += len(d) + 1
        params = req.sampling_params
        if params.logprobs is not None:
            kept = result.accepted + [result.token]
            result.logprobs = token_logprobs(rows[:len(kept)], kept,
                                             [params.logprobs or 0] * len(kept))
        else:
            result.logprobs = [None] * (len(result.accepted) + 1)
        out.append(result)
    return out


def _verify_one(rows: torch.Tensor, req: Request, d: list[int], argmax: list[int],
                sampler: Sampler, views: list[_Row]) -> Verified:
    params, grammar = req.sampling_params, req.grammar is not None
    probs = None
    if not params.is_greedy and not grammar:
        probs = target_probs(rows, params)
    accepted: list[int] = []
    for j in range(len(d) + 1):
        if grammar:
            # Row j's mask after d1..dj (the matcher catches up with the view's output).
            apply_grammar_masks(rows[j:j + 1], [views[j]])
            if req.grammar.failure:
                return Verified(accepted, int(rows[j].argmax()))  # the engine ends it
            if params.is_greedy:
                argmax[j] = int(rows[j].argmax())
        gen = req.generator_for_token(rows.device, len(req.output_token_ids) + j) \
            or sampler.default_generator(rows.device)
        if params.is_greedy:
            if j < len(d) and argmax[j] == d[j]:
                accepted.append(d[j])
                continue
            token = argmax[j]
        else:
            p = probs[j] if probs is not None else target_probs(rows[j:j + 1], params)[0]
            if j == len(d):
                token = sample_from(p, gen)
            else:
                token, ok = accept_or_resample(p, d[j], gen)
                if ok:
                    accepted.append(token)
                    continue
        if grammar:
            req.grammar.advance(token)
        return Verified(accepted, token)
    raise AssertionError("unreachable: the last row always decides")
