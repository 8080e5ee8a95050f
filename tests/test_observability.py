"""What an operator sees: one access-log line per request, a periodic stats line per engine,
and Prometheus series: vLLM's names where vLLM has the series, pd_ for P/D's own."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from pd_cluster.serving.cluster.cluster_config import parse_config
from pd_cluster.serving.routing.legs import StreamEvent
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.request_tracker import RequestTracker
from pd_cluster.serving.observability.stats_log import StatsLog


def _engine(name: str, **stats: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, role=name.split("-")[0], healthy=True, node_ip="10.0.0.7",
                           last_error=None, inflight=0, stats=stats)


def test_access_log_line_and_vllm_named_metrics(caplog) -> None:
    engines = [_engine("decode-0", num_running=3, num_waiting=1, kv_blocks_used=25,
                       kv_blocks_total=100, num_preemptions=2, kv_bytes_sent=5,
                       prefix_cache_hit_blocks=1, tp_pids="1,2", spec_num_drafts=4,
                       spec_num_draft_tokens=12, spec_num_accepted_tokens=7,
                       spec_accepted_per_pos=[4, 2, 1], kv_pipe="zmq",
                       kv_links={"tcp://p": "zmq"})]
    metrics = ProxyMetrics(lambda: engines, "my-model")
    state = SimpleNamespace(metrics=metrics, inflight=0, cfg=parse_config({}))
    with caplog.at_level(logging.INFO, logger="pd_cluster.access"):
        t = RequestTracker(state, "cmpl-1")
        t.count_prompt(7)  # tokenized once admitted
        t.on_event(StreamEvent("a", [5]))
        t.on_event(StreamEvent("bc", [6, 7], "length"))
        t.close("success")
    line = caplog.records[-1].getMessage()
    assert line.startswith("cmpl-1 200 success prompt_tokens=7 output_tokens=3 ttft=")
    assert "latency=" in line and state.inflight == 0
    text = metrics.render().decode()
    for series in ('vllm:num_requests_running{engine="decode-0",model_name="my-model"} 3.0',
                   'vllm:num_requests_waiting{engine="decode-0",model_name="my-model"} 1.0',
                   'vllm:kv_cache_usage_perc{engine="decode-0",model_name="my-model"} 0.25',
                   'vllm:prompt_tokens_total{model_name="my-model"} 7.0',
                   'vllm:generation_tokens_total{model_name="my-model"} 3.0',
                   'vllm:time_to_first_token_seconds_count{model_name="my-model"} 1.0',
                   'vllm:request_success_total{finished_reason="length",model_name="my-model"} '
                   '1.0',
                   'vllm:num_preemptions_total{engine="decode-0",model_name="my-model"} 2.0',
                   # issue 42: the transfer series are counted per KV pipe
                   'pd_engine_kv_bytes_sent_total{engine="decode-0",pipe="zmq",role="decode"} '
                   '5.0',
                   'vllm:prefix_cache_hits_total{engine="decode-0",model_name="my-model"} 16.0',
                   'vllm:spec_decode_num_drafts_total{engine="decode-0",model_name="my-model"} 4.0',
                   'vllm:spec_decode_num_accepted_tokens_total{engine="decode-0",'
                   'model_name="my-model"} 7.0',
                   'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="decode-0",'
                   'model_name="my-model",position="1"} 2.0'):
        assert series in text, series
    # One name per series: nothing vLLM exports has a pd_ twin, no cluster-wide sums.
    for twin in ("pd_time_to_first_token", "pd_inter_token", "pd_e2e", "pd_prompt_tokens",
                 "pd_generation_tokens", "pd_engine_num_running", "pd_engine_num_waiting ",
                 "pd_engine_kv_blocks_used", "pd_engine_num_preemptions", "pd_cluster_",
                 "pd_engine_tp_pids", "pd_engine_kv_pipe", "pd_engine_kv_links"):
        assert twin not in text, twin
    helps = [ln for ln in text.splitlines() if ln.startswith("# HELP")]
    assert helps and not [h for h in helps if "Engine stat" in h], helps


def test_stats_line_per_engine(caplog, monkeypatch) -> None:
    from pd_cluster.serving.observability import stats_log
    clock = [0.0]
    monkeypatch.setattr(stats_log.time, "monotonic", lambda: clock[0])
    e = _engine("prefill-0", num_running=2, num_waiting=0, kv_blocks_used=10,
                kv_blocks_total=40, prefix_cache_queried_blocks=10, prefix_cache_hit_blocks=2,
                tokens_generated=100, kv_bytes_sent=0)
    log = StatsLog(interval=10.0)
    with caplog.at_level(logging.INFO, logger="pd_cluster.stats"):
        clock[0] = 5.0
        log.maybe_log([e])  # not due yet
        assert not caplog.records
        clock[0] = 10.0
        log.maybe_log([e])
        e.stats = {**e.stats, "prefix_cache_queried_blocks": 20, "prefix_cache_hit_blocks": 7,
                   "tokens_generated": 300, "kv_bytes_sent": 20_000_000}
        clock[0] = 20.0
        log.maybe_log([e])
    assert caplog.records[-1].getMessage() == (
        "prefill-0 (prefill, 10.0.0.7): running 2, waiting 0, KV 25.0% used, prefix hit 50.0%, "
        "tokens/s 20.0, KV sent MB/s 2.0")


def test_every_engine_stat_has_a_series_that_says_what_it_is() -> None:
    """Each stat an engine reports (a real engine's, its loop's, output and request sockets',
    the P/D connector's) is exported under vLLM's name or described in engine_series."""
    import inspect
    import re

    from connectors.pd_connector import PDConnectorWorker
    from pd_cluster import LLM
    from pd_cluster.driver.engine_loop import EngineLoop
    from pd_cluster.serving.engine.engine_actor import EngineActor
    from pd_cluster.serving.engine.output_sender import OutputSender
    from pd_cluster.serving.observability.engine_series import AS_VLLM, ENGINE_SERIES, NOT_SERIES
    with LLM(num_kv_blocks=16) as llm:
        keys = set(llm.engine.stats())
    keys.add("num_active")
    for source in (inspect.getsource(EngineLoop.__init__), inspect.getsource(OutputSender.__init__),
                   inspect.getsource(PDConnectorWorker.stats)):
        keys |= set(re.findall(r'"(\w+)": ', source.split("counters = {", 1)[-1]
                               if "counters = {" in source else source))
    reader = inspect.getsource(EngineActor._reader_counters)
    keys |= {f"session_{k}" for k in re.findall(r'"(\w+)"', reader.split("for k in", 1)[1])}
    assert {"kv_bytes_sent", "requests_total", "output_messages", "session_requests",
            "num_running"} <= keys
    assert keys - AS_VLLM - NOT_SERIES <= set(ENGINE_SERIES), keys - set(ENGINE_SERIES)


# Every vllm: series a stock vLLM Grafana dashboard reads (vLLM's names, types and labels),
# present after one request; docs/design.md ("Metrics") lists the ones left out.
DASHBOARD_SERIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram", "vllm:request_params_max_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
}


def test_every_dashboard_series_after_one_request() -> None:
    from types import SimpleNamespace as NS

    from prometheus_client.parser import text_string_to_metric_families
    engines = [_engine("prefill-0", num_running=1, num_waiting=0, kv_blocks_used=2,
                       kv_blocks_total=10, num_preemptions=0, prefix_cache_queried_blocks=4,
                       prefix_cache_hit_blocks=1)]
    metrics = ProxyMetrics(lambda: engines, "m", block_size=16)
    state = NS(metrics=metrics, inflight=0, cfg=parse_config({}))
    t = RequestTracker(state, "cmpl-2")
    prompt = [1, 2, 3]
    t.jobs = [NS(prompt_token_ids=prompt, params=NS(max_tokens=8), route="")] * 2  # n=2
    metrics.queue_time.observe(0.0)  # admission observes the wait
    t.count_prompt(3)
    t.on_event(StreamEvent("a", [5]))
    t.on_event(StreamEvent("b", [6], "stop"))
    t.close("success")
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    for name, kind in DASHBOARD_SERIES.items():
        fam = families.get(name)
        assert fam is not None and fam.type == kind, (name, fam and fam.type)
        assert fam.samples, name
        labels = fam.samples[0].labels
        assert labels.get("model_name") == "m", (name, labels)
        if name in ("vllm:prefix_cache_queries", "vllm:num_requests_running"):
            assert labels.get("engine") == "prefill-0", (name, labels)
    value = {s.name: s.value for s in families["vllm:prefix_cache_queries"].samples}
    assert value["vllm:prefix_cache_queries_total"] == 64  # 4 blocks of 16 tokens
    n = {s.name: s.value for s in families["vllm:request_params_n"].samples}
    assert n["vllm:request_params_n_sum"] == 2
    assert not [f for f in families if f.startswith("pd_") and "queue_time" in f]  # no twin


def test_metrics_open_without_a_key_by_default_and_status_keyed() -> None:
    from tests.test_api_auth import _config, _run

    async def body(app, http, engine, submitted) -> None:
        assert (await http.get("/metrics")).status_code == 200
        assert (await http.get("/cluster/status")).status_code == 401
    _run(_config(api_key="k" * 20), body)

    async def keyed(app, http, engine, submitted) -> None:
        assert (await http.get("/metrics")).status_code == 401
    _run(_config(api_key="k" * 20, open_routes=[]), keyed)


def test_stats_lines_only_while_there_is_work(caplog, monkeypatch) -> None:
    from pd_cluster.serving.observability import stats_log
    clock = [0.0]
    monkeypatch.setattr(stats_log.time, "monotonic", lambda: clock[0])
    idle = _engine("decode-0", num_running=0, num_waiting=0, tokens_generated=0)
    log = StatsLog(interval=10.0)
    with caplog.at_level(logging.INFO, logger="pd_cluster.stats"):
        for t in (10.0, 20.0):
            clock[0] = t
            log.maybe_log([idle])
        assert not caplog.records  # an idle server: no lines
        idle.stats = {**idle.stats, "num_running": 1, "tokens_generated": 50}
        clock[0] = 30.0
        log.maybe_log([idle])
        assert len(caplog.records) == 1 and "running 1" in caplog.records[0].getMessage()
        idle.stats = {**idle.stats, "num_running": 0}  # finished: no work since the last line
        clock[0], idle.stats["tokens_generated"] = 40.0, 50
        log.maybe_log([idle])
        assert len(caplog.records) == 1


def test_missing_preloads_name_their_own_package(caplog, monkeypatch) -> None:
    from pd_cluster.serving.cluster import engine_starter
    monkeypatch.setattr(engine_starter, "preload_env", lambda _pre: ({}, ["libiomp5"]))
    with caplog.at_level(logging.INFO, logger=engine_starter.__name__):
        engine_starter.engine_env(parse_config({}))
    text = caplog.records[-1].getMessage()
    assert "libiomp5: `pip install intel-openmp`" in text and "tcmalloc" not in text, text


def test_stats_line_says_the_speculation_acceptance(caplog, monkeypatch) -> None:
    from pd_cluster.serving.observability import stats_log
    clock = [0.0]
    monkeypatch.setattr(stats_log.time, "monotonic", lambda: clock[0])
    e = _engine("decode-0", num_running=1, num_waiting=0, spec_num_drafts=10,
                spec_num_draft_tokens=40, spec_num_accepted_tokens=20)
    log = StatsLog(interval=10.0)
    with caplog.at_level(logging.INFO, logger="pd_cluster.stats"):
        clock[0] = 10.0
        log.maybe_log([e])
        e.stats = {**e.stats, "spec_num_drafts": 20, "spec_num_draft_tokens": 80,
                   "spec_num_accepted_tokens": 50}
        clock[0] = 20.0
        log.maybe_log([e])
    assert caplog.records[-1].getMessage().endswith(
        "running 1, waiting 0, spec acceptance 75.0% (length 4.00)")


def test_pd_cluster_status_lists_each_kv_link_and_its_pipe(monkeypatch, capsys) -> None:
    """Issue 42: per prefill engine, each decode engine it is linked to and the pipe used."""
    import argparse

    import httpx

    from pd_cluster.serving.cluster.cli_cluster import run_status
    links = {"tcp://d1": "zmq", "tcp://d0": "zmq"}
    body = {"mode": "disaggregated", "model": "tiny", "inflight": 0, "proxy": {},
            "engines": [{"name": n, "role": n.split("-")[0], "healthy": True, "inflight": 0,
                         "restarts": 0, "pid": 7, "kv_endpoint": ep, "stats": s}
                        for n, ep, s in (("prefill-0", None, {"kv_links": links}),
                                         ("decode-0", "tcp://d0", {}),
                                         ("decode-1", "tcp://d1", {}))]}
    reply = SimpleNamespace(status_code=200, json=lambda: body)
    monkeypatch.setattr(httpx, "get", lambda *a, **kw: reply)
    args = argparse.Namespace(url="http://proxy", namespace="t", config=None, json=False)
    assert run_status(args) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "KV links" in ln]
    assert lines == ["prefill-0 KV links: decode-0 via zmq, decode-1 via zmq"]
