"""The offline ``LLM`` API and the streaming ``LLMEngine`` interface."""
from __future__ import annotations

import math
import re

import pytest

from tests.conftest import random_prompt
from pd_cluster.llm import LLM
from pd_cluster.outputs import CompletionOutput, RequestOutput
from pd_cluster.sampling_params import SamplingParams

TEXT = "Once upon a time"
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model(arch="llama")


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model=model_dir, block_size=16)


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest):
    yield
    if "llm" in request.fixturenames:
        request.getfixturevalue("llm").engine.check_no_leaks()


# ---------------------------------------------------------------------------- prompt forms

def test_prompt_forms_and_output_fields(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(TEXT)
    outs = llm.generate([TEXT, ids, {"prompt_token_ids": ids}, {"prompt": TEXT}], GREEDY)
    assert len(outs) == 4
    tokens = [o.outputs[0].token_ids for o in outs]
    assert all(t == tokens[0] for t in tokens), "same prompt in four forms must agree"
    for out in outs:
        assert isinstance(out, RequestOutput) and out.finished
        assert out.prompt_token_ids == ids
        assert isinstance(out.request_id, str)
        assert out.num_cached_tokens >= 0
        assert "arrival_time" in out.metrics and "first_token_time" in out.metrics
        assert len(out.outputs) == 1
        comp = out.outputs[0]
        assert isinstance(comp, CompletionOutput)
        assert comp.index == 0 and len(comp.token_ids) == 16
        assert comp.finish_reason == "length" and comp.stop_reason is None
        assert comp.logprobs is None
        assert comp.text == llm.get_tokenizer().decode(comp.token_ids)
    assert len({o.request_id for o in outs}) == 4
    assert outs[0].prompt == TEXT and outs[3].prompt == TEXT
    assert outs[1].prompt is None and outs[2].prompt is None


def test_single_prompt_forms(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(TEXT)
    a = llm.generate(TEXT, GREEDY)
    b = llm.generate(ids, GREEDY)  # a flat list of ints is ONE prompt
    c = llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert len(a) == len(b) == len(c) == 1
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids == c[0].outputs[0].token_ids
    assert llm.generate([], GREEDY) == []


def test_default_sampling_params(llm: LLM) -> None:
    out = llm.generate(TEXT)[0]
    assert 1 <= len(out.outputs[0].token_ids) <= SamplingParams().max_tokens


def test_list_of_sampling_params(llm: LLM) -> None:
    prompts = [random_prompt(n, seed=n) for n in (3, 20, 40)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 5, 9)]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 5, 9]
    assert [o.prompt_token_ids for o in outs] == prompts
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompts, params[:2])


# ---------------------------------------------------------------------------- sampling

def test_seeded_sampling_reproducible_and_batch_independent(llm: LLM) -> None:
    prompt = random_prompt(12, seed=1)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    first = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    again = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    assert first == again

    # Same request inside a different batch (other seeded and unseeded requests around it).
    others = [random_prompt(n, seed=50 + n) for n in (5, 33, 70)]
    batch = [others[0], prompt, others[1], others[2]]
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=10), seeded,
              SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.2, top_k=20, top_p=0.9, max_tokens=5)]
    outs = llm.generate(batch, params)
    assert outs[1].outputs[0].token_ids == first

    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=24, ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].outputs[0].token_ids != first


def test_unseeded_sampling_varies(llm: LLM) -> None:
    params = SamplingParams(temperature=1.5, max_tokens=24, ignore_eos=True)
    runs = {tuple(llm.generate(TEXT, params)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(runs) > 1


def test_max_tokens_finish_length(llm: LLM) -> None:
    out = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    comp = out.outputs[0]
    assert len(comp.token_ids) == 5 and comp.finish_reason == "length"


def test_stop_string_trimmed(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    text = llm.generate(TEXT, params)[0].outputs[0].text
    words = [m.group() for m in re.finditer(r"[A-Za-z]{2,}", text) if m.start() > 0]
    assert words, f"no ASCII word in the greedy output to use as a stop string: {text!r}"
    stop = words[0]
    cut = text.find(stop)
    assert cut > 0

    out = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                            stop=[stop, "\u2603never\u2603"]))[0]
    comp = out.outputs[0]
    assert comp.text == text[:cut]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert len(comp.token_ids) < 32

    out = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                            stop=stop, include_stop_str_in_output=True))[0]
    assert out.outputs[0].text == text[:cut + len(stop)]


def test_stop_token_ids(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = llm.generate(TEXT, params)[0].outputs[0].token_ids
    k = 5
    stop_tok = tokens[k]
    first = tokens.index(stop_tok)
    out = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                            stop_token_ids=[stop_tok]))[0]
    comp = out.outputs[0]
    assert comp.token_ids == tokens[:first + 1]  # the stop token is the last id ...
    assert comp.text == llm.get_tokenizer().decode(tokens[:first])  # ... but not in the text
    assert comp.finish_reason == "stop" and comp.stop_reason == stop_tok


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    (eos,) = llm.engine.eos_token_id  # every EOS id of the model: this one has one
    prompts = [[t] for t in range(4, 300)]  # ~7000 greedy tokens: some hit EOS by chance
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    stopped = [o for o in outs if o.outputs[0].finish_reason == "stop"]
    assert stopped, "no greedy continuation reached EOS; pick other prompts"
    for o in stopped:
        assert o.outputs[0].token_ids[-1] == eos and eos not in o.outputs[0].token_ids[:-1]
        assert o.outputs[0].stop_reason is None  # EOS, not a stop_token_ids entry
    for o in outs:
        if o.outputs[0].finish_reason == "length":
            assert eos not in o.outputs[0].token_ids and len(o.outputs[0].token_ids) == 24
    # With ignore_eos the same prompt runs through its EOS.
    p = stopped[0].prompt_token_ids
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 24
    n = len(stopped[0].outputs[0].token_ids)
    assert out.outputs[0].token_ids[:n] == stopped[0].outputs[0].token_ids


