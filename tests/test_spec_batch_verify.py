"""Speculation's cost at batch (issue 41): the verify decides a batch of requests in one pass and
gives each request what verifying it alone gives (greedy, seeded sampling, top-k/top-p per row,
logprobs, drafts of different lengths); a seeded request keeps the sampler's own draws whatever
was proposed; the ngram lookup is skipped exactly when it could find nothing; a draft model
whose drafts keep failing backs off and probes again later; drafts past the first are proposed
only while the measured step cost says they pay."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from pd_cluster.config import SpeculativeConfig
from pd_cluster.engine.sampler import Sampler
from pd_cluster.engine.spec.draft_model import DraftModelProposer
from pd_cluster.engine.spec.ngram import NgramProposer, _State, find_drafts
from pd_cluster.engine.spec.verify import verify
from pd_cluster.request import Request
from pd_cluster.sampling_params import SamplingParams

VOCAB = 40


def _requests() -> tuple[list[Request], list[list[int]]]:
    params = [SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=0, max_tokens=20, logprobs=2),
              SamplingParams(temperature=0.8, seed=3, max_tokens=20),
              SamplingParams(temperature=1.2, top_k=5, top_p=0.8, seed=4, max_tokens=20,
                             logprobs=1),
              SamplingParams(temperature=0, max_tokens=20)]
    reqs = [Request(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params)]
    for i, r in enumerate(reqs):
        r.output_token_ids = [5] * i  # different token indices: different seeded draws
    drafts = [[3, 7, 1], [9], [2, 4, 6, 8], [1, 1], [0, 5]]
    return reqs, drafts


def test_batched_verify_equals_each_request_verified_alone() -> None:
    reqs, drafts = _requests()
    logits = torch.randn(sum(len(d) + 1 for d in drafts), VOCAB,
                         generator=torch.Generator().manual_seed(0)) * 3
    # Greedy drafts that are the argmax for a while, so some are accepted.
    at = 0
    for d in drafts:
        for j in range(len(d)):
            if j < 2:
                logits[at + j, d[j]] = 50.0
        at += len(d) + 1
    batch = verify(logits.clone(), reqs, drafts, Sampler(seed=0))
    alone, at = [], 0
    for r, d in zip(reqs, drafts):
        alone += verify(logits[at:at + len(d) + 1].clone(), [r], [d], Sampler(seed=0))
        at += len(d) + 1
    assert [(v.accepted, v.token) for v in batch] == [(v.accepted, v.token) for v in alone]
    assert batch[0].accepted == [3, 7]  # row 2 has no forced argmax: 1 is rejected
    for b, a in zip(batch, alone):
        assert len(b.logprobs) == len(b.accepted) + 1
        for lb, la in zip(b.logprobs, a.logprobs):
            assert (lb is None) == (la is None)
            if lb is not None:
                assert lb.keys() == la.keys()
                assert all(abs(lb[t] - la[t]) < 1e-5 for t in lb)


def test_seeded_kept_tokens_are_the_samplers_own_draws_whatever_the_drafts() -> None:
    """Each kept token is what the sampler draws for that output index without speculation
    (seeded), so seeded output does not depend on what was proposed (a backoff or a timing
    that changes the drafts cannot change it)."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=9, max_tokens=20)
    req = Request("r", [1, 2], params)
    req.output_token_ids = [4, 4]
    alone = [Sampler().sample(logits[j:j + 1], [params],
                              [req.generator_for_token(logits.device, 2 + j)]).token_ids[0]
             for j in range(4)]
    for drafts in (alone[:3], [alone[0], (alone[1] + 1) % VOCAB, alone[2]],
                   [(alone[0] + 1) % VOCAB] * 3):
        v = verify(logits.clone(), [req], [drafts], Sampler())[0]
        kept = v.accepted + [v.token]
        assert kept == alone[:len(kept)]
        assert len(v.accepted) == next((j for j, d in enumerate(drafts) if d != alone[j]), 3)


def test_ngram_lookup_skipped_exactly_when_it_finds_nothing() -> None:
    rng = random.Random(1)
    for lo, hi in [(1, 3), (2, 5), (3, 3)]:
        config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=lo,
                                   prompt_lookup_max=hi)
        proposer = NgramProposer(config, max_model_len=10_000)
        for _ in range(30):
            state, tokens = _State(), []
            for _ in range(40):
                tokens += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
                arr = np.array(tokens)
                assert proposer._seen_before(arr, state) == bool(find_drafts(arr, lo, hi, 3))


class _Runner:
    """A draft runner whose drafts are always token 0 (the request's tokens never are)."""
    num_blocks, block_size = 64, 8

    def __init__(self) -> None:
        self.free = list(range(self.num_blocks))
        self.forwards = 0

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        while len(blocks) * self.block_size < num_tokens:
            blocks.append(self.free.pop())
        return True

    def release(self, blocks: list[int]) -> None:
        self.free += blocks
        blocks.clear()

    def next_tokens(self, chunks: list[Any]) -> list[int]:
        self.forwards += 1
        return [0] * len(chunks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)


def test_draft_model_backs_off_while_its_drafts_fail_and_probes_again() -> None:
    runner = _Runner()
    proposer = DraftModelProposer(SpeculativeConfig(method="draft_model", model="x",
                                                    num_speculative_tokens=2), runner, 1000)
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=500))
    req.output_token_ids, req.num_computed_tokens = [8], 3
    proposed = []
    for step in range(40):
        proposer.propose([req])
        proposed.append(bool(req.spec_token_ids))
        if req.spec_token_ids:
            proposer.observe(req, len(req.spec_token_ids), 0)
        req.output_token_ids.append(9 + step)
        req.num_computed_tokens += 1
    # Probes after 1, 2, 4, 8 ... skipped steps (the rate falls below 20%: then 8x longer).
    assert proposed[:4] == [True, False, True, False]
    assert 3 <= sum(proposed) <= 6
    assert runner.forwards == 2 * sum(proposed)  # a resting request costs no draft forward
    proposer.release(["r"])
    proposer.check_no_leaks()


def test_step_cost_fit_and_the_drafts_it_pays_for() -> None:
    from pd_cluster.engine.spec.backoff import Backoff
    backoff = Backoff()
    low, high = _State(kept=0.5, lost=4.0), _State(kept=40.0, lost=1.0)
    assert backoff.width(low, 4, 16) == 4  # nothing measured yet: every draft
    for tokens in (16, 80, 32, 64, 16, 48, 80, 20, 16, 70):
        backoff.cost.record(tokens, 1e-3 + 3e-5 * tokens)  # 1 ms a step, 30 us a token
    overhead, per_token = backoff.cost.fit()
    assert abs(overhead - 1e-3) < 1e-9 and abs(per_token - 3e-5) < 1e-10
    assert abs(backoff.cost.threshold(16) - 0.48 / 1.48) < 1e-6
    assert backoff.width(low, 4, 16) == 1  # unlikely drafts past the first cost more
    assert backoff.width(high, 4, 16) == 4  # likely ones pay
    assert backoff.width(low, 4, 1) == 2  # at batch 1 a token costs 3% of a step: a^2 pays
