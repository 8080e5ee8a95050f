#!/usr/bin/env python
"""HTTP serving benchmark: the same workload against a P/D cluster and a colocated baseline.

Open-loop load (Poisson arrivals at --request-rate, fixed --seed), streamed completions with
fixed output lengths (ignore_eos). Per mode it reports TTFT, TPOT, ITL and end-to-end latency
(p50/p90/p99), throughput and goodput under --slo-ttft-ms/--slo-tpot-ms, plus the proxy's own
overhead per token: the proxy's engine->client forwarding histogram, and client ITL minus the
decode engines' step time. The default load is prefill-heavy (long prompts, short outputs),
where a colocated engine's decodes stall behind prefills. The last lines printed are
``goodput_ratio_colocated_over_pd=G`` (<= 1: P/D serves at least as many requests within the
SLOs) and ``p99_tpot_ratio_colocated_over_pd=X`` (measured in this run; > 1: disaggregation
helps). P/D runs configs/local.yaml as shipped (cache_aware routing, disaggregation auto).

  python scripts/bench_serving.py                      # both modes, a few minutes on 2 CPUs
  python scripts/bench_serving.py --url http://host:8000 --modes pd   # an already running server
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Result, comma_list, pct and send stay importable from here (bench_multiturn.py).
from serving_client import Result, comma_list, pct, run_load, send  # noqa: E402,F401

# mode -> (config, proxy overrides); pd-always: P/D as before issue 22 (every request through P)
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "pd": ("configs/local.yaml", {}),
    "colocated": ("configs/local-colocated.yaml", {}),
    "pd-always": ("configs/local.yaml", {"routing": "least_loaded", "disaggregation": "always"})}


def make_workload(args: argparse.Namespace) -> list[tuple[float, list[int], int]]:
    """[(arrival offset s, prompt token ids, output tokens)], reproducible from --seed."""
    rng, t, work = random.Random(args.seed), 0.0, []
    for _ in range(args.num_requests):
        t += rng.expovariate(args.request_rate)
        n_in = rng.randint(args.prompt_len_min, args.prompt_len_max)
        n_out = rng.randint(args.output_len_min, args.output_len_max)
        work.append((t, [rng.randrange(4, 500) for _ in range(n_in)], n_out))
    return work


def summarize(results: list[Result], duration: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft * 1e3 <= args.slo_ttft_ms and r.tpot * 1e3 <= args.slo_tpot_ms]
    s: dict[str, Any] = {"requests": len(results), "failed": len(results) - len(ok),
                         "duration_s": duration, "req_per_s": len(ok) / duration,
                         "output_tok_per_s": sum(r.output_tokens for r in ok) / duration,
                         "goodput_req_per_s": len(good) / duration,
                         "slo_attainment": len(good) / max(1, len(results))}
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itls], "e2e": [r.e2e for r in ok]}
    for name, xs in series.items():
        s[f"mean_{name}_ms"] = 1e3 * sum(xs) / len(xs) if xs else float("nan")
        for p in (50, 90, 99):
            s[f"p{p}_{name}_ms"] = 1e3 * pct(xs, p)
    s["_series"] = series
    s["_errors"] = sorted({r.error for r in results if not r.ok})[:3]
    return s


def scrape(url: str) -> dict[str, float]:
    """Proxy forwarding overhead totals and decode-side step totals (for before/after diffs)."""
    import httpx
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for key in ("pd_proxy_overhead_seconds_sum", "pd_proxy_overhead_seconds_count"):
        m = re.search(rf"^{key} ([0-9.e+-]+)$", text, re.M)
        out[key] = float(m.group(1)) if m else 0.0
    for m in re.finditer(r'^pd_disaggregation_decisions_total\{path="(\w+)",reason="(\w+)"\} '
                         r'([0-9.e+-]+)$', text, re.M):
        out[f"decision {m.group(1)}/{m.group(2)}"] = float(m.group(3))
    st = httpx.get(f"{url}/cluster/status", timeout=30).json()
    for e in st["engines"]:
        if e["role"] in ("decode", "colocated"):
            for k in ("output_steps", "output_step_seconds"):
                out[k] = out.get(k, 0.0) + float(e["stats"].get(k, 0))
    return out


def overhead(before: dict[str, float], after: dict[str, float], s: dict[str, Any]) -> None:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    n = d.get("pd_proxy_overhead_seconds_count", 0.0)
    s["proxy_forward_ms_per_chunk"] = 1e3 * d["pd_proxy_overhead_seconds_sum"] / n if n else 0.0
    steps = d.get("output_steps", 0.0)
    s["engine_step_ms"] = 1e3 * d.get("output_step_seconds", 0.0) / steps if steps else 0.0
    s["itl_minus_step_ms"] = s["mean_itl_ms"] - s["engine_step_ms"]
    s["decisions"] = {k.split(" ", 1)[1]: int(v) for k, v in d.items()
                      if k.startswith("decision ") and v}


def run_mode(mode: str, args: argparse.Namespace, work: list) -> dict[str, Any]:
    cluster = None
    url = args.url
    if url is None:
        from pd_cluster.serving.cluster.cluster_config import load_config
        from pd_cluster.serving.cluster.launcher import launch
        path, proxy = MODES[mode]
        over: dict[str, Any] = {"proxy": {"port": 0, **proxy},
                                "ray": {"namespace": f"bench-{mode}"},
                                "engine": {"max_model_len": args.max_model_len,
                                           "num_kv_blocks": args.num_kv_blocks}}
        if args.model:
            over["model"] = args.model
        cfg = load_config(Path(__file__).resolve().parents[1] / path, over)
        print(f"[{mode}] launching {path} {proxy or ''}...", flush=True)
        cluster = launch(cfg, progress=not args.no_progress)
        url, model = cluster.url, cfg.model_name
    else:
        import httpx
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    try:
        warm = [(0.0, p, n) for _, p, n in work[:4]]
        asyncio.run(run_load(url, model, warm, False))  # first-request costs stay out
        before = scrape(url)
        results, duration = asyncio.run(run_load(url, model, work, not args.no_progress))
        time.sleep(0.5)
        s = summarize(results, duration, args)
        overhead(before, scrape(url), s)
    finally:
        if cluster is not None:
            cluster.shutdown()
    return s


def report(mode: str, s: dict[str, Any]) -> None:
    print(f"\n=== {mode}: {s['requests']} requests in {s['duration_s']:.1f}s, "
          f"{s['failed']} failed {s['_errors'] or ''}")
    print(f"throughput {s['req_per_s']:.2f} req/s, {s['output_tok_per_s']:.1f} output tok/s; "
          f"goodput {s['goodput_req_per_s']:.2f} req/s (SLO attainment "
          f"{100 * s['slo_attainment']:.0f}%)")
    print(f"{'ms':<6}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        print(f"{name:<6}" + "".join(f"{s[f'{k}_{name}_ms']:9.2f}"
                                     for k in ("mean", "p50", "p90", "p99")))
    print(f"proxy overhead: {s['proxy_forward_ms_per_chunk']:.3f} ms/chunk engine->proxy->client "
          f"forwarding; client ITL {s['mean_itl_ms']:.2f} ms vs engine step "
          f"{s['engine_step_ms']:.2f} ms -> {s['itl_minus_step_ms']:.2f} ms/token outside engine")
    if s.get("decisions"):
        print("disaggregation decisions: " + " ".join(f"{k}={v}" for k, v in
                                                     sorted(s["decisions"].items())))


def plot(summaries: dict[str, dict[str, Any]], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no plot: matplotlib is not installed; skipped {path})")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, name in zip(axes, ("ttft", "tpot", "itl")):
        for mode, s in summaries.items():
            xs = sorted(1e3 * x for x in s["_series"][name])
            ax.plot(xs, [i / max(1, len(xs) - 1) for i in range(len(xs))], label=mode)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("CDF")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="pd,colocated",
                   help="comma list of: pd, colocated, pd-always")
    p.add_argument("--url", default=None, help="benchmark this running server instead")
    p.add_argument("--model", default=None, help="override the configs' model (e.g. bench-50m)")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--request-rate", type=float, default=8.0, help="Poisson arrivals, req/s")
    p.add_argument("--prompt-len-min", type=int, default=512)
    p.add_argument("--prompt-len-max", type=int, default=1024)
    p.add_argument("--output-len-min", type=int, default=16)
    p.add_argument("--output-len-max", type=int, default=48)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write latency CDFs to this PNG")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--smoke", action="store_true",
                   help="a few-second tiny load (CI, scripts/gpu_check.sh --cpu): 8 requests, "
                        "prompts of 16-64 tokens, 4-8 output tokens")
    args = p.parse_args(argv)
    if args.smoke:
        args.num_requests, args.request_rate = 8, 8.0
        args.prompt_len_min, args.prompt_len_max = 16, 64
        args.output_len_min, args.output_len_max = 4, 8
        args.num_kv_blocks, args.max_model_len = 256, 256
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = comma_list(args.modes, MODES, "mode(s)")
    if modes is None:
        return 2
    work = make_workload(args)
    print(f"workload: {len(work)} requests at {args.request_rate} req/s (Poisson, seed "
          f"{args.seed}), prompts {args.prompt_len_min}-{args.prompt_len_max} tokens, outputs "
          f"{args.output_len_min}-{args.output_len_max} tokens")
    if args.url is None:
        from pd_cluster.serving.cluster.testing import ensure_ray
        ensure_ray(num_cpus=2)  # both deployments get the same 2 CPUs
    summaries = {}
    for mode in modes:
        summaries[mode] = run_mode(mode, args, work)
        report(mode, summaries[mode])
    if args.plot:
        plot(summaries, args.plot)
    if {"pd", "colocated"} <= set(summaries):
        pd_, colo = summaries["pd"], summaries["colocated"]
        good = colo["goodput_req_per_s"] / max(pd_["goodput_req_per_s"], 1e-9)
        print(f"\np99 TTFT colocated/pd = {colo['p99_ttft_ms'] / pd_['p99_ttft_ms']:.2f}, "
              f"goodput colocated/pd = {good:.2f}")
        print(f"goodput_ratio_colocated_over_pd={good:.3f}")
        print(f"p99_tpot_ratio_colocated_over_pd={colo['p99_tpot_ms'] / pd_['p99_tpot_ms']:.3f}")
    failed = sum(s["failed"] for s in summaries.values())
    if failed:  # figures from a run with failed requests are not figures
        print(f"bench_serving: {failed} request(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
