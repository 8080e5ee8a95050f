"""Speculation's cost at batch (issue 41): the verify decides a batch of requests in one pass and
gives each request what verifying it alone gives (greedy, seeded sampling, top-k/top-p per row,
logprobs, drafts of different lengths); a seeded request keeps the sampler's own draws whatever
was proposed; the ngram lookup is skipped exactly when it could find nothing; a draft model
whose drafts keep failing backs off and probes again later; drafts past the first are proposed
only while the measured step cost says they pay, and none at a batch size where even one does
not (the engine then proposes on one step in 8 only)."""
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
            state = _State()
            req = Request("r", [rng.randrange(5)], SamplingParams(max_tokens=500))
            for _ in range(40):
                req.output_token_ids += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
                arr = np.array(req.all_token_ids)
                assert proposer._seen_before(req, state) == bool(find_drafts(arr, lo, hi, 3))


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


def test_step_cost_window_drops_old_steps() -> None:
    from pd_cluster.engine.spec.step_cost import StepCost
    cost = StepCost()
    for i in range(200):  # an old regime, then 64 steps of another: only the last count
        tokens = 16 + (i * 7) % 40
        cost.record(tokens, (5e-3 + 1e-4 * tokens) if i < 136 else (1e-3 + 3e-5 * tokens))
    overhead, per_token = cost.fit()
    assert abs(overhead - 1e-3) < 1e-9 and abs(per_token - 3e-5) < 1e-10


def _paying_little() -> Any:
    """A backoff whose fit makes a token cost about half a step's share at batch 16
    (1 ms a step, 60 us a token: threshold 0.49 at 16, 0.057 at 1)."""
    from pd_cluster.engine.spec.backoff import Backoff
    backoff = Backoff()
    for tokens in (16, 80, 32, 64, 16, 48, 80, 20, 16, 70):
        backoff.cost.record(tokens, 1e-3 + 6e-5 * tokens)
    return backoff


def test_a_verify_that_keeps_too_little_for_this_batch_size_backs_off() -> None:
    backoff = _paying_little()
    state = _State(kept=0.5, lost=2.0)
    backoff.batch = 16
    backoff.observe(state, 2, 1)  # kept one, but ~30% does not repay a draft at batch 16
    assert state.misses == 1 and state.cooldown >= 1
    state = _State(kept=0.5, lost=2.0)
    backoff.batch = 1
    backoff.observe(state, 2, 1)  # at batch 1 the same acceptance pays
    assert state.misses == 0 and state.cooldown == 0


def test_engine_proposes_one_step_in_8_while_drafts_do_not_pay_at_its_batch_size() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3), max_model_len=1000)
    proposer.backoff = _paying_little()
    proposer.backoff.rate = 0.3  # below batch 16's threshold, above batch 1's
    proposer.backoff.proposed = lambda seconds, drafts: None  # the gate from the fit alone
    reqs = []
    for i in range(16):
        req = Request(f"r{i}", [5, 6, 7, 5, 6], SamplingParams(max_tokens=500))
        req.output_token_ids, req.num_computed_tokens = [7], 5  # "6 7" occurred: drafts
        reqs.append(req)
    proposed, probed = [], []
    for _ in range(64):
        proposer.propose(reqs)
        proposed.append(sum(bool(r.spec_token_ids) for r in reqs))
        probed += [r.request_id for r in reqs if r.spec_token_ids]
        for r in reqs:
            if r.spec_state is not None:
                r.spec_state.cooldown = 0  # each request alone would propose every step
    # One step in 8 probes, and only 2 of the 16 (a lookup over the whole batch cost more
    # than its failing drafts gave): in turn, so 8 probes cover every request once.
    assert proposed == ([0] * 7 + [2]) * 8
    assert sorted(probed) == sorted(r.request_id for r in reqs)
    proposer.propose(reqs[:1])  # batch 1: the same rate pays, proposing at once
    assert reqs[0].spec_token_ids[:1] == [5]


def test_the_gate_charges_each_draft_what_proposing_it_cost() -> None:
    backoff = _paying_little()  # 1 ms a step, 60 us a token
    assert abs(backoff.gate(16) - 0.96 / 1.96) < 1e-6
    backoff.proposed(2e-4, 0)  # a pass that made no draft: its time waits for the next
    for _ in range(200):
        backoff.proposed(2e-4, 4)  # 50 us of lookup per draft made, and the carried 200 us
    assert abs(backoff.propose_cost - 5e-5) < 1e-7
    # A kept draft now repays 60 + 50 us at batch 16: (110e-6 * 16) / 1.96e-3.
    assert abs(backoff.gate(16) - 1.76 / 1.96) < 1e-3
    assert backoff.width(_State(kept=40.0, lost=1.0), 4, 16) == 4  # the width: tokens only
