"""The sampler's grammar masks: one bitmask for the batch, filled on the host by the backend
(its own threads), applied to the logits on their device in one call; then each sampled token
is followed at once, so a token its grammar refuses is caught before it is emitted."""
from __future__ import annotations

from typing import Any

import torch


def apply_grammar_masks(logits: torch.Tensor, requests: list[Any]) -> torch.Tensor:
    """Ban (in place) every token that a row's grammar does not allow next. A row whose
    grammar fails here gets no mask: its request ends this step (``grammar.failure``)."""
    rows, matchers, grammars = [], [], []
    for i, request in enumerate(requests):
        grammar = request.grammar
        if grammar is None:
            continue
        matcher = grammar.matcher(request.output_token_ids)
        if matcher is None:
            continue
        rows.append(i)
        matchers.append(matcher)
        grammars.append(grammar)
    if not rows:
        return logits
    backend = grammars[0].backend
    bitmask = backend.allocate_bitmask(logits.shape[0])
    try:
        backend.fill_bitmask(matchers, bitmask, rows)
    except Exception:  # noqa: BLE001 - find the rows that fail; the others keep their masks
        rows = _fill_each(backend, bitmask, rows, matchers, grammars)
        if not rows:
            return logits
    backend.apply_bitmask(logits, bitmask, rows)
    return logits


def _fill_each(backend: Any, bitmask: Any, rows: list[int], matchers: list[Any],
               grammars: list[Any]) -> list[int]:
    filled = []
    for row, matcher, grammar in zip(rows, matchers, grammars):
        try:
            backend.fill_bitmask([matcher], bitmask, [row])
            filled.append(row)
        except Exception as e:  # noqa: BLE001 - this request's grammar only
            grammar.fail(f"{type(e).__name__}: {e}")
    return filled


def follow_sampled(requests: list[Any], tokens: list[int]) -> None:
    """Each grammar follows its row's sampled token (a refused one sets ``failure``)."""
    for request, token in zip(requests, tokens):
        if request.grammar is not None:
            request.grammar.advance(token)


def split_broken(requests: list[Any]) -> tuple[list[Any], list[Any]]:
    """(requests to go on, requests whose grammar broke this step)."""
    ok, broken = [], []
    for r in requests:
        (broken if r.grammar is not None and r.grammar.failure else ok).append(r)
    return ok, broken
