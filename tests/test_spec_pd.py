"""Speculation through P/D (issue 41): the decode engine speculates on requests whose prompt KV
came from a producer (ngram has no proposer state to ship: the drafts are a function of the
tokens; draft_model's draft KV comes from P, or D runs the draft's prefill where none came:
tests/test_spec_draft_pd.py), and the output equals the colocated run
without speculation; a producer with another draft config is refused at handshake."""
from __future__ import annotations

from typing import Any

import pytest

from connectors.hello import hello_mismatch, make_hello
from connectors.pipes.base import HandshakeError
from pd_cluster import SamplingParams
from pd_cluster.checkpoints.truncate import truncate_layers
from tests.conftest import random_prompt
from tests.pd_helpers import colocated_tokens, drain, engine, run_in_process, submit_pair
from tests.spec_helpers import OracleProposer, use_proposer

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
INFO = {"model_id": "m", "dtype": "torch.float32", "block_size": 8, "num_layers": 2,
        "num_kv_heads": 2, "head_dim": 16}


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


def test_draft_model_decode_engine_runs_the_drafts_prefill_and_refuses_a_mismatched_p(
        tiny_model: Any, tmp_path: Any) -> None:
    """D drafts with a 1-layer draft on requests whose target KV came from P (the draft's prefill
    runs on D): output equal to the colocated run without speculation. A P without that draft
    is refused at handshake, naming the speculative config; ngram vs off is no mismatch."""
    model = tiny_model()
    draft = str(truncate_layers(model, tmp_path / "draft", 1))
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    prompts = [random_prompt(n, seed=n) for n in (9, 30)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = colocated_tokens(model, prompts, [params] * len(prompts), block_size=8)
    d = engine(model, "consumer", block_size=8, speculative=spec)
    p = engine(model, "producer", block_size=8, max_num_batched_tokens=16, speculative=spec)
    plain = engine(model, "producer", block_size=8)
    try:
        with pytest.raises(HandshakeError, match="speculative config mismatch: the prefill "
                                                 "engine has no draft model"):
            plain.runner.connector.connect_peer(d.kv_endpoint())
        for i, prompt in enumerate(prompts):
            submit_pair(p, d, f"r{i}", prompt, params, d.kv_endpoint())
        got = run_in_process(p, d)
        drain(p, d)
        assert [got[f"r{i}"] for i in range(len(prompts))] == want
        s = d.stats()
        assert s["kv_fallbacks"] == 0 and s["kv_bytes_received"] > 0
        assert 0 < s["spec_num_accepted_tokens"] <= s["spec_num_draft_tokens"]
        p.check_no_leaks(), d.check_no_leaks()  # both caches on both
    finally:
        p.close(), d.close(), plain.close()
    ngram = make_hello({**INFO, "spec_state": None})
    assert hello_mismatch(make_hello(INFO), ngram) is None
    other = make_hello({**INFO, "spec_state": {"method": "draft_model", "model_id": "x"}})
    assert "drafts with 'draft_model' model 'x'" in hello_mismatch(make_hello(INFO), other)
