"""Tool calls without a cluster: the parsers (hermes, llama3_json, mistral), the plan a request
makes (400s naming the field), a model with random weights writing named and required calls
whose arguments validate, and streamed deltas that reassemble to the non-streamed body."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.serving.api.errors import APIError
from pd_cluster.serving.api.openai_format import Result
from pd_cluster.serving.api.tool_format import ToolChatFormatter
from pd_cluster.serving.api.tool_parsers import PARSERS
from pd_cluster.serving.api.tools import tool_plan

WEATHER = {"type": "object", "properties": {
    # (not maxLength: xgrammar 0.2.8 lets control characters into length-bounded strings)
    "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
    "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.mark.parametrize("name,text,content,calls", [
    ("hermes", 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
               '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
     "Sure.", [("f", {"a": 1}), ("g", {})]),
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
     None, [("f", {"a": 1}), ("g", {})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": "y"}}', None,
     [("f", {"x": "y"})]),
    ("llama3_json", "Hello {there}", "Hello {there}", []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', None, [("f", {"a": 1})]),
    ("mistral", 'ok [TOOL_CALLS]f[ARGS]{"a": 2}[TOOL_CALLS]g[ARGS]{}', "ok ",
     [("f", {"a": 2}), ("g", {})]),
])
def test_parsers(name, text, content, calls) -> None:
    got_content, got = PARSERS[name]().parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("tools,choice,auto,param", [
    (None, "required", False, "tool_choice"),
    (TOOLS, "auto", False, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, False, "tool_choice"),
    (TOOLS, "sometimes", False, "tool_choice"),
    ([{"type": "function", "function": {"description": "no name"}}], "required", False, "tools"),
])
def test_bad_plans_are_400s(tools, choice, auto, param) -> None:
    with pytest.raises(APIError) as e:
        tool_plan(tools, choice, None, auto, "hermes" if auto else None)
    assert e.value.status == 400 and e.value.param == param


def test_default_choice_follows_the_auto_setting() -> None:
    assert tool_plan(TOOLS, None, None, False, None).mode == "none"
    assert tool_plan(TOOLS, None, None, True, "hermes").mode == "auto"


@pytest.fixture(scope="module")
def random_llm(tiny_model):
    with LLM(model=tiny_model(), num_kv_blocks=128, max_model_len=512,
             structured_outputs={"disable_any_whitespace": True}) as llm:
        yield llm


def _generate(llm: LLM, plan, seed: int | None) -> Result:
    params = SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=200,
                            structured_outputs=plan.constraint())
    out = llm.generate([[5, 6, 7, 8]], params)[0].outputs[0]
    return Result(prompt_token_ids=[5, 6, 7, 8], text=out.text, token_ids=list(out.token_ids),
                  finish_reason=out.finish_reason)


def _reassemble(fmt: ToolChatFormatter, text: str, finish: str) -> dict:
    """Feed ``text`` a few characters at a time; merge the deltas as the openai SDK does."""
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)] or [""]
    msg: dict = {"content": "", "tool_calls": {}}
    reason = None
    for i, piece in enumerate(pieces):
        chunk = fmt.chunk(piece, [], finish if i == len(pieces) - 1 else None)
        if chunk is None:
            continue
        choice = chunk["choices"][0]
        reason = choice["finish_reason"] or reason
        delta = choice["delta"]
        msg["content"] += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            slot = msg["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            fn = call.get("function", {})
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
    return {"content": msg["content"] or None, "reason": reason,
            "calls": [msg["tool_calls"][k] for k in sorted(msg["tool_calls"])]}


@pytest.mark.parametrize("seed", [None, 1, 2])
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_random_weights_write_valid_calls(random_llm, choice, seed) -> None:
    # one call: random weights rarely close a list of calls (parallel lists: the next test)
    plan = tool_plan(TOOLS, choice, False, False, None)
    r = _generate(random_llm, plan, seed)
    assert r.finish_reason == "stop", r.text
    body = ToolChatFormatter(plan, "id", "m", False).full([r])
    choice_out = body["choices"][0]
    assert choice_out["finish_reason"] == "tool_calls"
    calls = choice_out["message"]["tool_calls"]
    assert calls and choice_out["message"]["content"] is None
    assert len(calls) == 1
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            SCHEMAS[call["function"]["name"]])
    streamed = _reassemble(ToolChatFormatter(plan, "id", "m", False), r.text, "stop")
    assert streamed["reason"] == "tool_calls" and streamed["content"] is None
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_parallel_required_calls_reassemble() -> None:
    plan = tool_plan(TOOLS, "required", True, False, None)
    assert json.loads(plan.constraint().json).get("maxItems") is None
    text = json.dumps([{"name": "get_time", "arguments": {"zone": "utc"}},
                       {"name": "get_weather", "arguments": {"city": "x", "unit": "c",
                                                             "days": 2}}])
    body = ToolChatFormatter(plan, "id", "m", False).full([Result([1], text, [], "stop")])
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    streamed = _reassemble(ToolChatFormatter(plan, "id", "m", False), text, "stop")
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("text", [
    'Let me check. <tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>',
    "Just text, with a < sign and <tool but no call.",
])
def test_auto_streams_content_then_calls(text) -> None:
    plan = tool_plan(TOOLS, "auto", None, True, "hermes")
    body = ToolChatFormatter(plan, "id", "m", False).full([Result([1], text, [], "stop")])
    message = body["choices"][0]["message"]
    streamed = _reassemble(ToolChatFormatter(plan, "id", "m", False), text, "stop")
    assert streamed["content"] == message["content"]
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert streamed["reason"] == body["choices"][0]["finish_reason"]


def test_config_names_a_known_parser() -> None:
    from pd_cluster.serving.cluster.config_sections import ProxyConfig
    assert ProxyConfig(tool_call_parser="llama3_json").tool_call_parser == "llama3_json"
    with pytest.raises(ValueError, match="tool_call_parser"):
        ProxyConfig(tool_call_parser="nope")


def _old_start(parser, text: str) -> tuple[bool, int]:
    """The streaming rule before the scanners (the whole text rescanned on every chunk):
    (calls began, characters of ``text`` that may be sent as content)."""
    if name_of(parser) == "llama3_json":
        stripped = text.lstrip()
        if stripped.startswith("<|python_tag|>") or stripped.startswith("{"):
            return True, len(text) - len(stripped)
        stripped = text.strip()
        return False, 0 if not stripped or "<|python_tag|>".startswith(stripped) else len(text)
    at = text.find(parser.start)
    if at >= 0:
        return True, at
    hold = next((k for k in range(min(len(parser.start), len(text)), 0, -1)
                 if parser.start.startswith(text[-k:])), 0)
    return False, len(text) - hold


def name_of(parser) -> str:
    return next(n for n, cls in PARSERS.items() if isinstance(parser, cls) and n != "qwen")


def _old_content(parser, pieces: list[str]) -> list[str]:
    text, sent, in_calls, out = "", 0, False, []
    for piece in pieces:
        text += piece
        got = ""
        if not in_calls:
            in_calls, end = _old_start(parser, text)
            if end > sent:
                got, sent = text[sent:end], end
        out.append(got)
    return out


STREAMS = [
    ("hermes", 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'),
    ("hermes", "a <tool but <tool_ca no <<tool_call call"),
    ("hermes", "<<<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>"),
    ("llama3_json", '  {"name": "f", "parameters": {"a": 1}}'),
    ("llama3_json", ' \n <|python_tag|>{"name": "f", "parameters": {}}'),
    ("llama3_json", "<|pyth   \n  on"),
    ("llama3_json", "<|pyth  x"),
    ("llama3_json", "   Hello {there} <|python_tag|>"),
    ("llama3_json", "   "),
    ("mistral", 'ok [TOOL_CALLS]f[ARGS]{"a": 2}[TOOL_CALLS]g[ARGS]{}'),
    ("mistral", "[TOOL_ [TOOL_CALL no calls [TOOL"),
]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 100])
@pytest.mark.parametrize("name,text", STREAMS)
def test_scanner_sends_what_the_rescan_sent(name, text, size) -> None:
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    start = PARSERS[name]().scanner()
    assert [start.feed(p) for p in pieces] == _old_content(PARSERS[name](), pieces)
    plan = tool_plan(TOOLS, "auto", None, True, name)
    fmt = ToolChatFormatter(plan, "id", "m", False)
    content = []
    for i, piece in enumerate(pieces):
        chunk = fmt.chunk(piece, [], "stop" if i == len(pieces) - 1 else None)
        delta = chunk["choices"][0]["delta"] if chunk else {}
        content.append(delta.get("content") or "")
    old = _old_content(PARSERS[name](), pieces)
    body = ToolChatFormatter(plan, "id", "m", False).full([Result([1], text, [], "stop")])
    if not body["choices"][0]["message"]["tool_calls"]:  # the rest goes out at the end
        old[-1] += text[sum(map(len, old)):]
    assert content == old


@pytest.mark.parametrize("name,text", [
    ("hermes", "<tool_ca" * 2500), ("hermes", "plain words, " * 1500),
    ("llama3_json", "Hello, " * 3000), ("mistral", "[TOOL_CALL" * 2000),
])
def test_streaming_work_grows_linearly(name, text) -> None:
    # One character per chunk: a rescan of the whole text per chunk would look at n^2 / 2
    # characters (~5e7 here); the scanners look at each one at most len(marker) times.
    plan = tool_plan(TOOLS, "auto", None, True, name)
    fmt = ToolChatFormatter(plan, "id", "m", False)
    for i, ch in enumerate(text):
        fmt.chunk(ch, [], "stop" if i == len(text) - 1 else None)
    scanned = fmt._streams[0].start.scanned
    assert len(text) <= scanned <= len(text) * len(PARSERS[name]().start or "x") * 2
