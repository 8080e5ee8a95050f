#!/usr/bin/env python
"""Multi-turn chat benchmark: today's P/D behaviour against prefix-aware P/D, in one run.

N conversations x T turns with a growing history: each turn's prompt is the previous prompt +
the reply (128 tokens by default: a chat assistant's reply is several times the user's new
message) + ~40 new user tokens. Turn k of every conversation runs as one wave (Poisson arrivals
at --request-rate), so the engines' counter deltas over a wave are that turn's figures. Per
topology (1P1D, 2P2D) and per mode:

- ``baseline``: routing least_loaded, disaggregation always, decode-side prefix reuse off
  (every prompt's KV shipped whole: the behaviour before issue 22);
- ``prefix_aware``: routing cache_aware, disaggregation auto, decode-side reuse on.

Per turn: KV bytes received by decode engines, TTFT p50/p99, TPOT p99, throughput, prefix-cache
hit rates of prefill and decode engines, and the disaggregation decisions. Last lines:
``kv_bytes_ratio_turn6=X`` (baseline / prefix_aware KV bytes at the last turn, all topologies)
and ``ttft_p50_speedup=Y`` (baseline / prefix_aware TTFT p50 over every request).

  python scripts/bench_multiturn.py            # 16 conversations x 6 turns, a few minutes on 2 CPUs
  python scripts/bench_multiturn.py --output-len 32   # short replies: the baseline's P, which
      # caches every history it prefilled, lacks only the reply, so prefix-aware saves less
  python scripts/bench_multiturn.py --smoke    # seconds: 2 conversations x 2 turns, 1P1D
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

from bench_serving import Result, comma_list, pct, send  # noqa: E402

MODES = {"baseline": {"routing": "least_loaded", "disaggregation": "always",
                      "decode_prefix_reuse": False},
         "prefix_aware": {"routing": "cache_aware", "disaggregation": "auto",
                          "decode_prefix_reuse": True},
         # optional (--modes): every request through P, so every turn ships what D lacks
         "reuse_always": {"routing": "cache_aware", "disaggregation": "always",
                          "decode_prefix_reuse": True}}
TOPOLOGIES = {"1p1d": 1, "2p2d": 2}
_STAT_KEYS = ("kv_bytes_received", "prefix_cache_queried_blocks", "prefix_cache_hit_blocks")


def conversations(args: argparse.Namespace) -> list[tuple[list[int], list[list[int]]]]:
    """Per conversation: its first prompt and each later turn's new user tokens (seeded)."""
    rng = random.Random(args.seed)
    return [([rng.randrange(4, 500) for _ in range(args.first_prompt_len)],
             [[rng.randrange(4, 500) for _ in range(rng.randint(args.new_tokens - 8,
                                                                 args.new_tokens + 8))]
              for _ in range(args.turns - 1)])
            for _ in range(args.conversations)]


def engine_stats(cluster: Any) -> dict[str, dict[str, float]]:
    """Per role: the engines' counters summed (fresh, straight from the actors)."""
    import ray
    names = list(cluster.engines)
    stats = ray.get([cluster.engines[n].stats.remote() for n in names], timeout=60)
    out: dict[str, dict[str, float]] = {}
    for name, st in zip(names, stats):
        role = out.setdefault(name.split("-")[0], {})
        for k in _STAT_KEYS:
            role[k] = role.get(k, 0.0) + float(st.get(k, 0) or 0)
    return out


def decisions(url: str) -> dict[str, float]:
    import httpx
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {f"{m.group(1)}/{m.group(2)}": float(m.group(3)) for m in re.finditer(
        r'^pd_disaggregation_decisions_total\{path="(\w+)",reason="(\w+)"\} ([0-9.e+-]+)$',
        text, re.M)}


