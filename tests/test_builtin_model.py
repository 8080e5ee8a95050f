"""The shipped demo model (preset ``tiny-llama``): it loads, writes clean English, matches HF."""
from __future__ import annotations

import json
import re

import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.checkpoints.maker import (CHAT_TEMPLATE, MAKER_FILE, PRESETS, default_model_path,
                                    param_count)
from tests.conftest import assert_greedy_matches, hf_greedy

PROMPTS = ["Once upon a time", "The quick brown fox", "Hello", "Tell me about foxes."]
WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(default_model_path("tiny-llama"))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(block_size=16)  # model=None: the built-in default


def test_shipped_checkpoint_is_the_trained_default(model_dir: str, llm: LLM) -> None:
    assert llm.engine.config.model == model_dir
    meta = json.loads((default_model_path() / MAKER_FILE).read_text())
    assert meta["trained_by"] == "scripts/train_tiny_model.py"
    cfg = json.loads((default_model_path() / "config.json").read_text())
    shape = PRESETS["tiny-llama"]
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (
        shape["vocab_size"], shape["hidden_size"], shape["num_layers"])
    assert param_count(model_dir) < 2_000_000  # a few MB in fp32: fine to keep in git
    tok = llm.get_tokenizer()
    assert tok.chat_template == CHAT_TEMPLATE
    for text in PROMPTS + ["Numbers 123, tabs\tand \u00e9 survive."]:
        assert tok.decode(tok.encode(text)) == text


def test_greedy_output_is_clean_readable_text(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    # Questions go through the chat template, as a user asks them (raw, a question may end
    # the document: the model was trained on questions in chat turns).
    chats = [tok.apply_chat_template([{"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=False)
             for q in ("Tell me about foxes.", "Tell me about owls.")]
    outs = llm.generate(PROMPTS[:3] + chats, SamplingParams(temperature=0, max_tokens=48))
    for out in outs:
        text = out.outputs[0].text
        assert "\ufffd" not in text, (out.prompt, text)
        assert all(c.isprintable() or c == "\n" for c in text), (out.prompt, text)
        assert text.isascii(), (out.prompt, text)
        words = WORD.findall(text)
        assert len(words) >= 4, (out.prompt, text)
        # Readable: made of words and the usual punctuation, not byte soup.
        assert len(" ".join(words)) >= 0.75 * len(text.strip()), (out.prompt, text)
    story = outs[0].outputs[0].text
    assert story.count(".") >= 2, story  # whole sentences, not a word salad that never ends one


def test_greedy_matches_hf_transformers(model_dir: str, llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompt = tok.encode("Once upon a time")
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert_greedy_matches(model_dir, prompt, ours[0].outputs[0].token_ids,
                          hf_greedy(model_dir, prompt, 40))
    llm.engine.check_no_leaks()
