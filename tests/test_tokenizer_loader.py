"""pd_cluster/tokenizer_loader.py: the tokenizer built without AutoTokenizer (and without torch)
is the one AutoTokenizer builds, token for token; other checkpoints still go through
AutoTokenizer; the proxy process does not import torch."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from transformers import AutoTokenizer

from pd_cluster.checkpoints.presets import trained_model_path
from pd_cluster.tokenizer_loader import _DIRECT_MODEL_TYPES, load_tokenizer, loads_directly

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["Hello", "", " leading space", "Once upon a time, there was a dog.\n\nThe end.",
         "tabs\tand  double  spaces ", "naïve café – “quotes” 日本語 😀", "<s>inside</s> text",
         "a" * 300, "12345 + 678 = 7023", "\r\n\n  \n"]
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "And 3+3?"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "weather?"}], "add_generation_prompt": True,
     "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
         "type": "object", "properties": {"city": {"type": "string"}}}}}],
     "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                      "{% if tools %}{{ tools | tojson }}{% endif %}{{ bos_token }}"},
]


@pytest.fixture(scope="module")
def checkpoints(tiny_model: Callable[..., str]) -> dict[str, str]:
    return {"tiny-llama": str(trained_model_path("tiny-llama")),
            "made llama": tiny_model(), "made qwen2": tiny_model(arch="qwen2")}


@pytest.mark.parametrize("name", ["tiny-llama", "made llama"])
def test_direct_load_equals_autotokenizer(checkpoints: dict[str, str], name: str) -> None:
    path = checkpoints[name]
    assert loads_directly(path)
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(ours) is type(theirs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.eos_token_id == theirs.eos_token_id and ours.chat_template == theirs.chat_template
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert (ours.encode(text, add_special_tokens=False)
                == theirs.encode(text, add_special_tokens=False)), text
    ids = list(range(len(theirs)))
    assert [ours.decode([i]) for i in ids] == [theirs.decode([i]) for i in ids]
    assert ours.decode(ids) == theirs.decode(ids)
    for chat in CHATS:
        kwargs = {k: v for k, v in chat.items() if k != "messages"}
        assert (ours.apply_chat_template(chat["messages"], tokenize=False, **kwargs)
                == theirs.apply_chat_template(chat["messages"], tokenize=False, **kwargs))


def test_other_model_types_go_through_autotokenizer(checkpoints: dict[str, str]) -> None:
    path = checkpoints["made qwen2"]  # AutoTokenizer picks Qwen2Tokenizer for it
    assert not loads_directly(path)
    assert type(load_tokenizer(path)) is type(AutoTokenizer.from_pretrained(path))
    assert not loads_directly(str(ROOT / "no-such-model"))


def test_direct_model_types_are_left_to_the_generic_class() -> None:
    """What loads_directly assumes of the installed transformers: AutoTokenizer honours a
    generic tokenizer_class for these model types (no forced class, no Mistral format)."""
    from transformers.models.auto import tokenization_auto as auto
    for model_type in _DIRECT_MODEL_TYPES:
        assert model_type not in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        assert auto.TOKENIZER_MAPPING_NAMES.get(model_type) != "MistralCommonBackend"


def test_the_proxy_process_does_not_import_torch() -> None:
    """A deferred proxy (as `pd-cluster serve` makes it), its tokenizer loaded, serving, then
    a completion's prompt and a chat prompt tokenized: torch never imported (seconds of CPU
    at every start, beside the engines that need it)."""
    code = (
        "import sys\n"
        "from pd_cluster.serving.cluster import proxy_actor as pa\n"
        "from pd_cluster.serving.api.openai_schemas import ChatCompletionRequest\n"
        "pa._restarted = lambda: False\n"
        "pa.current_engines = lambda launched, namespace: []  # no Ray: no engines\n"
        "cfg = {'mode': 'colocated', 'colocated': {'replicas': 1},\n"
        "       'proxy': {'host': '127.0.0.1', 'port': 0, 'log_stats_interval': 0}}\n"
        "p = pa.ProxyActor(cfg, [], 'unused', {}, False, True)\n"
        "p.start()\n"
        "state = p.app.state.proxy\n"
        "assert state.tokenizer.encode('Hello')\n"
        "req = ChatCompletionRequest(model='m', messages=[{'role': 'user', 'content': 'hi'}])\n"
        "assert state.chat_prompt(req)\n"
        "p.stop()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-500:]
