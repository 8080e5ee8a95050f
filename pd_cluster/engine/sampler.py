"""Token sampler: greedy / temperature / top-k / top-p with per-request RNG.

Reproducibility contract: a request that carries its own ``torch.Generator``
(seeded from ``SamplingParams.seed``) draws the same tokens no matter which
other requests share the batch or in which order. To keep that true, every
row's numeric path depends only on its *own* params (never on whether some
other row needed sorting), and each row's random draw comes from its own
generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd_cluster.engine.stop_checker import EosIds, eos_ids
from pd_cluster.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: None when the request did not ask for logprobs, else
    # {token_id: logprob} for the top-k tokens plus the sampled token.
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        # One default generator per device: torch.multinomial requires the
        # generator to live on the same device as the probabilities.
        self._default_gens: dict[str, torch.Generator] = {}

    def default_generator(self, device: torch.device) -> torch.Generator:
        """The generator of unseeded requests on ``device`` (speculation's draws use it too)."""
        return self._default_generator(device)

    def _default_generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        g = self._default_gens.get(key)
        if g is None:
            g = torch.Generator(device=device)
            if self._seed is None:
                g.seed()  # non-deterministic
            else:
                g.manual_seed(self._seed)
            self._default_gens[key] = g
        return g

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
        n = logits.shape[0]
        if len(params) != n or len(generators) != n:
            raise ValueError(
                f"batch mismatch: logits has {n} rows, {len(params)} params, "
                f"{len(generators)} generators"
            )
        logits = logits.float()
        token_ids = torch.empty(n, dtype=torch.long, device=logits.device)

        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        # Split random rows by whether they need the sort-based filter; the
        # choice depends only on the row's own params (see module docstring).
        plain_rows: list[int] = []
        filter_rows: list[int] = []
        for i, p in enumerate(params):
            if p.is_greedy:
                continue
            vocab = logits.shape[1]
            needs_filter = p.top_p < 1.0 or 0 < p.top_k < vocab
            (filter_rows if needs_filter else plain_rows).append(i)

        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=logits.device)
            token_ids[idx] = logits[idx].argmax(dim=-1)
        if plain_rows:
            self._sample_plain(logits, params, generators, plain_rows, token_ids)
        if filter_rows:
            self._sample_filtered(logits, params, generators, filter_rows, token_ids)

        sampled = token_ids.tolist()
        return SamplerOutput(token_ids=sampled, logprobs=self._logprobs(logits, params, sampled))

    def _temperatures(self, params: list[SamplingParams], rows: list[int], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor([params[i].temperature for i in rows], dtype=like.dtype, device=like.device).unsqueeze(1)

    def _draw(self, probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        # Returns a 1-element device tensor (no .item()): avoids one host sync
        # per row on GPU; the whole batch is synced once by .tolist() later.
        g = gen if gen is not None else self._default_generator(probs.device)
        return torch.multinomial(probs, 1, generator=g)

    def _sample_plain(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        rows: list[int],
        out: torch.Tensor,
    ) -> None:
        idx = torch.tensor(rows, device=logits.device)
        scaled = logits[idx] / self._temperatures(params, rows, logits)
        probs = torch.softmax(scaled, dim=-1)
        for j, i in enumerate(rows):
            out[i : i + 1] = self._draw(probs[j], generators[i])

    def _sample_filtered(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        rows: list[int],
        out: torch.Tensor,
    ) -> None:
        idx = torch.tensor(rows, device=logits.device)
        scaled = logits[idx] / self._temperatures(params, rows, logits)
        vocab = scaled.shape[1]
        # One descending sort serves both filters; stable so ties keep
        # vocabulary order, which makes top_k=1 agree with argmax.
        sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=True, stable=True)
        positions = torch.arange(vocab, device=scaled.device).unsqueeze(0)

        ks = torch.tensor(
            [params[i].top_k if params[i].top_k > 0 else vocab for i in rows], device=scaled.device
        ).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(positions >= ks, float("-inf"))

        # top-p: keep the smallest prefix whose mass reaches top_p, i.e. drop a
        # token once the mass *before* it already reaches top_p. Position 0 is
        # always kept so at least one token survives.
        top_ps = torch.tensor([params[i].top_p for i in rows], dtype=scaled.dtype, device=scaled.device).unsqueeze(1)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = (mass_before >= top_ps) & (positions > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)

        # Sample in sorted space and map back through the permutation.
        for j, i in enumerate(rows):
            pos = self._draw(probs[j], generators[i])
            out[i : i + 1] = sorted_idx[j].gather(0, pos)

    def _logprobs(
        self, logits: torch.Tensor, params: list[SamplingParams], sampled: list[int]
    ) -> list[dict[int, float] | None]:
        result: list[dict[int, float] | None] = [None] * len(params)
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return result
        idx = torch.tensor(rows, device=logits.device)
        # Raw (untempered, unfiltered) logits, matching vLLM's default
        # "raw_logprobs" semantics.
        tops = token_logprobs(logits[idx], [sampled[i] for i in rows],
                              [params[i].logprobs or 0 for i in rows])
        for i, d in zip(rows, tops):
            result[i] = d
        return result


def token_logprobs(logits: torch.Tensor, token_ids: list[int], ks: list[int]
                   ) -> list[dict[int, float]]:
    """Per row: {token id: logprob} of the row's top ``ks[row]`` tokens plus ``token_ids[row]``,
    from the log-softmax of raw ``logits`` [N, V]."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    max_k = min(max(ks, default=0), lp.shape[1])
    top_vals_l: list[list[float]] = [[] for _ in ks]
    top_ids_l: list[list[int]] = [[] for _ in ks]
    if max_k > 0:
        top_vals, top_ids = lp.topk(max_k, dim=-1)
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    tok = torch.tensor(token_ids, device=logits.device).unsqueeze(1)
    chosen = lp.gather(1, tok).squeeze(1).tolist()
    out = []
    for j, k in enumerate(ks):
        d = dict(zip(top_ids_l[j][:k], top_vals_l[j][:k]))
        d[token_ids[j]] = chosen[j]
        out.append(d)
    return out


def apply_min_tokens_mask(
    logits: torch.Tensor,
    params: list[SamplingParams],
    num_output_tokens: list[int],
    eos_token_id: EosIds,
) -> torch.Tensor:
    """Ban EOS / stop_token_ids (in place) for rows still below min_tokens.

    Call before ``Sampler.sample``; pairs with ``check_token_stop``, which
    ignores stop tokens in the same window, so a request never ends early.
    """
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        if num_output_tokens[i] >= p.min_tokens:
            continue
        banned = list(p.stop_token_ids or [])
        if not p.ignore_eos:
            banned.extend(eos_ids(eos_token_id))
        banned = [t for t in banned if 0 <= t < vocab]
        if banned:
            logits[i, banned] = float("-inf")
    return logits
