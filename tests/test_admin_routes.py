"""The scaling admin routes and the LiveActuator without Ray (a fake engine behind the real
proxy app): keyed like every route, open only on loopback without keys, bad input a 400
naming the field; the controller's blocking calls from another thread; an engine that does
not fit asks Ray's autoscaler where there is one, and fails clearly where there is not."""
from __future__ import annotations

import asyncio
import json

import pytest

from pd_cluster.serving.cluster.engine_starter import EngineStarter, ScaleError, missing
from pd_cluster.planner.actuator import EngineView  # the controller reads its load
from tests.test_api_auth import _config, _run


def test_admin_routes_want_the_key() -> None:
    cfg = _config(api_key="admin-key")
    auth = {"Authorization": "Bearer admin-key"}

    async def body(app, http, engine, submitted) -> None:
        assert (await http.post("/admin/scale", json={"colocated": 2})).status_code == 401
        assert (await http.get("/admin/engines")).status_code == 401
        assert (await http.post("/admin/switch_role", json={"engine": engine.name,
                                                            "role": "decode"})).status_code == 401
        ok = await http.get("/admin/engines", headers=auth)
        assert ok.status_code == 200
        assert ok.json()["engines"] == [{"id": engine.name, "role": "colocated", "load": 0.0,
                                         "state": "serving"}]
        bad = await http.post("/admin/scale", json={"colocated": 0}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "colocated"
        assert "at least 1 colocated engine" in bad.json()["error"]["message"]
        bad = await http.post("/admin/scale", json={"prefill": 2}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prefill"
        bad = await http.post("/admin/switch_role", json={"engine": engine.name,
                                                          "role": "prefill"}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "role"
        # no starter (not launched on Ray): adding is a 503 saying so; nothing changed
        no = await http.post("/admin/scale", json={"colocated": 2}, headers=auth)
        assert no.status_code == 503 and "cannot start engines" in no.json()["error"]["message"]
        assert [e.id for e in app.state.proxy.actuator.engines()] == [engine.name]
        assert not submitted
    _run(cfg, body)


@pytest.mark.parametrize("host, status", [("0.0.0.0", 403), ("127.0.0.1", 200)])
def test_without_keys_admin_routes_answer_on_loopback_only(host: str, status: int) -> None:
    async def body(app, http, engine, submitted) -> None:
        assert (await http.get("/admin/engines")).status_code == status
    _run(_config(host=host), body)


def test_the_controllers_blocking_calls_run_on_the_proxys_loop() -> None:
    async def body(app, http, engine, submitted) -> None:
        actuator = app.state.proxy.actuator
        actuator.bind(asyncio.get_running_loop())  # as the app's lifespan does
        assert actuator.engines() == [EngineView(engine.name, "colocated", "serving")]
        with pytest.raises(ValueError, match="^colocated: at least 1"):
            await asyncio.to_thread(actuator.scale, "colocated", 0)
        with pytest.raises(ValueError, match="^engine: no engine named"):
            await asyncio.to_thread(actuator.switch_role, "nope", "decode")
        with pytest.raises(RuntimeError, match="await scale_to"):  # would deadlock the loop
            actuator.scale("colocated", 1)
    _run(_config(), body)


def _starter(free: dict[str, float], autoscaler: bool) -> EngineStarter:
    from pd_cluster.serving.cluster.cluster_config import parse_config
    cfg = parse_config({"prefill": {"num_cpus": 2}, "decode": {"num_cpus": 1}})
    return EngineStarter(cfg, "ns", None, has_autoscaler=lambda: autoscaler,
                         free_resources=lambda: free, ready_timeout=5.0, autoscale_timeout=7.0)


def test_an_engine_that_does_not_fit_asks_the_autoscaler(monkeypatch) -> None:
    import ray.autoscaler.sdk as sdk
    asked: list = []
    monkeypatch.setattr(sdk, "request_resources", lambda **kw: asked.append(kw))
    assert missing({"CPU": 4.0}, {"CPU": 3.0}) == {"CPU": 1.0}
    assert _starter({"CPU": 8.0}, autoscaler=True).make_room("prefill", 2) == 5.0  # fits
    assert asked == []
    wait = _starter({"CPU": 1.0}, autoscaler=True).make_room("prefill", 2)
    assert wait == 12.0  # the autoscaler's bound and the engines' load
    assert asked == [{"bundles": [{"CPU": 2.0}, {"CPU": 2.0}]}]
    with pytest.raises(ScaleError, match=r"^prefill: no room for 2 more engine\(s\) .*lacks "
                                         r"\{'CPU': 3.0\}.*autoscaler"):
        _starter({"CPU": 1.0}, autoscaler=False).make_room("prefill", 2)


def test_the_autoscaler_is_asked_for_the_whole_cluster(monkeypatch) -> None:
    """request_resources counts resources in use against the request: asking for the new
    engines alone would be met by the nodes the running ones fill, and add nothing."""
    import ray.autoscaler.sdk as sdk
    asked: list = []
    monkeypatch.setattr(sdk, "request_resources", lambda **kw: asked.append(kw))
    _starter({"CPU": 1.0}, autoscaler=True).make_room("prefill", 1, {"prefill": 2,
                                                                     "decode": 1})
    assert asked == [{"bundles": [{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 1.0}, {"CPU": 2.0}]}]


class _FakeStatus:
    def __init__(self, version: str) -> None:
        self.stats = type("Stats", (), {"autoscaler_version": version})()


# Ray's v1 monitor status: a local instance (read-only provider, node types "node_<id>"),
# and a `ray up` cluster's autoscaler (node types from its config)
_V1_READONLY = json.dumps({"autoscaler_report": {"node_type_mapping": {
    "6c6b3f": "node_6c6b3f", "a1b2c3": "node_a1b2c3"}, "legacy": True}}).encode()
_V1_REAL = json.dumps({"autoscaler_report": {"node_type_mapping": {
    "6c6b3f": "ray.head.default", "a1b2c3": "cpu-worker"}, "legacy": True}}).encode()


@pytest.mark.parametrize("v1, v2_enabled, version, found", [
    (b"{}", False, None, True),  # v1: its monitor's status in the internal KV
    (_V1_READONLY, False, None, False),  # v1's monitor with the read-only provider: none
    (_V1_REAL, False, None, True),  # v1 with node types from a cluster config
    (None, True, "7", True),  # v2: no KV status, a state version reported to the GCS
    (None, True, "0", False),  # v2 enabled, but no autoscaler ever reported
    (None, False, "7", False),  # no autoscaler at all
])
def test_an_autoscaler_is_found_at_either_version(monkeypatch, v1, v2_enabled, version,
                                                  found) -> None:
    import ray
    import ray.autoscaler.v2.sdk as v2_sdk
    import ray.autoscaler.v2.utils as v2_utils
    import ray.experimental.internal_kv as kv

    from pd_cluster.serving.cluster import engine_starter
    monkeypatch.setattr(kv, "_internal_kv_get", lambda key: v1)
    monkeypatch.setattr(v2_utils, "is_autoscaler_v2", lambda fetch_from_server: v2_enabled)
    monkeypatch.setattr(v2_sdk, "get_cluster_status",
                        lambda address, timeout: _FakeStatus(version))
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: type("Ctx", (), {"gcs_address": "10.0.0.1:6379"})())
    assert engine_starter.autoscaler_present() is found
