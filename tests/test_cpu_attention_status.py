"""A CPU engine whose C++ kernels failed to build says so: in its stats (``cpu_kernels``), on
/metrics (``pd_engine_cpu_kernels_loaded``) and in ``pd-cluster status``; under
``attention_backend: auto`` it serves with the torch attention, with ``cpu`` named it does
not start."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from kernels import cpu_build
from pd_cluster import LLM, SamplingParams

FAILED = {"ok": False, "error": "RuntimeError: Error building extension (no compiler)"}


def test_engine_reports_a_failed_build_and_serves_with_torch(monkeypatch) -> None:
    monkeypatch.setattr(cpu_build, "_state", dict(FAILED))  # this process's one attempt
    with LLM(num_kv_blocks=16) as llm:
        assert llm.engine.runner.backend.name == "torch"
        out = llm.generate("hello", SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2
        stats = llm.engine.stats()
        llm.engine.check_no_leaks()
    assert stats["cpu_kernels"] == f"failed: {FAILED['error']}"
    assert stats["cpu_kernels_loaded"] == 0


def test_named_cpu_backend_with_a_failed_build_does_not_start(monkeypatch) -> None:
    monkeypatch.setattr(cpu_build, "_state", dict(FAILED))
    with pytest.raises(RuntimeError, match="C\\+\\+ kernel is unavailable.*no compiler"):
        LLM(num_kv_blocks=16, attention_backend="cpu")


@pytest.mark.skipif(cpu_build.disabled_by_env(), reason="PD_CLUSTER_CPU_KERNELS=0")
def test_engine_reports_loaded_kernels() -> None:
    assert cpu_build.load_cpu_kernels(), cpu_build.load_error()
    with LLM(num_kv_blocks=16) as llm:
        stats = llm.engine.stats()
    assert (stats["cpu_kernels"], stats["cpu_kernels_loaded"]) == ("ok", 1)


def _engines() -> list[SimpleNamespace]:
    return [SimpleNamespace(name=name, role=name.split("-")[0], healthy=True, inflight=0,
                            stats=stats)
            for name, stats in (
                ("prefill-0", {"cpu_kernels": "ok", "cpu_kernels_loaded": 1}),
                ("decode-0", {"cpu_kernels": f"failed: {FAILED['error']}",
                              "cpu_kernels_loaded": 0}))]


def test_metrics_gauge() -> None:
    from pd_cluster.serving.observability.metrics import ProxyMetrics
    text = ProxyMetrics(_engines, "m").render().decode()
    assert 'pd_engine_cpu_kernels_loaded{engine="prefill-0",role="prefill"} 1.0' in text
    assert 'pd_engine_cpu_kernels_loaded{engine="decode-0",role="decode"} 0.0' in text
    assert "not described yet" not in text


def test_status_prints_a_line_per_engine_without_its_kernels(monkeypatch, capsys) -> None:
    import httpx

    from pd_cluster.serving.cluster.cli_cluster import run_status
    body = {"mode": "disaggregated", "model": "tiny", "inflight": 0, "proxy": {},
            "engines": [{"name": e.name, "role": e.role, "healthy": True, "inflight": 0,
                         "restarts": 0, "pid": 7, "stats": e.stats} for e in _engines()]}
    reply = SimpleNamespace(status_code=200, json=lambda: body)
    monkeypatch.setattr(httpx, "get", lambda *a, **kw: reply)
    args = argparse.Namespace(url="http://proxy", namespace="t", config=None, json=False)
    assert run_status(args) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "CPU kernels" in ln]
    assert lines == [f"decode-0 CPU kernels failed: {FAILED['error']} (running the slower "
                     f"torch attention)"]
