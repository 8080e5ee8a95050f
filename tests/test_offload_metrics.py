"""The engines' KV offloading stats (issue 32) as an operator sees them: /metrics series per engine
and tier (vLLM's names where vLLM has them, pd_kv_offload_* otherwise, no pd_engine_ twin), and
a tier line per engine in `pd-cluster status`. Fake engine stats; no Ray, no model."""
from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.observability.offload_series import tier_line

MIB = 1 << 20


def _tier_stats(**over: float) -> dict[str, float]:
    stats = {"kv_offload_host_blocks_total": 512, "kv_offload_host_blocks_used": 128,
             "kv_offload_disk_blocks_used": 300, "kv_offload_hit_blocks_host": 40,
             "kv_offload_hit_blocks_disk": 6, "kv_offload_saved_blocks_host": 400,
             "kv_offload_saved_blocks_disk": 310, "kv_offload_evicted_blocks_host": 272,
             "kv_offload_evicted_blocks_disk": 10, "kv_offload_bytes_saved_host": 400 * MIB,
             "kv_offload_bytes_saved_disk": 310 * MIB, "kv_offload_bytes_restored_host": 40 * MIB,
             "kv_offload_bytes_restored_disk": 6 * MIB, "kv_offload_restore_seconds": 0.25,
             "kv_offload_disk_misses": 2, "kv_offload_disk_write_errors": 1,
             "kv_offload_disk_unsafe_files": 4}
    return {**stats, **over}


def _engine(name: str, stats: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(name=name, role=name.split("-")[0], healthy=True, inflight=0,
                           stats={"num_running": 1, "kv_blocks_total": 64, **stats})


def test_offload_series_per_engine_and_tier() -> None:
    engines = [_engine("decode-0", _tier_stats(kv_offload_new_thing=3)),
               _engine("prefill-0", {})]
    text = ProxyMetrics(lambda: engines, "m").render().decode()
    vl, pl = 'engine="decode-0",model_name="m"', 'engine="decode-0",role="decode"'
    for series in (f'vllm:kv_offload_tiering_block_hits_total{{{vl},tier="host"}} 40.0',
                   f'vllm:kv_offload_tiering_block_hits_total{{{vl},tier="disk"}} 6.0',
                   f'vllm:kv_offload_load_bytes_total{{{vl},tier="host"}} 4.194304e+07',
                   f'vllm:kv_offload_load_bytes_total{{{vl},tier="disk"}} 6.291456e+06',
                   f'vllm:kv_offload_store_bytes_total{{{vl},tier="host"}} 4.194304e+08',
                   f'vllm:kv_offload_block_eviction_total{{{vl},tier="host"}} 272.0',
                   f'vllm:kv_offload_load_time_total{{{vl}}} 0.25',
                   f'vllm:kv_offload_cpu_cache_usage_perc{{{vl}}} 0.25',
                   f'pd_kv_offload_saved_blocks_total{{{pl},tier="disk"}} 310.0',
                   f'pd_kv_offload_blocks_used{{{pl},tier="host"}} 128.0',
                   f'pd_kv_offload_blocks_used{{{pl},tier="disk"}} 300.0',
                   f'pd_kv_offload_host_blocks_total{{{pl}}} 512.0',
                   f'pd_kv_offload_disk_misses_total{{{pl}}} 2.0',
                   f'pd_kv_offload_disk_write_errors_total{{{pl}}} 1.0',
                   f'pd_kv_offload_disk_unsafe_files_total{{{pl}}} 4.0',
                   f'pd_kv_offload_new_thing{{{pl}}} 3.0'):  # a stat not described yet
        assert series in text, series
    # an engine without tiers has none of these series; no stat is exported twice
    assert 'engine="prefill-0",model_name="m",tier=' not in text
    assert "pd_engine_kv_offload" not in text
    helps = [ln for ln in text.splitlines() if ln.startswith("# HELP") and "offload" in ln]
    undescribed = [h for h in helps if "not described yet" in h]
    assert len(helps) == 13 and undescribed == [
        "# HELP pd_kv_offload_new_thing Engine stat kv_offload_new_thing (not described yet in "
        "serving/observability/offload_series.py)"]


def test_status_tier_line() -> None:
    assert tier_line({"num_running": 0}) is None  # no tier: no line
    assert tier_line(_tier_stats()) == (
        "host 128/512 blocks; disk 300 blocks; hits (blocks): host 40, disk 6; "
        "restored: host 40.0 MiB, disk 6.0 MiB")
    host_only = _tier_stats(kv_offload_disk_blocks_used=0, kv_offload_saved_blocks_disk=0)
    assert tier_line(host_only).startswith("host 128/512 blocks; hits (blocks)")


def test_pd_cluster_status_prints_a_tier_line_per_engine_with_tiers(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import httpx

    from pd_cluster.serving.cluster.cli_cluster import run_status
    body = {"mode": "disaggregated", "model": "tiny", "inflight": 0, "proxy": {},
            "engines": [{"name": n, "role": n.split("-")[0], "healthy": True, "inflight": 0,
                         "restarts": 0, "pid": 7, "stats": s}
                        for n, s in (("prefill-0", {}), ("decode-0", _tier_stats()))]}
    reply = SimpleNamespace(status_code=200, json=lambda: body)
    monkeypatch.setattr(httpx, "get", lambda *a, **kw: reply)
    args = argparse.Namespace(url="http://proxy", namespace="t", config=None, json=False)
    assert run_status(args) == 0
    lines = capsys.readouterr().out.splitlines()
    tiers = [ln for ln in lines if "KV tiers" in ln]
    assert tiers == ["decode-0 KV tiers: " + tier_line(_tier_stats())]


def test_every_offload_stat_of_a_real_engine_has_a_described_series(tmp_path) -> None:
    """An engine with a host and a disk tier reports only kv_offload_* stats the tables name
    (a new one would still be exported, but undescribed)."""
    from pd_cluster import LLM
    from pd_cluster.serving.observability.offload_series import _KNOWN, PREFIX
    with LLM(num_kv_blocks=16, kv_offloading_size=0.001,
             kv_offloading_disk={"path": str(tmp_path / "kv"), "size": 0.001}) as llm:
        keys = {k for k in llm.engine.stats() if k.startswith(PREFIX)}
    assert "kv_offload_hit_blocks_disk" in keys and keys <= _KNOWN, keys - _KNOWN
