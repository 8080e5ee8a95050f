"""Speculation is lossless in every served family (issue 41): greedy output with drafts kept and
rejected (tests/spec_helpers.py's proposer) equals the output without speculation, through
chunked prefill and windows that end mid-block, with a leak check."""
from __future__ import annotations

import pytest

from pd_cluster import LLM, SamplingParams
from tests.conftest import random_prompt
from tests.spec_helpers import OracleProposer, outputs, use_proposer
from tests.test_families import FAMILIES, family_model  # noqa: F401 (the fixture)


@pytest.mark.parametrize("name", FAMILIES + ["tiny-deepseek-v3"])
def test_greedy_equal_with_and_without_speculation(family_model, name: str) -> None:  # noqa: F811
    model_dir = family_model(name)
    args = dict(block_size=8, max_num_batched_tokens=12, num_kv_blocks=64, compile=False)
    prompts = [random_prompt(n, seed=n) for n in (3, 26)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = outputs(LLM(model=model_dir, **args), prompts, params)
    spec = LLM(model=model_dir, speculative={"method": "ngram", "num_speculative_tokens": 3},
               **args)
    use_proposer(spec.engine, OracleProposer({tuple(p): list(w.token_ids)
                                              for p, w in zip(prompts, want)}, k=3))
    got = outputs(spec, prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    s = spec.engine.stats()
    assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]
    spec.engine.check_no_leaks()


def test_tp2_greedy_equal_with_speculation(tiny_model) -> None:
    """Tensor parallel: the drafts travel in the step's tokens, every rank computes the verify
    rows, rank 0 decides."""
    model = tiny_model()
    prompts = [random_prompt(n, seed=n) for n in (4, 21)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = outputs(LLM(model=model, block_size=8, num_kv_blocks=64), prompts, params)
    spec = LLM(model=model, tensor_parallel_size=2, block_size=8, num_kv_blocks=64,
               collective_timeout=20.0, speculative={"method": "ngram"})
    try:
        use_proposer(spec.engine, OracleProposer({tuple(p): list(w.token_ids)
                                                  for p, w in zip(prompts, want)}))
        got = outputs(spec, prompts, params)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert spec.engine.stats()["spec_num_accepted_tokens"] > 0
        spec.engine.check_no_leaks()
    finally:
        spec.close()
