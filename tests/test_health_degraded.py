"""A 1P1D cluster on one machine that loses every engine of one role: /health says `degraded`
and which role is gone, and the other role serves whole requests (the same greedy answer).

One cluster serves both cases (a cluster's launch is most of this file's time): it loses its
decode engine, gets a new one (/admin/scale: /health is `ok` again), then loses its prefill
engine."""
from __future__ import annotations

import os
import re
from typing import Any

import httpx
import pytest
import ray

from pd_cluster.serving.cluster.testing import ensure_ray, local_config, wait_until

PROMPT = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 12,
          "temperature": 0}


pytestmark = pytest.mark.timeout(900)  # a Ray cluster, engines killed and one added


def _health(url: str) -> tuple[int, dict[str, Any]]:
    h = httpx.get(f"{url}/health", timeout=10)
    return h.status_code, h.json()


def _lose_every(url: str, engine: Any, gone: str, serving: str, answer: str) -> None:
    """Kill the one engine of role ``gone``: degraded naming it, ``serving`` answers alone."""
    ray.kill(engine, no_restart=True)

    def degraded() -> dict | None:
        body = _health(url)[1]
        return body if body["status"] == "degraded" else None
    body = wait_until(degraded, 30, f"/health degraded after losing {gone}")
    assert body["engines"] == {serving: True, gone: False}
    after = httpx.post(f"{url}/v1/completions", json=PROMPT, timeout=60)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["text"] == answer
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf'^pd_degraded_requests_total{{[^}}]*reason="no_{gone}"[^}}]*}} (\S+)$',
                  metrics, re.M)
    assert m and float(m.group(1)) == 1.0, metrics


def test_health_is_degraded_naming_the_lost_role(tmp_path, monkeypatch) -> None:
    from pd_cluster.serving.cluster.launcher import launch
    monkeypatch.setenv("PD_CLUSTER_STATE_DIR", str(tmp_path))
    ensure_ray()
    cfg = local_config("local", f"test-degraded-{os.getpid()}",
                       engine={"num_kv_blocks": 128, "max_model_len": 256},
                       proxy={"health_check_interval": 0.3, "request_timeout": 60.0})
    cluster = launch(cfg, progress=False)
    try:
        url = cluster.url
        ok = (200, {"status": "ok", "engines": {"prefill": True, "decode": True}})
        assert _health(url) == ok
        answer = httpx.post(f"{url}/v1/completions", json=PROMPT, timeout=60).json()
        answer = answer["choices"][0]["text"]
        _lose_every(url, cluster.engines["decode-0"], "decode", "prefill", answer)
        # A new decode engine: whole again (the dead one still counts as one: ask for two).
        r = httpx.post(f"{url}/admin/scale", json={"decode": 2}, timeout=300)
        assert r.status_code == 200 and r.json()["done"] == ["added decode-1 (decode)"], r.text
        wait_until(lambda: _health(url) == ok, 60, "/health ok with decode-1")
        _lose_every(url, cluster.engines["prefill-0"], "prefill", "decode", answer)
    finally:
        cluster.shutdown()
