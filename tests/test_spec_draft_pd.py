"""The draft model's KV through P/D (issue 41): a prefill engine with the same draft_model runs
the draft's prefill too and ships its KV after the target's (connectors/draft_layers.py,
pd_cluster/engine/spec/draft_pd.py); the decode engine then never runs the draft's prefill.
With the target as its own draft every proposal is kept only if the shipped draft KV is right;
greedy output equals the colocated run without speculation; a prefix hit on D's target blocks
still gets the draft's KV; a request moved mid-speculation continues exactly; a P without the
draft ships none and D runs the draft's prefill; both pools leak-free at the end."""
from __future__ import annotations

from typing import Any

import pytest

from connectors.pipes.base import HandshakeError
from pd_cluster import SamplingParams
from pd_cluster.checkpoints.truncate import truncate_layers
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from tests.conftest import random_prompt
from tests.pd_helpers import (colocated_tokens, drain, engine, kv_config, run_in_process,
                              submit_pair)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _spec(draft: str) -> dict[str, Any]:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def model(tiny_model: Any) -> str:
    return tiny_model()


@pytest.fixture(scope="module")
def pair(model: str) -> Any:
    """(P, D), both drafting with the target itself; P prefills in chunks of 16."""
    d = engine(model, "consumer", block_size=8, speculative=_spec(model))
    p = engine(model, "producer", block_size=8, max_num_batched_tokens=16,
               speculative=_spec(model))
    p.connect_kv_peer(d.kv_endpoint())
    yield p, d
    p.close(), d.close()


def _stat(e: Any, key: str) -> int:
    return e.stats().get(key, 0)



def _one_by_one(p: Any, d: Any, prompts: list[list[int]], tag: str) -> list[list[int]]:
    """Each prompt through the pair after the one before finished (so a later one can hit
    what the earlier left in D's prefix cache); D's tokens in prompt order."""
    got: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        submit_pair(p, d, f"{tag}{i}", prompt, GREEDY, d.kv_endpoint())
        got.update(run_in_process(p, d))
    drain(p, d)
    return [got[f"{tag}{i}"] for i in range(len(prompts))]

def test_p_ships_the_drafts_kv_and_d_runs_no_draft_prefill(model: str, pair: Any) -> None:
    p, d = pair
    shared = random_prompt(24, seed=1)
    prompts = [shared + random_prompt(9, seed=2), random_prompt(30, seed=3),
               shared + random_prompt(5, seed=4)]  # the last hits D's cache (24 tokens)
    want = colocated_tokens(model, prompts, [GREEDY] * 3, block_size=8)
    got: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):  # one at a time: the first is cached on D for the last
        submit_pair(p, d, f"a{i}", prompt, GREEDY, d.kv_endpoint())
        got.update(run_in_process(p, d))
    drain(p, d)
    assert [got[f"a{i}"] for i in range(3)] == want
    s, sp = d.stats(), p.stats()
    assert s["kv_fallbacks"] == 0 and s["kv_prefix_hit_tokens"] >= 24
    assert s["spec_draft_prefill_tokens"] == 0  # D ran no draft prefill
    assert sp["spec_draft_prefill_tokens"] == sum(map(len, prompts))  # P ran it, prompt by prompt
    assert 0 < sp["kv_draft_bytes_sent"] == s["kv_draft_bytes_received"]
    assert sp["kv_bytes_sent"] - sp["kv_draft_bytes_sent"] > 0
    # The draft is the target: every proposal is kept only if the draft KV that came is right.
    assert 0 < s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"]
    p.check_no_leaks(), d.check_no_leaks()  # target and draft pools, both engines


def test_shm_pipe_writes_the_drafts_kv_into_blocks_d_granted(model: str) -> None:
    """The shm pipe writes in place: D's shared cache holds the draft's layers too and its
    HOLD grants the draft's blocks (all of them, a prefix hit on the target's included)."""
    def shm(role: str, **args: Any) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model, block_size=8, speculative=_spec(model),
                                      kv_transfer=kv_config(role, pipe="shm"), **args))
    d = shm("consumer")
    p = shm("producer", max_num_batched_tokens=16)
    try:
        shared = random_prompt(16, seed=5)
        prompts = [shared + random_prompt(11, seed=6), shared + random_prompt(4, seed=8)]
        want = colocated_tokens(model, prompts, [GREEDY] * 2, block_size=8)
        assert _one_by_one(p, d, prompts, "s") == want
        s, sp = d.stats(), p.stats()
        assert s["kv_fallbacks"] == 0 and s["kv_prefix_hit_tokens"] >= 16
        assert s["spec_draft_prefill_tokens"] == 0
        assert 0 < sp["kv_draft_bytes_sent"] == s["kv_draft_bytes_received"]
        assert 0 < s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"]
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()


