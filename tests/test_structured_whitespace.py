"""JSON grammars bound the whitespace between tokens by default (structured_outputs.
max_whitespace_cnt): the demo model, which left alone writes newlines until max_tokens, finishes
json schemas, json_object and tool_choice=required (one call or parallel) at temperature 0 and
1; disable_any_whitespace still means only the separators' spaces."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.config import StructuredOutputsConfig
from pd_cluster.serving.api.openai_format import Result
from pd_cluster.serving.api.tool_format import ToolChatFormatter
from pd_cluster.serving.api.tools import tool_plan
from pd_cluster.serving.cluster.cluster_config import resolve_model
from pd_cluster.structured_outputs import StructuredOutputsParams

CAP = StructuredOutputsConfig().max_whitespace_cnt
NAME = {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}
PERSON = {"type": "object", "properties": {
    "name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": NAME, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
SEEDS = [None, 1, 2, 3]  # None: greedy


@pytest.fixture(scope="module")
def llm():
    # the default structured_outputs config: whitespace allowed, bounded
    with LLM(model=resolve_model("tiny-llama"), num_kv_blocks=256, max_model_len=512) as engine:
        yield engine
        engine.engine.check_no_leaks()


def _chat(llm: LLM, message: str, so: StructuredOutputsParams, seed: int | None) -> Result:
    params = SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed,
                            max_tokens=256, structured_outputs=so)
    out = llm.chat([{"role": "user", "content": message}], params)[0].outputs[0]
    return Result([], out.text, list(out.token_ids), out.finish_reason)


def _longest_gap(text: str) -> int:
    """The longest whitespace run outside JSON strings."""
    longest = run = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
            continue
        run = run + 1 if ch in " \t\r\n" else 0
        longest = max(longest, run)
        in_string = ch == '"'
    return longest


def test_default_cap_and_its_check() -> None:
    assert CAP == 8
    assert StructuredOutputsConfig(max_whitespace_cnt=None).max_whitespace_cnt is None
    with pytest.raises(ValueError, match="max_whitespace_cnt"):
        StructuredOutputsConfig(max_whitespace_cnt=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_finishes(llm, seed) -> None:
    so = StructuredOutputsParams(json=json.dumps(PERSON))
    r = _chat(llm, "Describe a person as JSON with name and age.", so, seed)
    assert r.finish_reason == "stop", r.text  # unbounded: newlines until max_tokens at t=0
    jsonschema.validate(json.loads(r.text), PERSON)
    assert _longest_gap(r.text) <= CAP


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_tool_choice_required_finishes_with_a_call(llm, seed, parallel) -> None:
    plan = tool_plan(TOOLS, "required", parallel, False, None)
    r = _chat(llm, "What is the weather in Paris?", plan.constraint(), seed)
    assert r.finish_reason == "stop", r.text
    choice = ToolChatFormatter(plan, "id", "m", False).full([r])["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    assert _longest_gap(r.text) <= CAP


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_finishes(llm, seed) -> None:
    # The demo model learnt short JSON answers (scripts/story_grammar.py); before, it wrote
    # stories in its keys until max_tokens.
    r = _chat(llm, "Reply in JSON.", StructuredOutputsParams(json_object=True), seed)
    assert r.finish_reason == "stop", r.text
    assert isinstance(json.loads(r.text), dict)
    assert _longest_gap(r.text) <= CAP, r.text


def test_disable_any_whitespace_still_means_none(llm) -> None:
    so = StructuredOutputsParams(json=json.dumps(PERSON), disable_any_whitespace=True)
    r = _chat(llm, "Describe a person as JSON with name and age.", so, None)
    # (xgrammar's separators ", " and ": " stay)
    assert r.finish_reason == "stop" and _longest_gap(r.text) <= 1, r.text
