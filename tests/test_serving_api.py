"""The API surface real clients use, through a P/D cluster and the official openai client:
unknown fields, continuous usage, /tokenize and friends, n>1 and prompt lists, penalties,
logit_bias and logprobs."""
from __future__ import annotations

import re

import httpx
import pytest

from pd_cluster import SamplingParams
from pd_cluster.serving.cluster.testing import wait_idle
from pd_cluster.serving.cluster.cluster_config import resolve_model
from tests.test_serving_openai import (MODEL, PROMPTS, client, cluster,  # noqa: F401 (fixtures)
                                       offline, reference)


# the serving modules' shared cluster (tests/shared_cluster.py, 1P2D), through
# test_serving_openai's fixture: leak-checked after this module too
pytestmark = pytest.mark.timeout(900)


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


def test_echo_with_prompt_logprobs_equals_hf(cluster, client) -> None:
    """echo + logprobs through P/D (P scores the prompt, D generates) and as lm-eval's
    loglikelihood sends it (token-id prompts in a batch, max_tokens 1 or 0): the prompt's
    logprobs equal HF's log-softmax within 1e-4 and the output follows the echoed prompt."""
    from tests.test_prompt_logprobs import hf_prompt_logprobs
    model_dir = resolve_model(MODEL)
    tok = cluster_tokenizer(model_dir)
    ids = tok.encode(PROMPTS[1])
    want = hf_prompt_logprobs(model_dir, ids)
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5,
                                      temperature=0)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0,
                                  echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == PROMPTS[1] + plain.choices[0].text
    lp = choice.logprobs
    assert lp.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
    assert len(lp.tokens) == len(ids) + 5 and lp.token_logprobs[0] is None
    for p, t in enumerate(ids[1:]):
        assert abs(lp.token_logprobs[p + 1] - want[p, t].item()) < 1e-4
        assert max(lp.top_logprobs[p + 1].values()) >= lp.token_logprobs[p + 1]
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5,
                                              temperature=0, echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert streamed[0].choices[0].text.startswith(PROMPTS[1])
    got = [x for c in streamed if c.choices and c.choices[0].logprobs
           for x in c.choices[0].logprobs.token_logprobs]
    assert got == pytest.approx(lp.token_logprobs, abs=1e-6)
    # lm-eval local-completions: a batch of token-id prompts, echo, logprobs=1, max_tokens=1.
    batch = [tok.encode(p) for p in PROMPTS[:3]]
    for max_tokens in (1, 0):
        r = client.completions.create(model=MODEL, prompt=batch, max_tokens=max_tokens,
                                      temperature=0, echo=True, logprobs=1)
        for ids, c in zip(batch, r.choices):
            want = hf_prompt_logprobs(model_dir, ids)
            assert len(c.logprobs.token_logprobs) == len(ids) + max_tokens
            for p, t in enumerate(ids[1:]):
                assert abs(c.logprobs.token_logprobs[p + 1] - want[p, t].item()) < 1e-4
        assert r.usage.completion_tokens == max_tokens * len(batch)
    wait_idle(cluster.url)


def cluster_tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def test_n_choices_share_one_prefill(cluster, client, offline) -> None:
    """n>1 through P/D: the prompt is prefilled once (by P, or by D alone when the proxy's cost
    model finds that sooner); the other choices run on the decode engine that holds its KV,
    whose prefix cache serves the prompt's full blocks (summed over the decode engines: on
    another D a sibling would find no blocks to hit). Every choice equals the colocated
    engine's for its seed (seed + index)."""
    tok = offline.engine.tokenizer
    ids = (tok.encode(" ".join(PROMPTS)) * 3)[:53]  # 3 full blocks of 16 and a tail of 5

    def engines() -> dict[str, dict]:
        body = httpx.get(f"{cluster.url}/cluster/status", timeout=30).json()
        metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
        shared = re.search(r"^pd_shared_prefills_total (\S+)$", metrics, re.M)
        local = re.findall(r'^pd_disaggregation_decisions_total\{path="local".*\} (\S+)$',
                           metrics, re.M)  # one line per reason
        per_role: dict[str, dict] = {}  # stats summed over a role's engines (two Ds)
        for e in body["engines"]:
            role = per_role.setdefault(e["role"], {})
            for k in ("requests_total", "prefix_cache_hit_blocks"):
                role[k] = role.get(k, 0) + e["stats"][k]
        return {"shared": float(shared.group(1)), "local": sum(map(float, local)), **per_role}
    before = engines()
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0.8,
                                  seed=7, n=4, extra_body={"ignore_eos": True})
    after = engines()
    want = [offline.generate([ids], SamplingParams(temperature=0.8, seed=7 + j, max_tokens=10,
                                                   ignore_eos=True))[0].outputs[0].text
            for j in range(4)]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    prefilled_on_d = after["local"] - before["local"]
    assert prefilled_on_d in (0, 1)
    assert after["prefill"]["requests_total"] - before["prefill"]["requests_total"] \
        == 1 - prefilled_on_d
    assert after["decode"]["requests_total"] - before["decode"]["requests_total"] == 4
    hits = (after["decode"]["prefix_cache_hit_blocks"]
            - before["decode"]["prefix_cache_hit_blocks"])
    assert hits == 3 * 3  # each sibling reused the 3 full blocks P sent (or D computed)
    assert after["shared"] - before["shared"] == 3
    wait_idle(cluster.url)