def test_logprobs(llm: LLM) -> None:
    out = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                            ignore_eos=True))[0]
    comp = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == 6
    for tok, lp in zip(comp.token_ids, comp.logprobs):
        assert isinstance(lp, dict) and len(lp) == 3
        assert tok in lp and lp[tok] == max(lp.values())  # greedy picks the top token
        assert all(v <= 0 and math.isfinite(v) for v in lp.values())
    zero = llm.generate(TEXT, SamplingParams(temperature=1.0, seed=3, max_tokens=4, logprobs=0,
                                             ignore_eos=True))[0].outputs[0]
    assert all(set(lp) == {t} for t, lp in zip(zero.token_ids, zero.logprobs))


# ---------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"), ({"max_tokens": 0}, "max_tokens"), ({"n": 2}, "n"),
    ({"logprobs": 1000}, "logprobs"), ({"stop": [""]}, "stop"), ({"seed": "x"}, "seed"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"), ({"min_tokens": -1}, "min_tokens"),
])
def test_bad_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"block_size": 7}, "block_size"), ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"), ({"dtype": "int3"}, "dtype"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"), ({"no_such_arg": 1}, "no_such_arg"),
])
def test_bad_engine_args(model_dir: str, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LLM(model=model_dir, **kwargs)


def test_missing_model_dir(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such directory"):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(tmp_path))


def test_overlong_prompt(model_dir: str) -> None:
    llm = LLM(model=model_dir, max_model_len=32, block_size=8)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([random_prompt(32, seed=0)], GREEDY)
    # One short of the limit: generates exactly one token, stopped by max_model_len.
    out = llm.generate([random_prompt(31, seed=0)],
                       SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    out = llm.generate([random_prompt(20, seed=0)],
                       SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 12
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("bad", [[5, 512], [-1, 5], [5, 10**9]])
def test_bad_token_id(llm: LLM, bad: list[int]) -> None:
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(bad, GREEDY)
    # Earlier prompts of the same call are rolled back.
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], {"prompt_token_ids": bad}], GREEDY)


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"prompt_token_ids": []}, GREEDY)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"text": "x"}, GREEDY)


def test_request_too_big_for_kv_cache(model_dir: str) -> None:
    llm = LLM(model=model_dir, block_size=8, num_kv_blocks=4)  # 32 tokens of KV
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate([random_prompt(20, seed=0)],
                     SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    llm.engine.check_no_leaks()


# ---------------------------------------------------------------------------- streaming engine

def test_streaming_deltas(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("s1", TEXT, params)
    engine.add_request("s2", random_prompt(40, seed=9), SamplingParams(
        temperature=0, max_tokens=7, ignore_eos=True))
    texts: dict[str, str] = {"s1": "", "s2": ""}
    tokens: dict[str, list[int]] = {"s1": [], "s2": []}
    final: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            comp = out.outputs[0]
            texts[out.request_id] += comp.delta_text
            tokens[out.request_id] += comp.delta_token_ids
            assert comp.token_ids == tokens[out.request_id]
            assert (comp.finish_reason is None) == (not out.finished)
            if out.finished:
                final[out.request_id] = out
    assert steps >= 20
    for rid in ("s1", "s2"):
        assert texts[rid] == final[rid].outputs[0].text
        assert tokens[rid] == final[rid].outputs[0].token_ids
    assert final["s1"].outputs[0].token_ids == llm.generate(TEXT, params)[0].outputs[0].token_ids
    engine.check_no_leaks()


def test_abort_mid_generation(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a1", random_prompt(30, seed=1), params)
    engine.add_request("a2", random_prompt(70, seed=2), params)
    engine.add_request("a3", random_prompt(5, seed=3), params)
    for _ in range(4):
        engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    aborted = engine.abort_request(["a2", "unknown-id"])
    assert [o.request_id for o in aborted] == ["a2"]
    assert aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    assert len(aborted[0].outputs[0].token_ids) == 4
    engine.step()
    aborted = engine.abort_request(["a1", "a3"])
    assert sorted(o.request_id for o in aborted) == ["a1", "a3"]
    assert not engine.has_unfinished_requests()
    assert engine.stats()["kv_blocks_used"] == 0
    assert engine.abort_request(["a1"]) == []
    engine.check_no_leaks()


def test_abort_waiting_request(model_dir: str) -> None:
    llm = LLM(model=model_dir, block_size=8, max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request("w1", random_prompt(10, seed=1), params)
    engine.add_request("w2", random_prompt(10, seed=2), params)
    engine.step()
    assert engine.stats()["num_waiting"] == 1
    assert [o.request_id for o in engine.abort_request(["w2"])] == ["w2"]
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_no_leaks()


def test_duplicate_request_id(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("dup", TEXT, params)
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("dup", TEXT, params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("dup", TEXT, params)  # free again once finished
    engine.abort_request(["dup"])
    engine.check_no_leaks()


def test_check_no_leaks_detects_held_request(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("held", TEXT, SamplingParams(max_tokens=5))
    engine.step()
    with pytest.raises(AssertionError):
        engine.check_no_leaks()
    engine.abort_request(["held"])
    engine.check_no_leaks()
