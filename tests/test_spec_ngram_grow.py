"""ngram's growing drafts (``num_speculative_tokens_max``, engine/spec/ngram.py): a request whose
drafts were all kept verifies twice as many next step, up to the max, and goes back to
``num_speculative_tokens`` at the first rejected draft; output stays equal to decoding without
speculation, and the engine ends leak-free."""
from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from pd_cluster import LLM, SamplingParams
from pd_cluster.config import SpeculativeConfig
from pd_cluster.engine.spec.ngram import NgramProposer
from pd_cluster.request import Request
from pd_cluster.serving.cluster.model_source import resolve_model


def _repeating_request() -> Request:
    """A decoding request whose text repeats a 12-token unit: its lookup finds many drafts."""
    unit = list(range(10, 22))
    req = Request("r", unit * 4, SamplingParams(max_tokens=500))
    req.output_token_ids, req.num_computed_tokens = [10], 48
    return req


def test_span_doubles_while_all_kept_up_to_the_max_and_resets_on_a_rejection() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=2,
                                               num_speculative_tokens_max=8), 1000)
    req = _repeating_request()
    widths = []
    for accepted in (2, 4, 8, 8, 3, 2):  # all kept x4, then 3 of 8, then all again
        proposer.propose([req])
        widths.append(len(req.spec_token_ids))
        proposer.observe(req, widths[-1], accepted)
    proposer.propose([req])
    widths.append(len(req.spec_token_ids))
    assert widths == [2, 4, 8, 8, 8, 2, 4]
    assert req.spec_token_ids == list(range(11, 15))  # what followed "... 10" before


def test_without_a_max_the_width_stays_k() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=2), 1000)
    req = _repeating_request()
    for _ in range(3):
        proposer.propose([req])
        assert len(req.spec_token_ids) == 2
        proposer.observe(req, 2, 2)


@pytest.mark.parametrize("fields, match", [
    ({"num_speculative_tokens": 4, "num_speculative_tokens_max": 3}, "must be >= num_spec"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens_max": 8}, "only ngram"),
])
def test_config_refuses_a_max_below_k_or_on_another_method(fields: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        SpeculativeConfig(**fields)


def test_grown_drafts_equal_decoding_without_speculation() -> None:
    """The trained tiny-llama on the benchmark's grounded prompt (S, its continuation G, S):
    it copies G, verifies take more than k drafts, and the tokens are the same."""
    model = resolve_model("tiny-llama")
    args = dict(block_size=8, num_kv_blocks=96, max_model_len=256, compile=False)  # fast
    base = LLM(model=model, **args)
    spec = LLM(model=model, **args, speculative={
        "method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_max": 8})
    rng = random.Random(7)
    seeds = [[rng.randrange(4, base.engine.vocab_size) for _ in range(24)] for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    conts = base.generate(seeds, params)
    prompts = [s + list(c.outputs[0].token_ids) + s for s, c in zip(seeds, conts)]
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == want
    per_pos = spec.engine.stats()["spec_accepted_per_pos"]
    assert len(per_pos) == 8 and per_pos[2] > 0  # a third draft kept: a verify wider than k
    base.engine.check_no_leaks()
    spec.engine.check_no_leaks()
