"""Structured outputs through a 1P2D cluster (every request disaggregated): JSON schemas,
json_object, regex, choice and EBNF grammars, streamed and not, greedy and seeded; each output
equals the colocated engine's (the grammar state crosses P -> D as the first token) and
validates; a decode engine killed mid-stream hands its requests over with their grammars."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.serving.cluster.cluster_config import resolve_model
from pd_cluster.serving.cluster.testing import (cluster_status, leak_reports, wait_idle,
                                                wait_until)
from pd_cluster.structured_outputs import StructuredOutputsParams
from tests.shared_cluster import MODEL, SharedCluster

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", "fish"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "pet", "tags", "ok"], "additionalProperties": False}
PROMPTS = ["Tell me about a person:", "Once upon a time", "The quick brown fox", "Data:"]


pytestmark = pytest.mark.timeout(900)  # the shared cluster's start-up may count in a test here


@pytest.fixture(scope="module")
def cluster(serving_cluster: SharedCluster) -> Iterator[Any]:
    """The serving modules' shared cluster (tests/shared_cluster.py: 1P2D, every request through
    P, JSON without free whitespace, the hermes tool parser); leak-checked after this module."""
    yield serving_cluster.get()
    serving_cluster.check_no_leaks()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    with LLM(model=resolve_model(MODEL), num_kv_blocks=256, max_model_len=512,
             structured_outputs={"disable_any_whitespace": True}) as llm:
        yield llm


def _colocated(offline: LLM, ids: list[int], so: StructuredOutputsParams, max_tokens: int,
               seed: int | None) -> list[int]:
    p = SamplingParams(temperature=0.0 if seed is None else 0.9, seed=seed,
                       max_tokens=max_tokens, structured_outputs=so)
    return list(offline.generate([ids], p)[0].outputs[0].token_ids)


@pytest.mark.parametrize("seed", [None, 7])
def test_json_schema_chat_validates_and_equals_colocated(client, offline, seed) -> None:
    tok = offline.get_tokenizer()
    for prompt in PROMPTS:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=120,
            temperature=0.0 if seed is None else 0.9, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
            extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        text = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                       add_generation_prompt=True, tokenize=False)
        so = StructuredOutputsParams(json=json.dumps(SCHEMA))
        ids = tok.encode(text, add_special_tokens=False)
        assert choice.token_ids == _colocated(offline, ids, so, 120, seed)


def test_n_choices_each_follow_their_own_grammar(client) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=120, n=3,
        temperature=1.0, seed=5, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": SCHEMA}})
    outs = [c.message.content for c in r.choices]
    for out in outs:
        jsonschema.validate(json.loads(out), SCHEMA)
    assert len(set(outs)) > 1  # sampled apart, each under its own matcher


def test_streamed_json_equals_unstreamed(client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    for seed in (None, 3):
        kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=120,
                  extra_body={"response_format": fmt}, temperature=0.0 if seed is None else 1.0, seed=seed)
        whole = client.completions.create(**kw).choices[0].text
        parts = [c.choices[0].text for c in client.completions.create(**kw, stream=True)
                 if c.choices]
        assert "".join(parts) == whole
        jsonschema.validate(json.loads(whole), SCHEMA)


def test_json_object_regex_choice_grammar(client) -> None:
    def complete(so: dict, prompt: str = PROMPTS[3], **kw) -> str:
        choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=200,
                                           extra_body={"structured_outputs": so},
                                           **kw).choices[0]
        assert choice.finish_reason == "stop", (so, choice)  # the grammar's end, then EOS
        return choice.text
    for seed in (None, 11):
        kw = dict(temperature=0.0 if seed is None else 1.0, seed=seed)
        # any object: the demo model learnt to close a JSON answer (a chat turn asking for one)
        obj = complete({"json_object": True}, "user: Reply in JSON.\nassistant:", **kw)
        assert isinstance(json.loads(obj), dict)
        assert re.fullmatch(r"[a-z]{2,5}-\d{3}", complete({"regex": r"[a-z]{2,5}-\d{3}"}, **kw))
        assert complete({"choice": ["red", "green", "blue"]}, **kw) in {"red", "green", "blue"}
        # bounded: whether a model closes an unbounded sum is the model's choice (the retrained
        # demo model adds "+44" until max_tokens); the grammar's own end is what is tested
        grammar = ('root ::= "(" num tail ")"\ntail ::= "" | "+" num | "+" num "+" num\n'
                   'num ::= [1-9] [0-9]?')
        assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2}){0,2}\)", complete({"grammar": grammar}, **kw))
        schema = {"type": "object", "properties": {"x": {"type": "boolean"}},
                  "required": ["x"]}
        out = complete({"json": schema}, **kw)
        jsonschema.validate(json.loads(out), schema)


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = pydantic.Field(ge=0, le=30)
    friendly: bool


def test_sdk_parse_with_a_pydantic_model(client) -> None:
    for seed in (None, 4):
        r = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Describe a pet."}],
            response_format=Pet, max_tokens=60, seed=seed, temperature=0 if seed is None else 1)
        assert isinstance(r.choices[0].message.parsed, Pet), r


TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up",
    "parameters": {"type": "object", "properties": {
        "word": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "lang": {"enum": ["en", "fr"]}}, "required": ["word", "lang"],
        "additionalProperties": False}}}


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "lookup"}}])
def test_tool_calls_validate_and_stream(client, tool_choice) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is a cat?"}],
              tools=[TOOL], tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=80,
              temperature=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "lookup" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    name, args, reason = "", "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        reason = chunk.choices[0].finish_reason or reason
        for c in chunk.choices[0].delta.tool_calls or []:
            name += c.function.name or ""
            args += c.function.arguments or ""
    assert (name, args, reason) == ("lookup", call.function.arguments, "tool_calls")


def test_tool_choice_none_and_auto_answer_text(client) -> None:
    for choice in ("none", "auto"):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}], tools=[TOOL],
            tool_choice=choice, max_tokens=12, temperature=0)
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_responses_api_text_schema_tools_and_stream(client) -> None:
    r = client.responses.create(model=MODEL, input="Once upon a time", max_output_tokens=12,
                                temperature=0)
    assert r.status == "incomplete" and r.output_text and r.usage.output_tokens == 12
    events = list(client.responses.create(model=MODEL, input="Once upon a time",
                                          max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete" and "response.output_text.done" in kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        r.output_text == events[-1].response.output_text
    schema = Pet.model_json_schema()
    fmt = {"format": {"type": "json_schema", "name": "pet", "schema": schema, "strict": True}}
    r = client.responses.create(model=MODEL, instructions="You describe pets.",
                                input=[{"role": "user", "content": "A pet, please."}],
                                text=fmt, max_output_tokens=60, temperature=0)
    Pet.model_validate_json(r.output_text)
    tool = {"type": "function", **TOOL["function"]}
    for stream in (False, True):
        kw = dict(model=MODEL, input="Look up cat", tools=[tool], tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=80, temperature=0)
        if stream:
            events = list(client.responses.create(**kw, stream=True))
            out = events[-1].response.output
            args = "".join(e.delta for e in events
                           if e.type == "response.function_call_arguments.delta")
            assert args == out[0].arguments
        else:
            out = client.responses.create(**kw).output
        (call,) = out
        assert call.type == "function_call" and call.name == "lookup"
        jsonschema.validate(json.loads(call.arguments), TOOL["function"]["parameters"])
    follow = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Look up cat"},
        {"type": "function_call", "call_id": call.call_id, "name": "lookup",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "a small animal"}])
    assert follow.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "bogus"}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
]


def test_malformed_specs_are_400_and_server_stays_healthy(cluster, client) -> None:
    with httpx.Client(base_url=cluster.url, timeout=30) as http:
        for extra, param in BAD:
            for path, body in (("/v1/completions", {"prompt": "x"}),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "x"}]})):
                if "tools" in extra and "chat" not in path:
                    continue  # completions have no tools
                r = http.post(path, json={"model": MODEL, **body, **extra})
                assert r.status_code == 400, (extra, r.text)
                assert r.json()["error"]["param"] == param, (extra, r.text)
    assert client.completions.create(model=MODEL, prompt="fine", max_tokens=4).usage
    st = wait_idle(cluster.url)
    assert all(e["healthy"] and e["last_error"] is None for e in st["engines"])


async def _stream(http: httpx.AsyncClient, body: dict, started: asyncio.Event) -> str:
    text = ""
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
                started.set()
    return text


def test_decode_killed_mid_stream_keeps_the_grammar(cluster) -> None:
    """decode-0 is SIGKILLed while schema-constrained streams run on it: they move to decode-1,
    whose fresh matchers replay the tokens sent, and every output validates."""
    wait_idle(cluster.url)
    # long outputs (many tags of long strings) so the kill lands mid-stream
    schema = {"type": "object", "properties": {"notes": {
        "type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 12,
        "maxItems": 12}}, "required": ["notes"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    bodies = [{"model": MODEL, "prompt": PROMPTS[i % 4], "max_tokens": 400, "stream": True,
               "response_format": fmt, "temperature": 0.0 if i % 2 else 0.8, "seed": i}
              for i in range(8)]
    old_pid = next(e["pid"] for e in cluster_status(cluster.url)["engines"]
                   if e["name"] == "decode-0")
    migrations_before = _metric(cluster.url, "pd_migrations_total")

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=90) as http:
            started = [asyncio.Event() for _ in bodies]
            tasks = [asyncio.create_task(_stream(http, b, s)) for b, s in zip(bodies, started)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 60)
            os.kill(old_pid, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    for text in asyncio.run(run()):
        jsonschema.validate(json.loads(text), schema)
    assert _metric(cluster.url, "pd_migrations_total") > migrations_before

    def restarted() -> bool:
        d0 = next(e for e in cluster_status(cluster.url)["engines"] if e["name"] == "decode-0")
        return d0["healthy"] and d0["pid"] != old_pid
    wait_until(restarted, 120, "decode-0 restarted and healthy", interval=0.5)
    st = wait_idle(cluster.url)
    assert all(e["stats"]["kv_blocks_used"] == 0 for e in st["engines"])
    assert leak_reports(cluster) == {}


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))
