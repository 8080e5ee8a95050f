"""A 1P1D cluster on one machine that loses every engine of one role: /health says `degraded`
and which role is gone, and the other role serves whole requests (the same greedy answer)."""
from __future__ import annotations

import os
import re

import httpx
import pytest
import ray

from pd_cluster.serving.cluster.testing import ensure_ray, local_config, wait_until

PROMPT = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 12,
          "temperature": 0}


pytestmark = pytest.mark.timeout(900)  # a Ray cluster per case, an engine killed and restarted


@pytest.mark.parametrize("gone, serving", [("decode", "prefill"), ("prefill", "decode")])
def test_health_is_degraded_naming_the_lost_role(tmp_path, monkeypatch, gone: str,
                                                 serving: str) -> None:
    from pd_cluster.serving.cluster.launcher import launch
    monkeypatch.setenv("PD_CLUSTER_STATE_DIR", str(tmp_path))
    ensure_ray()
    cfg = local_config("local", f"test-degraded-{gone}-{os.getpid()}",
                       engine={"num_kv_blocks": 128, "max_model_len": 256},
                       proxy={"health_check_interval": 0.3, "request_timeout": 60.0})
    cluster = launch(cfg, progress=False)
    try:
        url = cluster.url
        h = httpx.get(f"{url}/health", timeout=10)
        assert (h.status_code, h.json()) == (200, {"status": "ok", "engines": {
            "prefill": True, "decode": True}})
        before = httpx.post(f"{url}/v1/completions", json=PROMPT, timeout=60).json()
        ray.kill(cluster.engines[f"{gone}-0"], no_restart=True)  # every engine of that role

        def degraded() -> dict | None:
            body = httpx.get(f"{url}/health", timeout=10).json()
            return body if body["status"] == "degraded" else None
        body = wait_until(degraded, 30, f"/health degraded after losing {gone}-0")
        assert body["engines"] == {serving: True, gone: False}
        after = httpx.post(f"{url}/v1/completions", json=PROMPT, timeout=60)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == before["choices"][0]["text"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        m = re.search(rf'^pd_degraded_requests_total{{[^}}]*reason="no_{gone}"[^}}]*}} (\S+)$',
                      metrics, re.M)
        assert m and float(m.group(1)) == 1.0, metrics
    finally:
        cluster.shutdown()