def test_request_moved_mid_speculation_continues_exactly(model: str, pair: Any) -> None:
    """D decodes a few tokens (its draft KV from P), the request is ended there and resumed on
    P (a draft_model engine, prompt and output recomputed): the same tokens."""
    p, d = pair
    prompt = random_prompt(21, seed=7)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = colocated_tokens(model, [prompt], [params], block_size=8)[0]
    submit_pair(p, d, "m", prompt, params, d.kv_endpoint())
    tokens: list[int] = []
    for _ in range(400):  # bounded: a step at a time until D made 5 tokens
        p.step()
        for out in d.step():
            tokens = list(out.outputs[0].token_ids)
        if len(tokens) >= 5:
            break
    assert 5 <= len(tokens) < len(want)
    d.abort_request(["m"])
    drain(p, d)
    p.add_request("m2", prompt, params, resume_token_ids=tokens)
    rest: list[int] = []
    while p.has_unfinished_requests():
        for out in p.step():
            rest += out.outputs[0].delta_token_ids
    assert tokens + rest == want
    p.check_no_leaks(), d.check_no_leaks()


def test_without_the_draft_on_p_d_runs_the_draft_prefill_and_a_mismatch_is_refused(
        model: str, pair: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A P drafting with another model is refused at handshake; a P that ships no draft KV
    (here: the shipping turned off on P) leaves D to run the draft's prefill, output equal."""
    p, d = pair
    other = engine(model, "producer", block_size=8,
                   speculative=_spec(str(truncate_layers(model, tmp_path / "d1", 1))))
    try:
        with pytest.raises(HandshakeError, match="speculative config mismatch"):
            other.connect_kv_peer(d.kv_endpoint())
    finally:
        other.close()
    prompt = random_prompt(19, seed=11)
    want = colocated_tokens(model, [prompt], [GREEDY], block_size=8)
    before = _stat(d, "spec_draft_prefill_tokens")
    monkeypatch.setattr(p.draft_pd.worker, "ships_draft_to", lambda peer: False)
    submit_pair(p, d, "n", prompt, GREEDY, d.kv_endpoint())
    got = run_in_process(p, d)
    drain(p, d)
    assert got["n"] == want[0]
    assert _stat(d, "spec_draft_prefill_tokens") - before == len(prompt)
    p.check_no_leaks(), d.check_no_leaks()


@pytest.mark.parametrize("pipe", [None, "shm"])
def test_windowed_target_ships_its_window_and_the_drafts_layers_after_it(
        tmp_path: Any, pipe: str | None) -> None:
    """A sliding-window target (window 24, prompts past it): its layers ship only the window,
    the draft's layers (indices past the target's) every block, into the draft's own table on
    D, never a target layer's (issue 43 beside 41); greedy output equals the colocated run
    without speculation."""
    from pd_cluster.checkpoints.maker import PRESETS, make_model
    windowed = str(make_model(tmp_path / "w", **PRESETS["tiny-mistral-window"]))
    d = engine(windowed, "consumer", pipe=pipe, block_size=8, speculative=_spec(windowed))
    p = engine(windowed, "producer", pipe=pipe, block_size=8, max_num_batched_tokens=16,
               speculative=_spec(windowed))
    try:
        prompts = [random_prompt(45, seed=21), random_prompt(37, seed=22)]
        want = colocated_tokens(windowed, prompts, [GREEDY] * 2, block_size=8)
        assert _one_by_one(p, d, prompts, "w") == want
        s, sp = d.stats(), p.stats()
        assert s["kv_fallbacks"] == 0 and s["spec_draft_prefill_tokens"] == 0
        assert 0 < sp["kv_draft_bytes_sent"] == s["kv_draft_bytes_received"]
        assert 0 < s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"]
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()
