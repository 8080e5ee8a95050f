"""Rank 0: one step's logits for requests with drafts -> the tokens each keeps.

A request with drafts d1..dk has k+1 logits rows: row j scores the token after d1..dj. Row j
is adjusted as the sampler adjusts a row whose output already ends in d1..dj (min_tokens,
penalties, the grammar mask after those tokens), then every row is sampled exactly as the
sampler samples a request's next token (greedy: the argmax; sampling: temperature, top-k,
top-p, token j from the request's (seed, j) generator), and the drafts are kept while they
equal what their row drew; the first row whose draw differs (or the last row) gives the last
token. Sample-then-compare is the standard rejection rule for a point-mass proposal (rejection.py:
d is kept with probability p(d), else the token comes from p without d, renormed: here x ~ p,
kept iff x = d, and x given x != d has exactly that law), so the distribution is the target's;
and since every kept token is the very draw the sampler would make, output equals decoding
without speculation token for token, greedy or seeded, whatever was proposed (an adaptive
proposer cannot make seeded output depend on timing). A grammar only ever follows accepted
tokens: row j's mask is filled after the matcher caught up with d1..dj, and a draft the mask
bans can never be drawn, so acceptance ends there.

The batch is decided in passes over all its rows, not request by request (at batch 16 a
per-request loop cost more than speculation saved): one argmax over the greedy requests' rows,
one sampler call over the seeded requests' rows, and one logprobs pass. The
unseeded sampled requests, whose draws need not be the sampler's, skip drawing a token for
every row (k+1 multinomials each): they take the rejection rule directly in a padded [B, k+1]
layout, one probability pass, one uniform per row, the accepted counts as a cumulative product
of the per-position accepts, and one draw per request. Only a grammar, whose mask of row j
depends on the matcher after d1..dj, goes row by row (grammar_verify.py)."""
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
    greedy, drawn, unseeded = [], [], []
    for i, req in enumerate(requests):
        if req.grammar is not None:
            a, b = starts[i], starts[i + 1]
            assert views is not None
            accepted, token, logprobs = verify_one(logits[a:b], req, drafts[i], sampler,
                                                   views[a:b])
            out[i] = Verified(accepted, token, logprobs)
        elif req.sampling_params.is_greedy:
            greedy.append(i)
        elif req.sampling_params.seed is not None:
            drawn.append(i)
        else:
            unseeded.append(i)
    if greedy:
        _greedy(logits, starts, drafts, greedy, out)
        _add_logprobs(logits, starts, requests, greedy, out)
    if drawn:
        _draw_and_compare(logits, starts, requests, drafts, drawn, sampler, out)
    if unseeded:
        _sampled(logits, starts, requests, drafts, unseeded, sampler, out)
        _add_logprobs(logits, starts, requests, unseeded, out)
    return out  # type: ignore[return-value]


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
    """Keep d(j+1) while it is row j's argmax (the sampler's greedy rule, the same op); the
    first row whose argmax differs (or the last row) gives the token."""
    every = len(which) == len(drafts)  # the usual case: no gather
    argmax = (logits if every else logits[torch.tensor(
        [r for i in which for r in range(starts[i], starts[i + 1])], dtype=torch.long,
        device=logits.device)]).argmax(dim=-1).tolist()
    at = 0
    for i in which:
        d = drafts[i]
        count = 0
        while count < len(d) and argmax[at + count] == d[count]:
            count += 1
        out[i] = Verified(d[:count], argmax[at + count])
        at += len(d) + 1


def _sampled(logits: torch.Tensor, starts: list[int], requests: list[Request],
             drafts: list[list[int]], which: list[int], sampler: Sampler,
             out: list[Verified | None]) -> None:
    """Unseeded requests: rejection sampling with a point-mass proposal (rejection.py), all
    rows at once: draft d at row j is kept with probability p_j(d) (one uniform per row from
    the default generator); the first rejected row draws from p_j without d, and a request
    whose drafts were all kept draws its last row."""
    device = logits.device
    rows, toks = _layout(starts, drafts, which, device)
    flat = rows.flatten()
    probs = batch_target_probs(logits[flat], [requests[i].sampling_params for i in which
                                              for _ in range(rows.shape[1])])
    probs = probs.view(rows.shape[0], rows.shape[1], -1)  # [B, k+1, V]
    p_draft = probs[:, :-1].gather(2, toks.clamp(min=0).unsqueeze(2)).squeeze(2)  # [B, k]
    uniform = torch.empty_like(p_draft)
    default = sampler.default_generator(device)
    uniform.uniform_(generator=default)
    n = _accepted_count((uniform < p_draft) & (toks >= 0)).tolist()
    for b, (i, count) in enumerate(zip(which, n)):
        d = drafts[i]
        p = probs[b, count]
        if count < len(d):  # row ``count`` rejected its draft: the residual p without it
            p = p.clone()
            p[d[count]] = 0.0
            if float(p.sum()) <= 0.0:  # only by rounding (a rejection needs p(d) < 1)
                p = probs[b, count]
        token = int(torch.multinomial(p, 1, generator=default))
        out[i] = Verified(d[:count], token)


def _add_logprobs(logits: torch.Tensor, starts: list[int], requests: list[Request],
                  which: list[int], out: list[Verified | None]) -> None:
    """Each kept token's logprobs from its own row, one pass for every request that asks."""
    rows, tokens, ks, owners = [], [], [], []
    for i in which:
        req, v = requests[i], out[i]
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
def row_generators(req: Request, device: torch.device, first: int, n: int
                   ) -> list[torch.Generator | None]:
    """Generators for the request's output tokens first .. first + n - 1, one object each
    (the request keeps one generator and reseeds it per token)."""
    if req.sampling_params.seed is None:
        return [None] * n
    gens: list[torch.Generator | None] = []
    for index in range(first, first + n):
        g = torch.Generator(device=device)
        g.set_state(req.generator_for_token(device, index).get_state())
        gens.append(g)
    return gens


def _draw_and_compare(logits: torch.Tensor, starts: list[int], requests: list[Request],
                      drafts: list[list[int]], which: list[int], sampler: Sampler,
                      out: list[Verified | None]) -> None:
    """One sampler call over every row of ``which``; each request keeps its drafts while they
    equal their rows' draws."""
    rows, params, gens = [], [], []
    for i in which:
        req, n = requests[i], len(drafts[i]) + 1
        rows += range(starts[i], starts[i] + n)
        params += [req.sampling_params] * n
        gens += row_generators(req, logits.device, req.num_output_tokens, n)
    if rows == list(range(len(rows))) and len(rows) == logits.shape[0]:
        picked = logits  # every row (the usual case): no copy
    else:
        picked = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
    drawn = sampler.sample(picked, params, gens)
    at = 0
    for i in which:
        d = drafts[i]
        count = 0
        while count < len(d) and drawn.token_ids[at + count] == d[count]:
            count += 1
        out[i] = Verified(d[:count], drawn.token_ids[at + count],
                          drawn.logprobs[at:at + count + 1])
        at += len(d) + 1
