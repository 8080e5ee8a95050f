"""Speculation through P/D (issue 41): the decode engine speculates on requests whose prompt KV
came from a producer (ngram has no proposer state to ship: the drafts are a function of the
tokens), and the output equals the colocated run without speculation."""
from __future__ import annotations

from typing import Any

from pd_cluster import SamplingParams
from tests.conftest import random_prompt
from tests.pd_helpers import colocated_tokens, drain, engine, run_in_process, submit_pair
from tests.spec_helpers import OracleProposer, use_proposer

SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def test_decode_engine_speculates_on_requests_that_arrived_by_kv_transfer(tiny_model: Any) -> None:
    model = tiny_model()
    prompts = [random_prompt(n, seed=n) for n in (9, 30, 17)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = colocated_tokens(model, prompts, [params] * len(prompts), block_size=8)
    d = engine(model, "consumer", block_size=8, speculative=SPEC)
    p = engine(model, "producer", block_size=8, max_num_batched_tokens=16, speculative=SPEC)
    try:
        use_proposer(d, OracleProposer({tuple(pr): w for pr, w in zip(prompts, want)}, k=3))
        for i, prompt in enumerate(prompts):
            submit_pair(p, d, f"r{i}", prompt, params, d.kv_endpoint())
        got = run_in_process(p, d)
        drain(p, d)
        assert [got[f"r{i}"] for i in range(len(prompts))] == want
        s = d.stats()
        assert s["kv_fallbacks"] == 0 and s["kv_bytes_received"] > 0
        assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]
        assert p.stats()["spec_num_drafts"] == 0  # P samples one token: nothing to verify
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()
