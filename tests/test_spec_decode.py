"""Speculative decoding in the engine (issue 41): drafts verified k at a time are lossless at
token granularity. A proposer that knows the answer (tests/spec_helpers.py) makes drafts kept
and rejected on random-weight models; the engine must produce exactly what it produces without
speculation (tokens, logprobs, stop strings, min_tokens, penalties, grammars), through chunked
prefill and preemption, the compiled step, and a migration; every test ends leak-free."""
from __future__ import annotations

from typing import Any

import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.serving.cluster.model_source import resolve_model
from pd_cluster.structured_outputs import StructuredOutputsParams
from tests.conftest import random_prompt
from tests.spec_helpers import OracleProposer, outputs, use_proposer

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
PROMPTS = [random_prompt(n, seed=n) for n in (5, 19, 40, 33)]


@pytest.fixture(scope="module")
def pair(tiny_model: Any) -> tuple[LLM, LLM]:
    """(no speculation, speculation), compiled: the second short of blocks (4 requests of ~70 tokens
    in 14 blocks of 8: preemptions) and of step budget (prompts chunked by 16)."""
    model = tiny_model()
    # Both compiled (the CPU default): the verify step runs through the one dynamic graph.
    return (LLM(model=model, block_size=8, num_kv_blocks=128, compile=True),
            LLM(model=model, block_size=8, num_kv_blocks=14, max_num_batched_tokens=16,
                speculative=SPEC, compile=True))


def _run_both(pair: tuple[LLM, LLM], params: SamplingParams, prompts: list[list[int]] = PROMPTS,
              **oracle: Any) -> tuple[list[Any], list[Any], OracleProposer]:
    base, spec = pair
    want = outputs(base, prompts, params)
    proposer = OracleProposer({tuple(p): list(o.token_ids) for p, o in zip(prompts, want)},
                              **oracle)
    use_proposer(spec.engine, proposer)
    got = outputs(spec, prompts, params)
    base.engine.check_no_leaks()
    spec.engine.check_no_leaks()
    return want, got, proposer


def test_greedy_tokens_and_logprobs_equal_through_preemption_and_chunks(pair) -> None:
    before = dict(pair[1].engine.stats())
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    want, got, _ = _run_both(pair, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for w, g in zip(want, got):
        for lw, lg in zip(w.logprobs, g.logprobs):
            assert lw.keys() == lg.keys()
            assert all(abs(lw[t] - lg[t]) < 1e-4 for t in lw)
    s = pair[1].engine.stats()
    accepted = s["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    drafted = s["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    assert 0 < accepted < drafted  # drafts kept and rejected
    assert s["num_preemptions"] > before["num_preemptions"]
    assert s["spec_accepted_per_pos"][0] >= s["spec_accepted_per_pos"][-1] > 0


def test_min_tokens_and_penalties_apply_per_draft_position(pair) -> None:
    """A stop token boosted by logit_bias ends each request right after min_tokens; the wrong
    drafts propose it early, where its row bans it (row j counts j more output tokens)."""
    stop = 77
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=12, stop_token_ids=[stop],
                            logit_bias={stop: 30.0}, repetition_penalty=1.4,
                            frequency_penalty=0.3, presence_penalty=0.2)
    want, got, _ = _run_both(pair, params, wrong_every=1, wrong=lambda t: stop)
    assert [len(o.token_ids) for o in want] == [13] * len(PROMPTS)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == ["stop"] * len(PROMPTS)


def test_stop_strings_and_max_tokens_cut_as_without_speculation(pair) -> None:
    plain = outputs(pair[0], PROMPTS[:2], SamplingParams(temperature=0, max_tokens=30,
                                                         ignore_eos=True))
    stop = [plain[0].text[20:23], plain[1].text[25:27]]
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, stop=stop)
    want, got, _ = _run_both(pair, params, prompts=PROMPTS[:2])
    for w, g in zip(want, got):
        assert (g.text, g.token_ids, g.finish_reason, g.stop_reason) == \
            (w.text, w.token_ids, w.finish_reason, w.stop_reason)
    assert {w.finish_reason for w in want} == {"stop"}


def test_seeded_sampling_is_reproducible(pair) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
    want, first, proposer = _run_both(pair, params, prompts=PROMPTS[:2])
    # Each kept token is the sampler's own seeded draw: the same as without speculation.
    assert [o.token_ids for o in first] == [o.token_ids for o in want]
    again = outputs(pair[1], PROMPTS[:2], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert proposer.proposals > 0
    pair[1].engine.check_no_leaks()


def test_ngram_greedy_equal_on_repeating_text(pair) -> None:
    """The real proposer: a prompt that repeats, so its lookups find drafts."""
    base, spec = pair
    from pd_cluster.engine.spec.ngram import NgramProposer
    use_proposer(spec.engine, NgramProposer(spec.engine.config.speculative,
                                            spec.engine.max_model_len))
    unit = random_prompt(12, seed=3)
    prompts = [unit * 4, random_prompt(20, seed=9) + unit * 2]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    before = spec.engine.stats()["spec_num_drafts"]
    want = outputs(base, prompts, params)
    got = outputs(spec, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.engine.stats()["spec_num_drafts"] >= before
    spec.engine.check_no_leaks()


def test_migration_mid_speculation_continues_exactly(pair) -> None:
    """A request cut after 9 tokens resumes on a speculating engine: same tokens."""
    base, spec = pair
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompt = PROMPTS[2]
    full = outputs(base, [prompt], params)[0].token_ids
    use_proposer(spec.engine, OracleProposer({tuple(prompt): list(full)}))
    engine = spec.engine
    engine.add_request("moved", prompt, params, resume_token_ids=list(full[:9]))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.outputs[0].delta_token_ids
    assert list(full[:9]) + tokens == list(full)
    engine.check_no_leaks()


def test_grammar_sees_only_accepted_drafts() -> None:
    """Drafts the grammar bans (a letter where it wants digits) are rejected before its matcher
    sees them: the request completes under its grammar, equal to the run without drafts."""
    model = resolve_model("tiny-llama")
    base = LLM(model=model, num_kv_blocks=64, max_model_len=256)
    spec = LLM(model=model, num_kv_blocks=64, max_model_len=256, speculative=SPEC)
    letter = base.get_tokenizer().encode("x")[0]
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(
        regex=r"[0-9]{3}-[0-9]{4}"))
    prompts = [base.get_tokenizer().encode("Call me at")]
    want, got, proposer = _run_both((base, spec), params, prompts=prompts, wrong_every=2,
                                    wrong=lambda t: letter)
    assert [o.text for o in got] == [o.text for o in want]
    assert got[0].token_ids == want[0].token_ids and got[0].error is None
    assert spec.engine.stats()["grammar_failures"] == 0 and proposer.proposals > 0
    s = spec.engine.stats()
    assert s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]
