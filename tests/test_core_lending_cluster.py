"""Core sharing in a launched 1P1D cluster on one node, with the compiled step as shipped
(the suite's other tests run eager): the prefill engine borrows the decode engine's core for
its prefill steps (pinned engines, the default), the decode engine the idle prefill engine's
for its decode steps (cpu.lend_prefill_cores, on here); a lent step runs one more thread,
eagerly, and every output stays exactly the offline engine's; nothing is left held."""
from __future__ import annotations

import os
import random

import httpx
import pytest

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    from tests.launch_helpers import launched_cluster
    yield from launched_cluster(tmp_path_factory, "local", "core-lending",
                                engine={"num_kv_blocks": 256, "max_model_len": 512,
                                        "compile": True},
                                proxy={"disaggregation": "always",
                                       "slo": {"tpot_ms": 1000.0}},
                                cpu={"lend_prefill_cores": True})


def test_each_engine_borrows_the_others_core_and_outputs_stay_exact(cluster) -> None:
    import ray

    from pd_cluster import LLM
    from pd_cluster import SamplingParams as SP
    from pd_cluster.serving.cluster.cluster_config import resolve_model
    from pd_cluster.serving.cluster.testing import cluster_status, leak_reports, wait_idle

    setups = {name: ray.get(h.cpu_setup.remote(), timeout=60)
              for name, h in cluster.engines.items()}
    if not all(s["cores"] for s in setups.values()):
        pytest.skip(f"engines not pinned here (cores held by other processes): {setups}")
    # One thread each; a lent step runs with a second, on the other engine's core.
    assert setups["prefill-0"]["torch_threads"] == 1 == setups["decode-0"]["torch_threads"]
    rng = random.Random(7)
    offline = LLM(model=resolve_model("tiny-llama"), num_kv_blocks=256, max_model_len=512)
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(200, 400))] for _ in range(6)]
    with httpx.Client(base_url=cluster.url, timeout=120) as http:
        for prompt in prompts:
            r = http.post("/v1/completions", json={
                "model": "tiny-llama", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            ref = offline.generate([prompt], SP(temperature=0, max_tokens=16,
                                                ignore_eos=True))[0].outputs[0].token_ids
            assert r.json()["choices"][0]["token_ids"] == list(ref)
    wait_idle(cluster.url)
    stats = {e["name"]: e["stats"] for e in cluster_status(cluster.url)["engines"]}
    assert stats["prefill-0"]["lend_borrowed_steps"] >= 1, stats["prefill-0"]
    # One request at a time: P has no prompt while D decodes, so D's steps run on P's core.
    assert stats["decode-0"]["lend_borrowed_steps"] >= 1, stats["decode-0"]
    assert "lend_revokes" in stats["decode-0"] and "lend_revokes" in stats["prefill-0"]
    assert leak_reports(cluster) == {}
    assert os.sched_getaffinity(0)  # the test process itself is untouched
