"""No request lost: a request resumed on another engine (its prompt plus the tokens already
streamed) continues exactly where it stopped, greedy or seeded, without repeating or dropping
a token or a character."""
from __future__ import annotations

from typing import Any

import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.engine.llm_engine import LLMEngine


def _stream(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
            **resume: Any) -> tuple[list[int], str, Any]:
    engine.add_request(rid, prompt, params, **resume)
    ids: list[int] = []
    text = ""
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.outputs[0].delta_token_ids
            text += out.outputs[0].delta_text
            if out.finished:
                final = out
    engine.check_no_leaks()
    return ids, text, final


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, stop=["e t"]),
], ids=["greedy", "seeded", "seeded-stop"])
@pytest.mark.parametrize("cut", [1, 9])
def test_resumed_request_continues_exactly(tiny_model: Any, params: SamplingParams,
                                           cut: int) -> None:
    model = tiny_model()
    prompt = [5 + (i * 37) % 400 for i in range(30)]
    a = LLM(model=model, num_kv_blocks=64).engine
    full_ids, full_text, full = _stream(a, "r", prompt, params)
    # The first engine died after `cut` tokens; the client had their text (as streamed).
    b = LLM(model=model, num_kv_blocks=64).engine
    partial_text = _stream(LLM(model=model, num_kv_blocks=64).engine, "p", prompt,
                           SamplingParams(**{**params.to_dict(), "max_tokens": cut}))[1]
    sent_text = partial_text if not params.stop else full_text[:len(partial_text)]
    rest_ids, rest_text, final = _stream(b, "r", prompt, params,
                                         resume_token_ids=full_ids[:cut],
                                         resume_text_len=len(sent_text))
    assert full_ids[:cut] + rest_ids == full_ids
    assert sent_text + rest_text == full_text
    assert final.outputs[0].token_ids == full.outputs[0].token_ids
    assert final.outputs[0].finish_reason == full.outputs[0].finish_reason


def test_resume_with_nothing_left_is_rejected(tiny_model: Any) -> None:
    engine = LLM(model=tiny_model(), num_kv_blocks=64).engine
    with pytest.raises(ValueError, match="resume_token_ids"):
        engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2),
                           resume_token_ids=[8, 9])
    engine.check_no_leaks()
