"""Rank 0: one step's logits for requests with drafts -> the tokens each keeps.

A request with drafts d1..dk has k+1 logits rows: row j scores the token after d1..dj. Row j
is adjusted as the sampler adjusts a row whose output already ends in d1..dj (min_tokens,
penalties, the grammar mask after those tokens), so every kept token is decided exactly as
without speculation: greedy keeps d(j+1) while it is row j's argmax, and the first row whose
argmax differs gives the last token; sampling accepts or resamples (rejection.py). A grammar
only ever follows accepted tokens: row j's mask is filled after the matcher caught up with
d1..dj, and a draft the mask bans has probability 0, so acceptance ends there.

The batch is decided in tensor passes, not request by request (at batch 16 a per-request loop
cost more than speculation saved): the requests' rows go into a padded [B, k+1] layout, one
argmax (greedy) or one probability pass and one uniform per row (sampling) decides every
position, and a cumulative product of the per-position accepts gives each request's accepted
count. Only a grammar, whose mask of row j depends on the matcher after d1..dj, goes row by row
(grammar_verify.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pd_cluster.engine.penalties import apply_penalties, needs_adjusting
from pd_cluster.engine.sampler import Sampler, apply_min_tokens_mask, token_logprobs
from pd_cluster.engine.spec.grammar_verify import verify_one
from pd_cluster.engine.spec.rejection import batch_target_probs
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
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    views: list[_Row] | None = None
    if any(r.sampling_params.min_tokens or needs_adjusting(r.sampling_params)
           or r.grammar is not None for r in requests):
        views = [_Row(req, req.output_token_ids + d[:j])
                 for req, d in zip(requests, drafts) for j in range(len(d) + 1)]
        if any(v.sampling_params.min_tokens for v in views):
            logits = apply_min_tokens_mask(logits, [v.sampling_params for v in views],
                                           [len(v.output_token_ids) for v in views],
                                           requests[0].eos_token_id)
        if any(needs_adjusting(v.sampling_params) for v in views):
            logits = apply_penalties(logits, views)
    out: list[Verified | None] = [None] * len(requests)
    greedy, sampled = [], []
    for i, req in enumerate(requests):
        if req.grammar is not None:
            a, b = starts[i], starts[i + 1]
            assert views is not None
            out[i] = Verified(*verify_one(logits[a:b], req, drafts[i], sampler, views[a:b]))
        elif req.sampling_params.is_greedy:
            greedy.append(i)
        else:
            sampled.append(i)
    if greedy:
        _greedy(logits, starts, drafts, greedy, out)
    if sampled:
        _sampled(logits, starts, requests, drafts, sampled, sampler, out)
    _add_logprobs(logits, starts, requests, out)
    return out  # type: ignore[return-value]


def _layout(starts: list[int], drafts: list[list[int]], which: list[int], device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, k+1] row index of each position, a short request's padding repeating its last row;
    [B, k] drafts, padded with -1, which no token equals)."""
    width = max(len(drafts[i]) for i in which)
    rows, toks = [], []
    for i in which:
        n = len(drafts[i])
        rows.append(list(range(starts[i], starts[i] + n + 1)) + [starts[i] + n] * (width - n))
        toks.append(drafts[i] + [-1] * (width - n))
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(toks, dtype=torch.long, device=device))


def _accepted_count(accept: torch.Tensor) -> torch.Tensor:
    """[B, k] per-position accepts -> [B] length of each row's accepted prefix."""
    return accept.to(torch.int32).cumprod(dim=1).sum(dim=1)


def _greedy(logits: torch.Tensor, starts: list[int], drafts: list[list[int]], which: list[int],
            out: list[Verified | None]) -> None:
    """Keep d(j+1) while it is row j's argmax; the first row whose argmax differs (or the last
    row) gives the token."""
    rows, toks = _layout(starts, drafts, which, logits.device)
    argmax = logits.argmax(dim=-1)[rows]  # [B, k+1]
    n = _accepted_count(argmax[:, :-1] == toks)
    token = argmax.gather(1, n.long().unsqueeze(1)).squeeze(1)
    for i, count, t in zip(which, n.tolist(), token.tolist()):
        out[i] = Verified(drafts[i][:count], t)


def _sampled(logits: torch.Tensor, starts: list[int], requests: list[Request],
             drafts: list[list[int]], which: list[int], sampler: Sampler,
             out: list[Verified | None]) -> None:
    """Rejection sampling with a point-mass proposal (rejection.py): draft d at row j is kept
    with probability p_j(d); the first rejected row draws from p_j without d, and a request
    whose drafts were all kept draws its last row. Token index j of a seeded request uses its
    (seed, j) generator, as sample-by-sample: a uniform, then (rejected) the residual draw."""
    device = logits.device
    rows, toks = _layout(starts, drafts, which, device)
    flat = rows.flatten()
    probs = batch_target_probs(logits[flat], [requests[i].sampling_params for i in which
                                              for _ in range(rows.shape[1])])
    probs = probs.view(rows.shape[0], rows.shape[1], -1)  # [B, k+1, V]
    p_draft = probs[:, :-1].gather(2, toks.clamp(min=0).unsqueeze(2)).squeeze(2)  # [B, k]
    uniform = torch.empty_like(p_draft)
    default = sampler.default_generator(device)
    unseeded = [b for b, i in enumerate(which) if requests[i].sampling_params.seed is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), uniform.shape[1], generator=default,
                                       device=device)
    for b, i in enumerate(which):
        req = requests[i]
        if req.sampling_params.seed is None:
            continue
        base = req.num_output_tokens
        for j in range(len(drafts[i])):
            uniform[b, j] = torch.rand((), generator=req.generator_for_token(device, base + j),
                                       device=device)
    n = _accepted_count((uniform < p_draft) & (toks >= 0)).tolist()
    for b, (i, count) in enumerate(zip(which, n)):
        req, d = requests[i], drafts[i]
        p = probs[b, count]
        gen = req.generator_for_token(device, req.num_output_tokens + count)
        if count < len(d):  # row ``count`` rejected its draft: the residual p without it
            if gen is not None:
                torch.rand((), generator=gen, device=device)  # the uniform it drew first
            p = p.clone()
            p[d[count]] = 0.0
            if float(p.sum()) <= 0.0:  # only by rounding (a rejection needs p(d) < 1)
                p = probs[b, count]
        token = int(torch.multinomial(p, 1, generator=gen if gen is not None else default))
        out[i] = Verified(d[:count], token)


def _add_logprobs(logits: torch.Tensor, starts: list[int], requests: list[Request],
                  out: list[Verified | None]) -> None:
    """Each kept token's logprobs from its own row, one pass for every request that asks."""
    rows, tokens, ks, owners = [], [], [], []
    for i, (req, v) in enumerate(zip(requests, out)):
        assert v is not None
        kept = v.accepted + [v.token]
        k = req.sampling_params.logprobs
        if k is None:
            v.logprobs = [None] * len(kept)
            continue
        rows += range(starts[i], starts[i] + len(kept))
        tokens += kept
        ks += [k or 0] * len(kept)
        owners.append((i, len(kept)))
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    lps = token_logprobs(logits[index], tokens, ks)
    at = 0
    for i, n in owners:
        out[i].logprobs = lps[at:at + n]  # type: ignore[union-attr]
        at += n
