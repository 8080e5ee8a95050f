"""The launcher makes the proxy actor beside the engines (its process and libraries load while
they do) and has it serve once they are ready; an actor Ray restarts serves at once."""
from __future__ import annotations

from typing import Any

import httpx
import pytest

from pd_cluster.serving.cluster import proxy_actor
from pd_cluster.serving.cluster.proxy_actor import ProxyActor

CONFIG = {"mode": "colocated", "colocated": {"replicas": 1},
          "proxy": {"host": "127.0.0.1", "port": 0, "log_stats_interval": 0}}


def test_a_deferred_proxy_serves_only_when_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_actor, "_restarted", lambda: False)
    proxy = ProxyActor(CONFIG, [], "unused", {}, False, True)
    try:
        with pytest.raises(RuntimeError, match="has not started serving"):
            proxy.url()
        with pytest.raises(RuntimeError, match="down"):
            proxy.health()
        assert proxy.shutdown_timeout() == 0.0 and proxy.drain()["in_flight"] == 0
        url = proxy.start()
        assert proxy.start() == url == proxy.url() and proxy.health()  # once
        with httpx.Client(timeout=10) as http:
            assert http.get(f"{url}/v1/models").status_code == 200
    finally:
        proxy.stop()


def test_a_restarted_deferred_proxy_serves_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_actor, "_restarted", lambda: True)
    proxy: Any = ProxyActor(CONFIG, [], "unused", {}, False, True)
    try:
        assert proxy.url().startswith("http://127.0.0.1:") and proxy.health()
    finally:
        proxy.stop()


def test_a_proxy_never_started_stops_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_actor, "_restarted", lambda: False)
    ProxyActor(CONFIG, [], "unused", {}, False, True).stop()  # the launch failed before start
