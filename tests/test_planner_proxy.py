"""The SLO controller inside the proxy (planner.enabled): the proxy starts its thread over its
own actuator, feeds it every admitted request and every finished one (prompt and output
lengths, TTFT, TPOT), and stops it on shutdown; /cluster/status and `pd-cluster status`
show the plan in force (or that the planner is off). A fake engine behind the real app."""
from __future__ import annotations

import argparse

import httpx

from pd_cluster.planner.status import status_lines
from pd_cluster.serving.cluster.cli_cluster import run_status
from pd_cluster.serving.cluster.cluster_config import parse_config
from tests.test_api_auth import _run
from tests.test_planner import synthetic_profile


class _Reply:
    """httpx.get's reply for run_status: the body the app served."""
    def __init__(self, body: dict) -> None:
        self.status_code, self._body = 200, body

    def json(self) -> dict:
        return self._body


def _cli_status(monkeypatch, capsys, body: dict) -> list[str]:
    """`pd-cluster status --url ...` over ``body`` (what /cluster/status answered)."""
    monkeypatch.setattr(httpx, "get", lambda url, **kw: _Reply(body))
    args = argparse.Namespace(namespace=None, config=None, url="http://proxy", json=False)
    assert run_status(args) == 0
    return capsys.readouterr().out.splitlines()


def test_proxy_feeds_and_stops_the_controller(tmp_path, monkeypatch, capsys) -> None:
    path = tmp_path / "profile.json"
    synthetic_profile().save(path)
    cfg = parse_config({"mode": "colocated", "colocated": {"replicas": 1},
                        "proxy": {"port": 0, "request_timeout": 30.0},
                        "planner": {"enabled": True, "profile": str(path),
                                    "interval_s": 3600}})

    async def body(app, http, engine, submitted) -> None:
        state = app.state.proxy
        state.start_planner()  # the app's lifespan does this (the test transport skips it)
        try:
            window, loop = state.planner_window, state._planner_loop
            assert window is not None and loop._thread.is_alive()
            for _ in range(3):
                r = await http.post("/v1/completions", json={
                    "model": cfg.model_name, "prompt": "hello there", "max_tokens": 4})
                assert r.status_code == 200, r.text
            obs = window.observe()
            assert len(obs.arrived) == 3 and all(mt == 4 for _, mt in obs.arrived)
            assert len(obs.finished) == 3
            done = obs.finished[0]
            assert done.output_len >= 1 and done.ttft >= 0
            status = (await http.get("/cluster/status")).json()["planner"]
            assert status["enabled"] and status["engines"] == {"colocated": {"serving": 1}}
            assert status["targets"]["ttft_ms"] == cfg.proxy.slo.ttft_ms
            assert status["targets"]["interval_s"] == 3600 and status["last"] is None
            printed = _cli_status(monkeypatch, capsys, {**(await http.get(
                "/cluster/status")).json()})
            assert [x for x in printed if x.startswith("planner")] == status_lines(status)
            assert "planner last decision: none yet" in printed
        finally:
            state.stop_planner()
        assert state.planner_window is None and not loop._thread.is_alive()
    _run(cfg, body)


def test_without_planner_nothing_runs(monkeypatch, capsys) -> None:
    cfg = parse_config({"mode": "colocated", "colocated": {"replicas": 1},
                        "proxy": {"port": 0, "request_timeout": 30.0}})

    async def body(app, http, engine, submitted) -> None:
        state = app.state.proxy
        state.start_planner()
        assert state.planner_window is None
        r = await http.post("/v1/completions", json={
            "model": cfg.model_name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        body = (await http.get("/cluster/status")).json()
        assert body["planner"] == {"enabled": False}
        printed = [x for x in _cli_status(monkeypatch, capsys, body) if "planner" in x]
        assert printed == ["planner: off (planner.enabled: false); the engines stay as scaled"]
        state.stop_planner()
    _run(cfg, body)
