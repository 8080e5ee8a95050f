"""``LLM.chat`` as vLLM's: the tokenizer's chat template, one conversation or several, text
parts as strings, anything else a ValueError saying it is not supported."""
from __future__ import annotations

import pytest

from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
CONV = [{"role": "system", "content": "You are a storyteller."},
        {"role": "user", "content": "Tell me about a cat."}]


@pytest.fixture(scope="module")
def llm():
    with LLM(num_kv_blocks=64) as llm:  # the built-in model, with its chat template
        yield llm
        llm.engine.check_no_leaks()


def test_chat_is_generate_on_the_templated_prompt(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(CONV, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    [out] = llm.chat(CONV, GREEDY)
    [ref] = llm.generate({"prompt_token_ids": ids}, GREEDY)
    assert out.prompt_token_ids == ids and out.prompt == text
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 12
    llm.engine.check_no_leaks()


def test_text_parts_equal_a_string_and_batches_keep_order(llm: LLM) -> None:
    parts = [CONV[0], {"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                                   {"type": "text", "text": "about a cat."}]}]
    other = [{"role": "user", "content": "Hello!"}]
    a, b, c = llm.chat([CONV, parts, other], GREEDY)
    assert a.prompt_token_ids == b.prompt_token_ids != c.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    [solo] = llm.chat(other, GREEDY)
    assert solo.outputs[0].token_ids == c.outputs[0].token_ids


def test_continue_final_message_and_default_params(llm: LLM) -> None:
    conv = CONV + [{"role": "assistant", "content": "Once upon a time"}]
    [out] = llm.chat(conv, GREEDY, continue_final_message=True)
    assert out.prompt.rstrip().endswith("Once upon a time")
    [out] = llm.chat(CONV)  # SamplingParams() by default, as generate
    assert out.outputs[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("content, match", [
    ([{"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
     r"messages\[0\]\.content\[0\]: content part of type 'image_url': only text content is "
     r"supported \(images, audio, video and files are not\)"),
    ([{"type": "text", "text": "hi"}, {"type": "input_audio"}],
     r"messages\[0\]\.content\[1\]: content part of type 'input_audio'"),
    (42, r"messages\[0\]\.content: expected a string or a list of content parts, got int"),
])
def test_non_text_content_is_a_value_error(llm: LLM, content, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.chat([{"role": "user", "content": content}], GREEDY)
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], GREEDY)
