"""A 1P1D cluster from configs/local.yaml behind the proxy, driven by the official openai client.

One module-scoped cluster serves every test here; each test leaves it idle and healthy.
"""
from __future__ import annotations

import asyncio
import json
import os

import httpx
import openai
import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.serving.cluster_config import resolve_model
from pd_cluster.serving.testing import ensure_ray, local_config, wait_idle

MODEL = "tiny-llama"
PROMPTS = ["Hello world, this is", "The quick brown fox jumps over", "Once upon a time",
           "In a distant land there lived a"]
MAX_INFLIGHT = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    mp.setenv("PD_CLUSTER_STATE_DIR", str(tmp_path_factory.mktemp("state")))
    from pd_cluster.serving.launcher import launch

    ensure_ray()
    cfg = local_config("local", f"test-openai-{os.getpid()}",
                       engine={"num_kv_blocks": 512, "max_model_len": 1024},
                       kv_transfer={"kv_transfer_timeout": 5.0},
                       proxy={"max_inflight": MAX_INFLIGHT, "request_timeout": 60.0})
    c = launch(cfg, progress=False)
    yield c
    c.shutdown()
    mp.undo()


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
    if stop:
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0,
                                      stop=[stop])
        assert r.choices[0].text == reference(offline, ids, 30, stop=[stop])[0]
        assert r.choices[0].finish_reason == "stop"
    # Seeded sampling works and is reproducible.
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0.9,
                                  seed=7, extra_body={"return_token_ids": True})
    assert len(a.choices[0].token_ids) == 12  # type: ignore[attr-defined]


def test_kv_really_moved_from_p_to_d(cluster) -> None:
    st = wait_idle(cluster.url)
    p, d = (next(e for e in st["engines"] if e["role"] == r) for r in ("prefill", "decode"))
    assert p["stats"]["requests_total"] > 0 and d["stats"]["requests_total"] > 0
    if d["kv_endpoint"] is not None:  # the KV connector is in: D must not prefill by itself
        assert d["stats"].get("kv_bytes_received", 0) > 0
        assert d["stats"].get("kv_fallbacks", 0) == 0


def test_models_health_metrics(cluster, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = httpx.get(f"{cluster.url}/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    m = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    for series in ("pd_requests_total{outcome=\"success\"}", "pd_time_to_first_token_seconds",
                   "pd_inter_token_latency_seconds", "pd_engine_kv_blocks_used",
                   "pd_engine_num_waiting", "pd_requests_inflight", "pd_engine_healthy"):
        assert series in m, series


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
    ({"model": MODEL, "prompt": "hi", "echo": True}, "/v1/completions", 400, "echo"),
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
]


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
            return over.status_code

    assert asyncio.run(run()) == 429
    wait_idle(cluster.url, timeout=30)  # the disconnects aborted the requests on both engines


def test_what_real_clients_send(cluster, client, offline) -> None:
    """Unknown fields are ignored (vLLM's behaviour), continuous usage stats, cached tokens."""
    url = cluster.url
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
            "store": True, "metadata": {"run": "x"}, "service_tier": "auto",
            "parallel_tool_calls": False}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 4 and "cached_tokens" in usage["prompt_tokens_details"]
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c.usage.completion_tokens for c in stream if c.choices and c.usage]
    assert counts and counts == sorted(counts) and counts[-1] == 6
    assert client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4,
                                     temperature=0).choices[0].text == r.json()["choices"][0]["text"]
    wait_idle(url)


def test_tokenize_detokenize_version_and_openai_shaped_404_405(cluster) -> None:
    url = cluster.url
    with httpx.Client(base_url=url, timeout=30) as http:
        tok = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
        assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
        text = http.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()
        assert "Hello world" in text["prompt"]
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.json()["count"] > 1
        assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
        assert http.get("/version").json()["version"]
        for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
            r = http.request(method, path)
            assert r.status_code == status
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_n_choices_and_lists_of_prompts(cluster, client, offline) -> None:
    """n>1 (greedy choices identical, seeded ones distinct and reproducible) and several
    prompts in one completions request, each choice equal to its own request."""
    tok = offline.engine.tokenizer
    ref_text = reference(offline, tok.encode(PROMPTS[0]), 8)[0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [ref_text] * 3
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(tok.encode(PROMPTS[0]))

    def sampled() -> list[str]:
        out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12,
                                        temperature=1.0, seed=42, n=3)
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    first = sampled()
    assert first == sampled() and len(set(first)) > 1

    batch = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=6,
                                      temperature=0)
    assert [c.text for c in batch.choices] == [
        reference(offline, tok.encode(p), 6)[0] for p in PROMPTS[:3]]

    stream = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=5,
                                       temperature=0, n=2, stream=True,
                                       stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finished, usage = set(), None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert finished == {0, 1, 2, 3}
    assert [texts[i] for i in range(4)] == [reference(offline, tok.encode(p), 5)[0]
                                            for p in PROMPTS[:2] for _ in range(2)]
    assert usage.completion_tokens == 20
    assert usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS[:2])
    wait_idle(cluster.url)


def test_penalties_and_logit_bias_match_the_engine(cluster, client, offline) -> None:
    """Through P/D (P samples the first token, D the rest) the output equals one engine's."""
    tok = offline.engine.tokenizer
    ids = tok.encode(PROMPTS[2])
    for kw in ({"presence_penalty": 1.5, "frequency_penalty": 0.7},
               {"repetition_penalty": 1.8}, {"logit_bias": {"42": 100.0}}):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16,
                                      temperature=0, extra_body={"ignore_eos": True,
                                                                 "return_token_ids": True,
                                                                 **({k: v for k, v in kw.items()
                                                                     if k == "repetition_penalty"})},
                                      **{k: v for k, v in kw.items()
                                         if k != "repetition_penalty"})
        engine_kw = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v)
                     for k, v in kw.items()}
        want = offline.generate([ids], SamplingParams(temperature=0, max_tokens=16,
                                                      ignore_eos=True, **engine_kw))[0]
        got = r.choices[0].token_ids  # type: ignore[attr-defined]
        assert got == list(want.outputs[0].token_ids), kw
        if "logit_bias" in kw:
            assert got == [42] * 16
    plain = reference(offline, ids, 16, ignore_eos=True)[1]
    assert plain != [42] * 16
    wait_idle(cluster.url)



def test_logprobs_completions_and_chat(cluster, client, offline) -> None:
    """Token logprobs through P/D (the first token's from P, the rest from D) equal one
    engine's, in the completions and the chat shapes, streamed or not."""
    tok = offline.engine.tokenizer
    ids = tok.encode(PROMPTS[3])
    want = offline.generate([ids], SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                  ignore_eos=True))[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=6, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in want.token_ids]
    for got, ref, top, t in zip(lp.token_logprobs, want.logprobs, lp.top_logprobs,
                                want.token_ids):
        assert abs(got - ref[t]) < 1e-4 and len(top) >= 3
    assert lp.text_offset[0] == 0
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=6,
                                         temperature=0, logprobs=3, stream=True,
                                         extra_body={"ignore_eos": True})
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [x for c in chunks for x in c.token_logprobs] == pytest.approx(lp.token_logprobs,
                                                                          abs=1e-6)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": "Hello"}],
                                          max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    wait_idle(cluster.url)
