#!/usr/bin/env python
"""The proxy alone: real engine actor, dispatcher and HTTP proxy, but an engine that computes
nothing (NullEngine) and emits one token per step for every request, as fast as it can.

Each token's text is the wall-clock time the engine emitted it (hex microseconds), so the
client measures, per token, emit -> received over HTTP: token path + dispatcher + proxy + SSE.
Two proxies serve the same engine, alternating per level: ``stream`` (one length-prefixed
msgpack frame per engine step on a unix or tcp socket, every token forwarded at once) and
``stream/N`` (``--stream-interval N``, default 4; 1: none), which sends at least N tokens per
chunk (``proxy.stream_interval``). Each runs 1..256 streams of 256 tokens, twice: with the
engine stepping every 5 ms like a real decode engine (latency without a backlog), then as fast
as it can (throughput). Wall-clock tokens/s on a small shared machine measure the whole box
(client, proxy, engine and Ray share the cores), so each level also reads the CPU time the
proxy, the engine and the client (this process: raw sockets, no HTTP library per chunk) spent
per streamed token, and the tokens per SSE chunk. The baseline is the published figure of the
token path's predecessor (one Ray streaming call per request, removed): 24,713 tok/s through
one proxy (_PUBLISHED; docs/benchmarks.md's bench_proxy rows measured both side by side,
3-5x apart).
Printed last: per path ``proxy_overhead_ms_p50``/``_p99`` (paced, per token, 1 stream), the
best streamed tokens/s and CPU microseconds per token, then
``stream_tokens_per_s_ratio_stream_N_over_stream=`` (when N > 1), ``proxy_overhead_ms_p50=``
(the ``stream`` path) and ``stream_tokens_per_s_over_published=`` (its best over the
published baseline).

  python scripts/bench_proxy.py            # a few minutes on 2 CPUs
  python scripts/bench_proxy.py --quick    # levels 1 and 16, 64 tokens
  python scripts/bench_proxy.py --smoke    # seconds: levels 1 and 4, 16 tokens (CI)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

_REF_LEVEL = 1  # streams at which the overhead percentiles are reported (no backlog)
_STEP_MS = 5.0  # the paced engine's step
_PUBLISHED = 24_713  # tok/s through one proxy, published before the token path moved off Ray


def paths(stream_interval: int) -> dict[str, int]:
    """Proxies compared: name -> their proxy.stream_interval."""
    out = {"stream": 1}
    if stream_interval > 1:
        out[f"stream/{stream_interval}"] = stream_interval
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pid_of(actor: Any) -> int:
    import ray
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def start(namespace: str, compared: dict[str, int]) -> tuple[dict[str, str], list[Any]]:
    """One NullEngine actor and one proxy per path: {path: url}, actors."""
    import ray

    from pd_cluster.serving.cluster.cluster_config import parse_config
    from pd_cluster.serving.cluster.proxy_actor import proxy_actor_class
    from pd_cluster.serving.engine.null_engine import null_engine_actor_class

    def config(stream_interval: int = 1) -> Any:
        return parse_config({"mode": "colocated", "colocated": {"replicas": 1, "num_cpus": 1},
                             "engine": {"device": "cpu", "num_kv_blocks": 16},
                             "proxy": {"port": 0, "max_inflight": 1024,
                                       "request_timeout": 300.0,
                                       "stream_interval": stream_interval},
                             "ray": {"namespace": namespace}})

    from connectors.secret import has_secret, install, new_secret
    if not has_secret():  # the engines' sessions and the proxy prove it (workers inherit it)
        install(new_secret())
    ray.init(address="local", num_cpus=4, namespace=namespace, include_dashboard=False,
             log_to_driver=False)
    specs = config().engine_specs()
    engines = [null_engine_actor_class().options(name=s.name, namespace=namespace, num_cpus=1)
               .remote(s.to_dict()) for s in specs]
    ray.get([e.ready.remote() for e in engines], timeout=300)
    proxies = {t: proxy_actor_class().options(name=f"proxy-{t.replace('/', '-')}",
                                              namespace=namespace, num_cpus=0,
                                              max_concurrency=4).remote(
        config(interval).to_dict(), [{"name": s.name, "role": s.role} for s in specs],
        namespace) for t, interval in compared.items()}
    urls = {t: ray.get(p.url.remote(), timeout=300) for t, p in proxies.items()}
    return urls, [*proxies.values(), *engines]


# A chunk's text: the emit times of its tokens (the client shares the proxy's two cores, so it
# reads them with one regex per network read instead of parsing every chunk's JSON).
_TEXT = re.compile(rb'"text": ?"([^"]*)"')


class _Stream(asyncio.Protocol):
    """One streamed completion over its own HTTP/1.1 connection, read straight off the socket
    (no HTTP client library per chunk: the client shares the cores with what it measures).
    uvicorn writes each SSE event as one HTTP chunk, so the chunk-size lines sit between
    events, outside the text fields the regex reads."""

    def __init__(self, request: bytes, lat: list[float], done: asyncio.Future):
        self.request, self.lat, self.done = request, lat, done
        self.buf, self.head, self.tokens, self.chunks, self.ended = b"", True, 0, 0, False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now_us = int(time.time() * 1e6)
        buf = self.buf + data
        if self.head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buf = buf
                return
            if not buf.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
                self.done.set_exception(AssertionError(buf[:2000].decode(errors="replace")))
                self.transport.close()
                return
            self.head, buf = False, buf[end + 4:]
        whole, _, self.buf = buf.rpartition(b"\n\n")  # complete SSE events only
        for text in _TEXT.findall(whole):
            for stamp in text.split():  # emit times, microseconds modulo 2**40
                self.lat.append(((now_us - int(stamp, 16)) % (1 << 40)) / 1e6)
                self.tokens += 1
        self.chunks += whole.count(b"data: {")
        self.ended = self.ended or b"data: [DONE]" in whole

    def connection_lost(self, exc: Exception | None) -> None:  # Connection: close
        if not self.done.done():
            if self.ended:
                self.done.set_result((self.tokens, self.chunks))
            else:
                self.done.set_exception(AssertionError(f"stream cut short: {exc!r}"))


async def stream(url: str, tokens: int, lat: list[float]) -> tuple[int, int]:
    """(tokens, SSE chunks) of one streamed request of ``tokens`` tokens."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": tokens,
                       "stream": True, "ignore_eos": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    transport, _ = await loop.create_connection(lambda: _Stream(request, lat, done),
                                                host.strip("[]"), int(port))
    try:
        return await asyncio.wait_for(done, 600)
    finally:
        transport.close()