def _diff(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return {k: (_diff(v, before.get(k, {})) if isinstance(v, dict) else v - before.get(k, 0.0))
            for k, v in after.items()}


async def wave(url: str, model: str, prompts: list[list[int]], max_tokens: int, rate: float,
               rng: random.Random) -> tuple[list[Result], float]:
    """One turn of every conversation (Poisson arrivals); the replies' token ids."""
    import aiohttp
    offsets, t = [], 0.0
    for _ in prompts:
        t += rng.expovariate(rate)
        offsets.append(t)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter()

        async def one(at: float, prompt: list[int]) -> Result:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            return await send(session, url, model, prompt, max_tokens, token_ids=True)
        out = await asyncio.gather(*(one(at, p) for at, p in zip(offsets, prompts)))
        duration = time.perf_counter() - t0
    return list(out), duration


def run(topology: str, mode: str, args: argparse.Namespace,
        convs: list[tuple[list[int], list[list[int]]]]) -> list[dict[str, Any]]:
    from pd_cluster.serving.cluster.cluster_config import load_config
    from pd_cluster.serving.cluster.launcher import launch
    n = TOPOLOGIES[topology]
    over = {"prefill": {"replicas": n}, "decode": {"replicas": n},
            "proxy": {"port": 0, **MODES[mode], **({} if args.margin_ms is None else
                                                  {"local_prefill_margin_ms": args.margin_ms})},
            "ray": {"namespace": f"bench-multiturn-{topology}-{mode}"},
            "engine": {"max_model_len": args.max_model_len, "num_kv_blocks": args.num_kv_blocks}}
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/local.yaml", over)
    print(f"[{topology} {mode}] launching ...", flush=True)
    cluster = launch(cfg, progress=False)
    rng = random.Random(args.seed + 1)
    prompts = [first for first, _ in convs]
    turns = []
    try:
        for turn in range(args.turns):
            before = (engine_stats(cluster), decisions(cluster.url))
            results, duration = asyncio.run(wave(
                cluster.url, cfg.model_name, prompts, args.output_len, args.request_rate, rng))
            time.sleep(args.settle)  # the last KV counters and cache reports land
            stats, dec = _diff(engine_stats(cluster), before[0]), _diff(decisions(cluster.url),
                                                                       before[1])
            turns.append({"results": results, "duration": duration, "stats": stats,
                          "decisions": {k: int(v) for k, v in dec.items() if v},
                          "prompt_tokens": sum(len(p) for p in prompts)})
            failed = [r.error for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"{len(failed)} request(s) failed: {failed[:3]}")
            if turn + 1 < args.turns:
                prompts = [p + r.token_ids + convs[i][1][turn]
                           for i, (p, r) in enumerate(zip(prompts, results))]
    finally:
        cluster.shutdown()
    return turns


def hit_rate(stats: dict[str, dict[str, float]], role: str) -> float:
    s = stats.get(role, {})
    q = s.get("prefix_cache_queried_blocks", 0.0)
    return 100.0 * s.get("prefix_cache_hit_blocks", 0.0) / q if q else 0.0


def report(topology: str, mode: str, turns: list[dict[str, Any]]) -> None:
    print(f"\n=== {topology} {mode}")
    print(f"{'turn':<5}{'prompt tok':>11}{'KV MB':>9}{'TTFT p50':>10}{'p99':>8}{'TPOT p99':>10}"
          f"{'tok/s':>8}{'P hit%':>8}{'D hit%':>8}  decisions")
    for i, t in enumerate(turns, 1):
        ok = [r for r in t["results"] if r.ok]
        ttft = [1e3 * r.ttft for r in ok]
        tpot = [1e3 * r.tpot for r in ok if r.output_tokens > 1]
        toks = sum(r.output_tokens for r in ok) / t["duration"]
        dec = " ".join(f"{k}={v}" for k, v in sorted(t["decisions"].items())) or "-"
        kv_mb = t["stats"].get("decode", {}).get("kv_bytes_received", 0) / 1e6
        print(f"{i:<5}{t['prompt_tokens']:>11}{kv_mb:>9.2f}"
              f"{pct(ttft, 50):>10.1f}{pct(ttft, 99):>8.1f}{pct(tpot, 99):>10.2f}{toks:>8.1f}"
              f"{hit_rate(t['stats'], 'prefill'):>8.1f}{hit_rate(t['stats'], 'decode'):>8.1f}"
              f"  {dec}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topologies", default="1p1d,2p2d", help="comma list of: 1p1d, 2p2d")
    p.add_argument("--modes", default="baseline,prefix_aware",
                   help="comma list of: baseline, prefix_aware, reuse_always (the first two "
                        "are always run: the last lines compare them)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-prompt-len", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=40, help="new user tokens per turn (+-8)")
    p.add_argument("--output-len", type=int, default=128, help="tokens of each reply")
    p.add_argument("--request-rate", type=float, default=8.0, help="Poisson arrivals per wave")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--settle", type=float, default=0.5, help="s after each wave")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--margin-ms", type=float, default=None,
                   help="proxy.local_prefill_margin_ms (default: the config's): how much sooner "
                        "D alone must be expected to answer before it prefills by itself")
    p.add_argument("--smoke", action="store_true",
                   help="seconds: 2 conversations x 2 turns on 1P1D, short prompts")
    args = p.parse_args(argv)
    if args.smoke:
        args.topologies, args.conversations, args.turns = "1p1d", 2, 2
        args.first_prompt_len, args.new_tokens, args.output_len = 40, 16, 4
        args.num_kv_blocks, args.max_model_len, args.settle = 128, 256, 0.2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tops = comma_list(args.topologies, TOPOLOGIES, "topology")
    modes = comma_list(args.modes, MODES, "mode")
    if tops is None or modes is None:
        return 2
    modes = ["baseline", "prefix_aware"] + [m for m in modes
                                            if m not in ("baseline", "prefix_aware")]
    convs = conversations(args)
    print(f"workload: {args.conversations} conversations x {args.turns} turns, first prompt "
          f"{args.first_prompt_len} tokens, +{args.new_tokens} new tokens and the "
          f"{args.output_len}-token reply per turn, waves at {args.request_rate} req/s")
    from pd_cluster.serving.cluster.testing import ensure_ray
    ensure_ray(num_cpus=4)  # 2P2D's four engines; every run gets the same machine
    runs = {(top, mode): run(top, mode, args, convs) for top in tops for mode in modes}
    for (top, mode), turns in runs.items():
        report(top, mode, turns)
    last = {mode: sum(runs[(top, mode)][-1]["stats"].get("decode", {}).get(
        "kv_bytes_received", 0.0) for top in tops) for mode in modes}
    ttft = {mode: pct([r.ttft for top in tops for t in runs[(top, mode)] for r in t["results"]
                       if r.ok], 50) for mode in modes}
    tpot = {mode: pct([r.tpot for top in tops for t in runs[(top, mode)] for r in t["results"]
                       if r.ok and r.output_tokens > 1], 99) for mode in modes}
    if "reuse_always" in modes:
        print(f"\nreuse_always: KV bytes at turn {args.turns} {last['reuse_always'] / 1e6:.2f} MB "
              f"(baseline/reuse_always "
              f"{last['baseline'] / max(last['reuse_always'], 1.0):.2f}), TTFT p50 "
              f"{1e3 * ttft['reuse_always']:.1f} ms, TPOT p99 {1e3 * tpot['reuse_always']:.2f} ms")
    print(f"\nTPOT p99 baseline {1e3 * tpot['baseline']:.2f} ms, prefix_aware "
          f"{1e3 * tpot['prefix_aware']:.2f} ms; KV bytes at turn {args.turns}: baseline "
          f"{last['baseline'] / 1e6:.2f} MB, prefix_aware {last['prefix_aware'] / 1e6:.2f} MB")
    # inf: prefix-aware shipped nothing at the last turn (every decode engine held the history
    # and prefilled the new tokens itself)
    ratio = last["baseline"] / last["prefix_aware"] if last["prefix_aware"] else float("inf")
    print(f"kv_bytes_ratio_turn{args.turns}={ratio:.2f}")
    print(f"ttft_p50_speedup={ttft['baseline'] / max(ttft['prefix_aware'], 1e-9):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
