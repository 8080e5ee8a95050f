"""A host KV tier on a launched 1P1D cluster (issue 32): a conversation whose history the tiny
device pools evict before it comes back is restored from the engines' host tiers. Its outputs
equal the offline engine's, the returning turn's usage counts cached tokens, /metrics shows the
host hits, and nothing is left held afterwards (device blocks or host slots)."""
from __future__ import annotations

import random
import re

import pytest

from tests.launch_helpers import launched_cluster

POOL_BLOCKS = 16  # x 16 tokens: a history and a few fillers' worth


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    yield from launched_cluster(tmp_path_factory, "local", "offload",
                                engine={"num_kv_blocks": POOL_BLOCKS, "max_model_len": 256,
                                        "kv_offloading_size": 0.01},  # ~320 blocks
                                proxy={"cache_events_interval": 0.1})


def _host_hits(text: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(
        r'^vllm:kv_offload_tiering_block_hits_total\{[^}]*tier="host"\} ([0-9.e+-]+)$', text,
        re.M))


@pytest.mark.timeout(900)  # the module's Ray cluster starts in this test's set-up
def test_an_evicted_history_comes_back_from_the_host_tier_exactly(cluster) -> None:
    import httpx

    from pd_cluster import LLM
    from pd_cluster import SamplingParams as SP
    from pd_cluster.serving.cluster.cluster_config import resolve_model
    from pd_cluster.serving.cluster.testing import (cluster_status, leak_reports, wait_idle,
                                                    wait_until)

    rng = random.Random(5)
    offline = LLM(model=resolve_model("tiny-llama"), num_kv_blocks=256, max_model_len=256)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, 500) for _ in range(n)]

    def ask(http: httpx.Client, prompt: list[int]) -> tuple[list[int], int]:
        r = http.post("/v1/completions", json={
            "model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        got = body["choices"][0]["token_ids"]
        ref = offline.generate([prompt], SP(temperature=0, max_tokens=8, ignore_eos=True))
        assert got == list(ref[0].outputs[0].token_ids)
        return got, body["usage"]["prompt_tokens_details"]["cached_tokens"]

    def reports() -> int:
        return cluster_status(cluster.url)["proxy"]["cache_reports"]

    def host_hits() -> float:
        return sum(e["stats"].get("kv_offload_hit_blocks_host", 0)
                   for e in cluster_status(cluster.url)["engines"])

    history = tokens(64)
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        reply, _ = ask(http, history)
        for _ in range(4):  # 4 x 7 blocks through both engines: the history leaves the device
            ask(http, tokens(96))
        hits_before = host_hits()
        # the engines' reports of the evictions reach the proxy (a round that started after
        # the last filler is in once 2 rounds' worth are): its index has the history below
        seen = reports()
        wait_until(lambda: reports() >= seen + 4, 60.0, "the engines' cache reports")
        history = history + reply + tokens(16)
        _, cached = ask(http, history)
        # the 4 full blocks of the first prompt at least, restored from a host tier
        assert cached >= 64, cached
        lower = sum(float(m.group(1)) for m in re.finditer(
            r'^pd_route_lower_tier_prompt_tokens_total\{role="\w+"\} ([0-9.e+-]+)$',
            http.get("/metrics").text, re.M))
        assert lower >= 64  # routed knowing the history is in a lower tier
        wait_until(lambda: host_hits() >= hits_before + 4, 30.0, "the host tier's hits")
        wait_until(lambda: _host_hits(http.get("/metrics").text) >= 4, 30.0,
                   "host hits on /metrics")
    wait_idle(cluster.url)
    assert leak_reports(cluster) == {}
