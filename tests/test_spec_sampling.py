"""Speculation's rejection sampler keeps the target distribution (issue 41), measured on a
small vocabulary against the exact probabilities, as vLLM's rejection-sampler tests do; and the
ngram proposer's lookup."""
from __future__ import annotations

import numpy as np
import torch

from pd_cluster.engine.sampler import Sampler
from pd_cluster.engine.spec.ngram import find_drafts
from pd_cluster.engine.spec.rejection import accept_or_resample, target_probs
from pd_cluster.engine.spec.verify import verify
from pd_cluster.request import Request
from pd_cluster.sampling_params import SamplingParams

TRIALS = 20000
TOL = 0.02  # > 5 standard deviations of a frequency measured over TRIALS draws


def _freq(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def test_point_mass_draft_keeps_the_target_distribution() -> None:
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    g = torch.Generator().manual_seed(1)
    for draft in (1, 4):  # a likely draft and an unlikely one
        tokens = [accept_or_resample(p, draft, g)[0] for _ in range(TRIALS)]
        assert torch.allclose(_freq(tokens, 5), p.double(), atol=TOL)


def test_draft_distribution_keeps_the_target_distribution() -> None:
    """A proposer with its own distribution q (a draft model): d ~ q, accepted with
    min(1, p/q), else drawn from norm(max(0, p - q))."""
    p = torch.tensor([0.1, 0.5, 0.1, 0.3])
    q = torch.tensor([0.4, 0.1, 0.4, 0.1])
    g = torch.Generator().manual_seed(2)
    drafts = torch.multinomial(q, TRIALS, replacement=True, generator=g).tolist()
    tokens = [accept_or_resample(p, d, g, q)[0] for d in drafts]
    assert torch.allclose(_freq(tokens, 4), p.double(), atol=TOL)


def test_target_probs_follow_temperature_top_k_and_top_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.9)
    probs = target_probs(logits, params)[0]
    scaled = torch.softmax(logits[0, :3] / 0.5, dim=-1)  # top-3; top-p 0.9 keeps 2 of them
    keep = torch.softmax(logits[0, :2] / 0.5, dim=-1)
    assert scaled[:2].sum() >= 0.9 > scaled[0]
    assert torch.allclose(probs, torch.cat([keep, torch.zeros(3)]))


def test_verify_sequences_have_the_target_distribution() -> None:
    """Through verify() (what the engine runs): two drafts, sampling with top-k; the first kept
    token has row 0's distribution, and the second, after the first draft was kept, row 1's."""
    vocab = 6
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4, max_tokens=10)
    want = target_probs(logits, params).double()
    sampler = Sampler(seed=4)
    drafts = [int(want[0].argmax()), int(want[1].argmin())]  # likely, then impossible (top-k)
    first, second = [], []
    for _ in range(TRIALS // 4):
        req = Request("r", [1, 2], params)
        v = verify(logits.clone(), [req], [drafts], sampler)[0]
        kept = v.accepted + [v.token]
        first.append(kept[0])
        if kept[0] == drafts[0]:
            second.append(kept[1])
            assert len(kept) == 2  # the second draft has p = 0: never kept
    assert torch.allclose(_freq(first, vocab), want[0], atol=2 * TOL)
    assert torch.allclose(_freq(second, vocab), want[1], atol=2 * TOL)


def test_seeded_verification_is_reproducible() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=10)

    def run() -> list[int]:
        v = verify(logits.clone(), [Request("r", [1], params)], [[3, 4, 5]], Sampler(seed=None))
        return v[0].accepted + [v[0].token]
    assert len({tuple(run()) for _ in range(5)}) == 1


def test_greedy_verify_keeps_the_argmax_prefix() -> None:
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([3, 5, 7, 9]):
        logits[row, tok] = 1.0
    req = Request("r", [1], SamplingParams(temperature=0, max_tokens=10))
    v = verify(logits, [req], [[3, 5, 8]], Sampler(seed=0))[0]
    assert (v.accepted, v.token) == ([3, 5], 7)  # 8 is not row 2's argmax: 7 replaces it


def test_ngram_lookup_takes_the_longest_latest_match() -> None:
    t = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 1, 2, 3, 4])
    # suffix 1 2 3 4 (n=4) matches at 0 -> 5 9 2; n=3 would match later (2 3 4 -> 6 7 1)
    assert find_drafts(t, 2, 4, 3) == [5, 9, 2]
    assert find_drafts(t, 2, 3, 3) == [6, 7, 1]
    assert find_drafts(np.array([1, 2, 3, 4]), 2, 4, 3) == []  # no earlier occurrence
    assert find_drafts(np.array([7, 7, 7]), 1, 2, 5) == [7]  # only what follows exists


def test_ngram_backs_off_after_misses_and_longer_when_most_drafts_fail() -> None:
    from pd_cluster.config import SpeculativeConfig
    from pd_cluster.engine.spec.ngram import NgramProposer
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3), max_model_len=100)
    req = Request("r", [5, 6, 7, 5, 6], SamplingParams(max_tokens=20))
    req.output_token_ids, req.num_computed_tokens = [7], 5  # decoding
    proposer.propose([req])
    assert req.spec_token_ids == [5, 6, 7]  # "5 6 7" follows the earlier "6 7"
    proposer.observe(req, 3, 0)  # a miss: one step off (the recent rate is still high)
    assert req.spec_state.cooldown == 1
    proposer.propose([req])
    assert req.spec_token_ids == []
    for _ in range(10):
        proposer.observe(req, 3, 0)  # most drafts fail: backing off is 8x longer
    assert proposer.rate < 0.2 and req.spec_state.cooldown == 8 * 32
    proposer.observe(req, 3, 2)
    assert req.spec_state.misses == 0
