"""A P/D cluster from configs/local.yaml behind the proxy, driven by the official openai client.

The serving modules' shared cluster (tests/shared_cluster.py: 1P2D) serves every test here;
each test leaves it idle and healthy, and the module's end checks that nothing leaked.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.serving.cluster.cluster_config import resolve_model
from pd_cluster.serving.cluster.testing import wait_idle
from tests.shared_cluster import MAX_INFLIGHT, MODEL, SharedCluster

PROMPTS = ["Hello world, this is", "The quick brown fox jumps over", "Once upon a time",
           "In a distant land there lived a"]


pytestmark = pytest.mark.timeout(900)  # the shared cluster's start-up may count in a test here


@pytest.fixture(scope="module")
def cluster(serving_cluster: SharedCluster) -> Iterator[Any]:
    """The shared cluster; after this module's tests (and test_serving_api.py's, which
    imports this fixture): idle, every KV block free, no engine holding anything."""
    yield serving_cluster.get()
    serving_cluster.check_no_leaks()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=resolve_model(MODEL), num_kv_blocks=512, max_model_len=1024)


def reference(offline: LLM, prompt_ids: list[int], max_tokens: int, **kw) -> tuple[str, list[int]]:
    out = offline.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                        **kw))[0].outputs[0]
    return out.text, list(out.token_ids)


def test_completion_greedy_matches_offline(client, offline) -> None:
    tok = offline.get_tokenizer()
    for prompt in PROMPTS:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"return_token_ids": True})
        text, ids = reference(offline, tok.encode(prompt), 24)
        choice = r.choices[0]
        assert choice.token_ids == ids  # type: ignore[attr-defined]
        assert choice.text == text
        assert choice.finish_reason in ("length", "stop")
        assert r.usage.prompt_tokens == len(tok.encode(prompt))
        assert r.usage.completion_tokens == len(ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + len(ids)


def test_completion_streaming_matches_offline(client, offline) -> None:
    tok = offline.get_tokenizer()
    prompt_ids = tok.encode(PROMPTS[1])
    stream = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=40,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    text, ids = reference(offline, prompt_ids, 40)
    assert "".join(texts) == text
    assert len([t for t in texts if t]) > 1  # really streamed, not one blob
    assert finish in ("length", "stop")
    assert usage is not None and usage.completion_tokens == len(ids)
    assert usage.prompt_tokens == len(prompt_ids)


def test_chat_matches_offline(client, offline) -> None:
    tok = offline.get_tokenizer()
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "Tell me about foxes"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text, ids = reference(offline, tok.encode(prompt, add_special_tokens=False), 20)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.usage.completion_tokens == len(ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ids)


def test_edge_params(client, offline) -> None:
    tok = offline.get_tokenizer()
    ids = tok.encode(PROMPTS[2])
    # max_tokens=1: the prefill engine alone answers (no KV to ship).
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
    assert r.choices[0].text == reference(offline, ids, 1)[0] and r.usage.completion_tokens == 1
    # Stop strings are honoured across the P -> D hand-over.
    full, _ = reference(offline, ids, 30)
    stop = next((full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip()), None)
    assert stop is not None, f"no two-character stop string in {full!r}"
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0,
                                  stop=[stop])
    want = reference(offline, ids, 30, stop=[stop])[0]
    assert r.choices[0].text == want and len(want) < len(full)  # cut at the stop string
    assert r.choices[0].finish_reason == "stop"
    # Seeded sampling is reproducible: the same tokens as the colocated engine with that seed
    # (P samples token 1, D the rest, each from the seed and the token's position), and again.
    seeded = dict(temperature=0.9, seed=7, max_tokens=12)
    want_ids = list(offline.generate([ids], SamplingParams(**seeded, ignore_eos=True))[0]
                    .outputs[0].token_ids)
    for _ in range(2):
        a = client.completions.create(model=MODEL, prompt=ids, **seeded,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        assert a.choices[0].token_ids == want_ids  # type: ignore[attr-defined]


def test_kv_really_moved_from_p_to_d(cluster) -> None:
    st = wait_idle(cluster.url)
    (p,) = (e for e in st["engines"] if e["role"] == "prefill")
    ds = [e for e in st["engines"] if e["role"] == "decode"]
    assert p["stats"]["requests_total"] > 0 and sum(d["stats"]["requests_total"] for d in ds) > 0
    # the KV connector is in on every D: none may prefill by itself
    assert all(d["kv_endpoint"] is not None for d in ds)
    assert sum(d["stats"].get("kv_bytes_received", 0) for d in ds) > 0
    assert all(d["stats"].get("kv_fallbacks", 0) == 0 for d in ds)


def test_models_health_metrics(cluster, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = httpx.get(f"{cluster.url}/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    m = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    for series in ("pd_requests_total{outcome=\"success\"}", "vllm:time_to_first_token_seconds",
                   "vllm:inter_token_latency_seconds", "vllm:kv_cache_usage_perc",
                   "vllm:num_requests_waiting", "pd_requests_inflight", "pd_engine_healthy",
                   "pd_engine_kv_bytes_sent_total"):
        assert series in m, series
    assert "Engine stat" not in m and "pd_cluster_" not in m  # one name, a help that says


BAD_INPUTS = [  # (body or raw bytes, path, status, param)
    (b"{not json", "/v1/completions", 400, None),
    (b"[1, 2]", "/v1/completions", 400, None),
    ({"model": MODEL}, "/v1/completions", 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, "/v1/completions", 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "/v1/completions", 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, "/v1/completions", 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, "/v1/completions", 400, "top_p"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, "/v1/completions", 400, "n"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, "/v1/completions", 400, "max_tokens"),
    ({"model": MODEL, "prompt": 123}, "/v1/completions", 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "stream": "yes"}, "/v1/completions", 400, "stream"),
    ({"model": MODEL, "prompt": [1, 2, 99999]}, "/v1/completions", 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, "/v1/completions", 400, "prompt"),
    ({"model": MODEL, "prompt": "hi " * 1500}, "/v1/completions", 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 5000}, "/v1/completions", 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "suffix": "!"}, "/v1/completions", 400, "suffix"),
    ({"model": MODEL, "prompt": "hi", "best_of": 2}, "/v1/completions", 400, "best_of"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0, "echo": False}, "/v1/completions", 400,
     "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "presence_penalty": 5}, "/v1/completions", 400,
     "presence_penalty"),
    ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, "/v1/completions", 400,
     "repetition_penalty"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, "/v1/completions", 400,
     "logit_bias"),
    ({"model": "gpt-4", "prompt": "hi"}, "/v1/completions", 404, "model"),
    ({"model": MODEL, "messages": []}, "/v1/chat/completions", 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
     "/v1/chat/completions", 400, "messages"),
    ({"model": MODEL, "messages": "hi"}, "/v1/chat/completions", 400, "messages"),
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]},
     "/v1/chat/completions", 404, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]},
     "/v1/chat/completions", 400, "messages"),
]


def test_image_content_is_a_400_that_says_images_are_not_supported(cluster) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        "messages.content: content part 0 has type 'input_audio': only text content is "
        "supported (images, audio, video and files are not)")


def test_bad_inputs_are_clean_4xx(cluster, client) -> None:
    with httpx.Client(base_url=cluster.url, timeout=30) as http:
        for body, path, status, param in BAD_INPUTS:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(path, content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["type"] == "invalid_request_error" and err["message"]
            if param is not None:
                assert err["param"] == param, (body, err)
        assert http.get("/health").status_code == 200
    st = wait_idle(cluster.url)
    assert all(e["healthy"] and e["last_error"] is None for e in st["engines"])
    assert client.completions.create(model=MODEL, prompt="still fine", max_tokens=4).usage


def test_over_limit_is_429_and_disconnect_aborts(cluster) -> None:
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 900, "temperature": 0,
            "ignore_eos": True, "stream": True}

    async def run() -> int:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
            streams = []
            for _ in range(MAX_INFLIGHT):  # hold every in-flight slot with an open stream
                req = http.build_request("POST", "/v1/completions", json=body)
                resp = await http.send(req, stream=True)
                assert resp.status_code == 200
                streams.append(resp)
            lines = streams[0].aiter_lines()  # keep a reference: dropping it closes the stream
            assert (await lines.__anext__()).startswith("data: ")
            over = await http.post("/v1/completions", json={**body, "stream": False})
            for resp in streams:  # client goes away mid-stream
                await resp.aclose()
            assert over.json()["error"]["code"] == "rate_limit_exceeded"
            assert int(over.headers["Retry-After"]) >= 1
            return over.status_code

    assert asyncio.run(run()) == 429
    wait_idle(cluster.url, timeout=30)  # the disconnects aborted the requests on both engines
