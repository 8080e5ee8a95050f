"""The SLO controller inside the proxy (planner.enabled): the proxy starts its thread over its
own actuator, feeds it every admitted request and every finished one (prompt and output
lengths, TTFT, TPOT), and stops it on shutdown. A fake engine behind the real app."""
from __future__ import annotations

from pd_cluster.serving.cluster.cluster_config import parse_config
from tests.test_api_auth import _run
from tests.test_planner import synthetic_profile


def test_proxy_feeds_and_stops_the_controller(tmp_path) -> None:
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
        finally:
            state.stop_planner()
        assert state.planner_window is None and not loop._thread.is_alive()
    _run(cfg, body)


def test_without_planner_nothing_runs() -> None:
    cfg = parse_config({"mode": "colocated", "colocated": {"replicas": 1},
                        "proxy": {"port": 0, "request_timeout": 30.0}})

    async def body(app, http, engine, submitted) -> None:
        state = app.state.proxy
        state.start_planner()
        assert state.planner_window is None
        r = await http.post("/v1/completions", json={
            "model": cfg.model_name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        state.stop_planner()
    _run(cfg, body)