async def level(url: str, streams: int, tokens: int) -> dict[str, float]:
    lat: list[float] = []
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(stream(url, tokens, lat) for _ in range(streams)))
    wall = time.perf_counter() - t0
    assert all(c == tokens for c, _ in counts), f"lost tokens: {counts}"
    lat.sort()
    return {"streams": streams, "tokens_per_s": streams * tokens / wall,
            "tokens_per_chunk": streams * tokens / max(sum(n for _, n in counts), 1),
            "p50_ms": lat[len(lat) // 2] * 1e3, "p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
            "mean_ms": statistics.fmean(lat) * 1e3}


def run(urls: dict[str, str], engines: list[Any], pids: dict[str, int], levels: list[int],
        tokens: int) -> dict[str, dict[str, list[dict[str, float]]]]:
    """Per path: its paced (latency) and unpaced (throughput) rows. ``pids``: the proxy
    process of each path, and the engine's ("engine")."""
    import ray
    header = f"{'path':>8} {'streams':>8} {'tokens/s':>10} {'p50 ms':>8} {'p99 ms':>8} " \
             f"{'mean ms':>8} {'tok/chunk':>9} {'proxy us/tok':>12} {'engine us/tok':>13} " \
             f"{'client us/tok':>13}"
    out: dict[str, dict[str, list[dict[str, float]]]] = {t: {"paced": [], "unpaced": []}
                                                          for t in urls}
    for title, step, key in ((f"paced engine ({_STEP_MS:.0f} ms steps): latency", _STEP_MS,
                              "paced"), ("unpaced engine: throughput", 0.0, "unpaced")):
        ray.get([e.pace.remote(step / 1e3) for e in engines])
        print(f"{title}\n{header}", flush=True)
        for n in levels:
            for t, url in urls.items():  # the paths alternate: same machine load for each
                cpu0 = {k: cpu_seconds(pids[k]) for k in (t, "engine", "client")}
                row = asyncio.run(level(url, n, tokens))
                total = n * tokens
                for k, name in ((t, "proxy"), ("engine", "engine"), ("client", "client")):
                    row[f"{name}_cpu_us"] = (cpu_seconds(pids[k]) - cpu0[k]) * 1e6 / total
                out[t][key].append(row)
                print(f"{t:>8} {n:>8} {row['tokens_per_s']:>10.0f} {row['p50_ms']:>8.2f} "
                      f"{row['p99_ms']:>8.2f} {row['mean_ms']:>8.2f} "
                      f"{row['tokens_per_chunk']:>9.1f} "
                      f"{row['proxy_cpu_us']:>12.1f} {row['engine_cpu_us']:>13.1f} "
                      f"{row['client_cpu_us']:>13.1f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="levels 1 and 16, 64 tokens")
    mode.add_argument("--smoke", action="store_true", help="levels 1 and 4, 16 tokens (CI)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--stream-interval", type=int, default=4,
                    help="a second proxy with this proxy.stream_interval (1: none)")
    args = ap.parse_args()
    levels, tokens = ([1, 4], 16) if args.smoke else ([1, 16], 64) if args.quick else \
        ([1, 4, 16, 64, 256], args.tokens)
    import ray
    print("starting Ray, one engine actor (no model) and a proxy per path ...",
          flush=True)
    compared = paths(args.stream_interval)
    urls, actors = start(f"bench-proxy-{os.getpid()}", compared)
    engines = actors[len(urls):]
    try:
        for url in urls.values():
            asyncio.run(level(url, 4, 16))  # warm-up
        pids = {t: pid_of(a) for t, a in zip(urls, actors)}
        pids["engine"] = pid_of(engines[0])
        pids["client"] = os.getpid()
        rows = run(urls, engines, pids, levels, tokens)
    finally:
        for a in actors:
            ray.kill(a)
        ray.shutdown()
    best, cpu = {}, {}
    for t in compared:
        ref = next((r for r in rows[t]["paced"] if r["streams"] == _REF_LEVEL),
                   rows[t]["paced"][-1])
        top = max(rows[t]["unpaced"], key=lambda r: r["tokens_per_s"])
        best[t], cpu[t] = top["tokens_per_s"], top["proxy_cpu_us"]
        print(f"proxy_overhead_ms_p50_{t}={ref['p50_ms']:.2f}  proxy_overhead_ms_p99_{t}="
              f"{ref['p99_ms']:.2f}  proxy_max_stream_tokens_per_s_{t}={best[t]:.0f}  "
              f"proxy_cpu_us_per_token_{t}={cpu[t]:.1f}  "
              f"engine_cpu_us_per_token_{t}={top['engine_cpu_us']:.1f}  "
              f"client_cpu_us_per_token_{t}={top['client_cpu_us']:.1f}")
    if len(compared) > 1:
        other = next(t for t in compared if t != "stream")
        print(f"stream_tokens_per_s_ratio_{other.replace('/', '_')}_over_stream="
              f"{best[other] / best['stream']:.2f}")
    ref = next((r for r in rows["stream"]["paced"] if r["streams"] == _REF_LEVEL),
               rows["stream"]["paced"][-1])
    print(f"proxy_overhead_ms_p50={ref['p50_ms']:.2f}  (stream path, per token, emit -> "
          f"client, {ref['streams']} stream, engine stepping every {_STEP_MS:.0f} ms)")
    print(f"stream_tokens_per_s_over_published={best['stream'] / _PUBLISHED:.2f}")


if __name__ == "__main__":
    main()
