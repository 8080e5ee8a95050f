"""The engine side of structured outputs: a resumed request (migration) replays its tokens into
a fresh matcher and continues exactly; requests wait for their grammar, the batch does not;
abort while compiling leaves nothing; the params cross msgpack as they are."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from pd_cluster import LLM, SamplingParams
from pd_cluster.driver.messages import EngineRequest, decode_request, encode
from pd_cluster.serving.cluster.cluster_config import resolve_model
from pd_cluster.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "words": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["words", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    with LLM(model=resolve_model("tiny-llama"), num_kv_blocks=128, max_model_len=512,
             structured_outputs={"disable_any_whitespace": True}) as engine:
        yield engine


def _params(seed: int | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=150,
                          structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)),
                          **kw)


def _run(llm: LLM, rid: str, ids: list[int], params: SamplingParams, **kw) -> list[int]:
    engine = llm.engine
    engine.add_request(rid, ids, params, **kw)
    for _ in range(1000):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return list(out.outputs[0].token_ids)
    raise AssertionError("request did not finish")


@pytest.mark.parametrize("seed", [None, 5])
def test_resume_replays_tokens_into_a_fresh_matcher(llm, seed) -> None:
    ids = llm.get_tokenizer().encode("Once upon a time")
    whole = _run(llm, "whole", ids, _params(seed))
    jsonschema.validate(json.loads(llm.get_tokenizer().decode(whole[:-1])), SCHEMA)
    for cut in (1, len(whole) // 2, len(whole) - 2):
        text = llm.get_tokenizer().decode(whole[:cut])
        resumed = _run(llm, f"resumed-{cut}", ids, _params(seed), resume_token_ids=whole[:cut],
                       resume_text_len=len(text))
        assert resumed == whole, cut
    llm.engine.check_no_leaks()


def test_compiling_request_does_not_hold_the_batch(llm) -> None:
    engine = llm.engine
    gate = threading.Event()
    real = engine.grammars._compile
    engine.grammars._compile = lambda *a: (gate.wait(30), real(*a))[1]
    try:
        ids = llm.get_tokenizer().encode("Hello")
        so = StructuredOutputsParams(regex=r"[a-z]{4}-[0-9]{4}")  # a spec not compiled yet
        engine.add_request("slow", ids, SamplingParams(temperature=0, max_tokens=20,
                                                       structured_outputs=so))
        engine.add_request("plain", ids, SamplingParams(temperature=0, max_tokens=5))
        finished = set()
        for _ in range(50):
            finished |= {o.request_id for o in engine.step() if o.finished}
            if "plain" in finished:
                break
        assert finished == {"plain"} and "slow" in engine.compiling  # the batch went on
        gate.set()
        for _ in range(500):
            out = [o for o in engine.step() if o.request_id == "slow" and o.finished]
            if out:
                break
        assert re.fullmatch(r"[a-z]{4}-[0-9]{4}", out[0].outputs[0].text)
        # abort while compiling: nothing left behind
        gate.clear()
        engine.add_request("aborted", ids, SamplingParams(
            max_tokens=5, structured_outputs=StructuredOutputsParams(regex="[0-9]{7}")))
        assert [o.finished for o in engine.abort_request(["aborted"])] == [True]
        gate.set()
    finally:
        engine.grammars._compile = real
    engine.check_no_leaks()


def test_params_cross_msgpack_and_dicts() -> None:
    params = _params(3)
    req = decode_request(encode(EngineRequest("r", [1, 2], params)))
    assert req.params == params
    assert SamplingParams.from_dict(params.to_dict()) == params
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_masks_on_cuda_logits_equal_the_cpu_masks(llm) -> None:
    """The batch's bitmask is filled on the host and applied on the logits' device."""
    from pd_cluster.engine.structured.masks import apply_grammar_masks
    from pd_cluster.request import Request
    reqs = []
    for i, so in enumerate([StructuredOutputsParams(json=json.dumps(SCHEMA)), None,
                            StructuredOutputsParams(regex="[a-c]{2}")]):
        r = Request(f"m{i}", [1, 2], SamplingParams(structured_outputs=so))
        r.grammar = llm.engine.grammars.start(so) if so else None
        if r.grammar is not None:
            r.grammar.future.result(30)
        reqs.append(r)
    logits = torch.randn(3, llm.engine.vocab_size)
    on_gpu = apply_grammar_masks(logits.clone().cuda(), reqs).cpu()
    on_cpu = apply_grammar_masks(logits.clone(), reqs)
    assert torch.equal(on_gpu, on_cpu) and torch.equal(on_cpu[1], logits[1])
    assert torch.isinf(on_cpu[0]).any() and torch.isinf(on_cpu[2]).any()


def _run_to_end(llm: LLM, rid: str, params: SamplingParams):
    llm.engine.add_request(rid, llm.get_tokenizer().encode("Once upon a time"), params)
    for _ in range(1000):
        for out in llm.engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError("request did not finish")


@pytest.mark.parametrize("how", ["raises", "refuses"])
def test_a_grammar_that_breaks_ends_the_request_with_an_error(llm, monkeypatch, how) -> None:
    """The third token's accept fails: the request ends there (that token never emitted),
    with an error that says so, counted; never goes on unconstrained."""
    from pd_cluster.driver.engine_loop import EngineLoop
    from pd_cluster.driver.messages import ERROR_INVALID_REQUEST
    whole = _run_to_end(llm, "unbroken", _params(None)).outputs[0]
    backend, real = llm.engine.grammars.backend, llm.engine.grammars.backend.accepts
    calls = []

    def accepts(matcher, token):
        calls.append(token)
        if len(calls) == 3:
            if how == "raises":
                raise RuntimeError("matcher died")
            return False
        return real(matcher, token)

    monkeypatch.setattr(backend, "accepts", accepts)
    before = llm.engine.stats()["grammar_failures"]
    out = _run_to_end(llm, "broken", _params(None))
    comp = out.outputs[0]
    assert comp.finish_reason == "abort"
    assert comp.token_ids == list(whole.token_ids[:2])  # the refused 3rd token was dropped
    assert "grammar broke at output token #2" in comp.error
    assert ("matcher died" if how == "raises" else "is not in the grammar") in comp.error
    assert llm.engine.stats()["grammar_failures"] == before + 1
    sent = []  # what the served engine sends the proxy: an error it does not retry
    loop = EngineLoop(llm.engine, sent.extend)
    loop._active["broken"] = 0
    loop._emit_outputs([out])
    assert sent[0].finished and sent[0].error == comp.error
    assert sent[0].error_type == ERROR_INVALID_REQUEST
    llm.engine.check_no_leaks()


def test_a_mask_that_fails_ends_only_its_request(llm, monkeypatch) -> None:
    backend = llm.engine.grammars.backend
    real = backend.fill_bitmask
    ids = llm.get_tokenizer().encode("Once upon a time")
    llm.engine.add_request("bad", ids, _params(None))
    llm.engine.add_request("good", ids, _params(3))
    held = {r.request_id: r for r in llm.engine.scheduler.requests.values()}

    def fill(matchers, bitmask, rows):
        if held["bad"].grammar._matcher in matchers:
            raise RuntimeError("fill failed")
        real(matchers, bitmask, rows)

    monkeypatch.setattr(backend, "fill_bitmask", fill)
    done = {}
    for _ in range(1000):
        done.update({o.request_id: o.outputs[0] for o in llm.engine.step() if o.finished})
        if len(done) == 2:
            break
    assert done["bad"].finish_reason == "abort" and "fill failed" in done["bad"].error
    assert done["bad"].token_ids == []  # its first token was sampled without a mask
    assert done["good"].finish_reason == "stop" and done["good"].error is None
    jsonschema.validate(json.loads(llm.get_tokenizer().decode(done["good"].token_ids[:-1])),
                        SCHEMA)
    llm.engine.check_no_leaks()
