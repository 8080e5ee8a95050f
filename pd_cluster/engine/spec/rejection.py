"""Rejection sampling that keeps the target distribution (Leviathan et al. 2023; vLLM's
rejection sampler): a draft token ``d`` drawn from ``q`` is accepted with probability
min(1, p(d) / q(d)); when rejected, the token is drawn from norm(max(0, p - q)) instead. Either
way the token has distribution ``p`` exactly. A proposer without probabilities (ngram) is a
point mass: q(d) = 1, so ``d`` is accepted with probability p(d) and a rejection draws from p
with ``d`` removed. verify.py applies the point-mass case batched to unseeded requests, and to
seeded ones in its equivalent form: sample x ~ p with the sampler and keep d iff x = d (the
same law; the draw is the sampler's own, so seeded output does not depend on the drafts).

``target_probs`` is the distribution the sampler draws from (sampler.py: temperature, then
top-k and top-p, ties kept in vocabulary order), in vocabulary order."""
from __future__ import annotations

import torch

from pd_cluster.sampling_params import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits of one request's positions -> the probabilities its sampler draws from."""
    return batch_target_probs(logits, [params] * logits.shape[0])


def batch_target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[N, V] logits, row i under ``params[i]`` -> the probabilities the sampler draws from.
    Rows that filter (top-k / top-p) and rows that do not are computed apart, so a row's
    numbers never depend on the others' params (sampler.py's contract)."""
    scaled = logits.float() / torch.tensor([p.temperature for p in params],
                                           device=logits.device).unsqueeze(1)
    vocab = scaled.shape[1]
    filtered = [i for i, p in enumerate(params) if p.top_p < 1.0 or 0 < p.top_k < vocab]
    probs = torch.softmax(scaled, dim=-1)
    if not filtered:
        return probs
    idx = torch.tensor(filtered, dtype=torch.long, device=logits.device)
    sorted_logits, sorted_idx = torch.sort(scaled[idx], dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab, device=scaled.device).unsqueeze(0)
    ks = torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab for i in filtered],
                      device=scaled.device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(positions >= ks, float("-inf"))
    top_ps = torch.tensor([params[i].top_p for i in filtered], dtype=scaled.dtype,
                          device=scaled.device).unsqueeze(1)
    kept = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(kept, dim=-1) - kept
    drop = (mass_before >= top_ps) & (positions > 0)
    kept = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    probs[idx] = torch.zeros_like(kept).scatter_(1, sorted_idx, kept)
    return probs


def accept_or_resample(p: torch.Tensor, draft: int, generator: torch.Generator | None,
                       q: torch.Tensor | None = None) -> tuple[int, bool]:
    """One position: (token, whether it is the draft). ``p`` [V]: the target's distribution;
    ``q`` [V]: the proposer's (None: a point mass on ``draft``)."""
    p_d = float(p[draft])
    q_d = 1.0 if q is None else float(q[draft])
    u = float(torch.rand((), generator=generator, device=p.device))
    if q_d > 0 and u < min(1.0, p_d / q_d):
        return draft, True
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)
    total = float(residual.sum())
    if total <= 0.0:  # only by rounding (a rejection needs p != q somewhere)
        residual, total = p, float(p.sum())
    token = torch.multinomial(residual / total, 1, generator=generator)
    return int(token), False


def sample_from(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """The token after the last accepted draft (all accepted: the bonus token)."""
    return int(torch.multinomial(p, 1, generator=generator))
