#!/usr/bin/env python
"""KV offloading benchmark (issue 32): multi-turn chat whose histories outgrow the device pool,
without a lower KV tier, with a host tier, and with host + disk tiers, on 1P1D and colocated, in
one run.

The workload: N conversations x T turns sharing one system prompt; each turn's prompt is the
previous one + the reply (--output-len tokens) + a new user message (--user-tokens +-8). Turn k of
every conversation runs before turn k+1 of any, --concurrency requests in flight, so a
conversation comes back after every other one had its turn: with a small device pool
(--num-kv-blocks per engine) its history has been evicted from the device by then. Configs:

- ``off``: the device pool alone (evicted histories are recomputed);
- ``host``: engine.kv_offloading_size big enough for every history (--host-share of them);
- ``host+disk``: a host tier for --disk-host-share of the histories, and a disk tier behind it
  (engine.kv_offloading_disk), so the rest come back from disk.

Per config, over the requests of turns >= 2 (turn 1 has nothing to restore): the share of prompt
tokens served from a cache (usage.prompt_tokens_details.cached_tokens), TTFT p50/p99, TPOT p99,
and bytes restored per tier (the engines' kv_offload_* stats); then the ratios against ``off``.
The last line: ``cached_share_host=.. ttft_p50_speedup_host=.. tpot_p99_ratio_host=..`` and the
same for host+disk (``_disk``), the worst over the topologies run. Issue targets: cached share
>= 0.8 with the host tier, TTFT p50 speedup >= 1.5, TPOT p99 ratio <= 1.

  python scripts/bench_offload.py           # bench-50m, 24 conversations x 4 turns (minutes)
  python scripts/bench_offload.py --smoke   # seconds: tiny-llama, 2 x 2, colocated only
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from serving_client import Result, comma_list, pct, send  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOPOLOGIES = {"1p1d": "configs/local.yaml", "colocated": "configs/local-colocated.yaml"}
CONFIGS = ("off", "host", "host+disk")
TIERS = ("host", "disk")


def conversations(args: argparse.Namespace) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt, and per conversation each turn's new user tokens (seeded)."""
    rng = random.Random(args.seed)
    system = [rng.randrange(4, 500) for _ in range(args.system_tokens)]
    users = [[[rng.randrange(4, 500) for _ in range(rng.randint(args.user_tokens - 8,
                                                                args.user_tokens + 8))]
              for _ in range(args.turns)] for _ in range(args.conversations)]
    return system, users


def history_tokens(args: argparse.Namespace) -> int:
    """Every conversation's final history (prompt + reply of its last turn), summed."""
    per = args.system_tokens + args.turns * (args.user_tokens + args.output_len)
    return args.conversations * per


def kv_bytes_per_token(model: str, dtype_bytes: int = 4) -> int:
    """From the checkpoint's config.json: K and V of every layer (float32, as configs/ ship)."""
    from pd_cluster.serving.cluster.model_source import resolve_model
    c = json.loads((Path(resolve_model(model)) / "config.json").read_text())
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", heads) * head_dim * dtype_bytes


def tier_config(name: str, args: argparse.Namespace, disk_dir: str) -> dict[str, Any]:
    """The engine section's KV tier keys for config ``name`` (GiB sized from the workload)."""
    gib = history_tokens(args) * kv_bytes_per_token(args.model) / 2**30
    if name == "off":
        return {}
    if name == "host":
        return {"kv_offloading_size": args.host_share * gib}
    return {"kv_offloading_size": args.disk_host_share * gib,
            "kv_offloading_disk": {"path": disk_dir, "size": 2 * gib}}


async def run_turns(url: str, model: str, system: list[int], users: list[list[list[int]]],
                    args: argparse.Namespace, label: str) -> list[list[Result]]:
    """Every turn of every conversation, turn by turn, ``concurrency`` requests in flight."""
    import aiohttp
    prompts = [system + u[0] for u in users]
    turns: list[list[Result]] = []
    sem = asyncio.Semaphore(args.concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(prompt: list[int]) -> Result:
            async with sem:
                return await send(session, url, model, prompt, args.output_len, token_ids=True)
        for k in range(args.turns):
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(p) for p in prompts))
            failed = [r.error for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"{label} turn {k + 1}: {len(failed)} request(s) failed: "
                                   f"{failed[:3]}")
            turns.append(list(results))
            share = cached_share(results)
            ttft = pct([r.ttft for r in results], 50)
            print(f"  [{label}] turn {k + 1}/{args.turns}: {len(results)} requests in "
                  f"{time.perf_counter() - t0:.1f}s, cached {100 * share:.0f}% of prompt "
                  f"tokens, TTFT p50 {1e3 * ttft:.0f} ms", flush=True)
            if k + 1 < args.turns:
                prompts = [p + r.token_ids + users[i][k + 1]
                           for i, (p, r) in enumerate(zip(prompts, results))]
    return turns


def cached_share(results: list[Result]) -> float:
    total = sum(r.prompt_tokens for r in results)
    return sum(r.cached_tokens for r in results) / total if total else 0.0


def engine_stats(cluster: Any) -> dict[str, float]:
    """The engines' kv_offload_* and step counters summed (fresh, from the actors)."""
    import ray
    stats = ray.get([h.stats.remote() for h in cluster.engines.values()], timeout=60)
    out: dict[str, float] = {}
    for st in stats:
        for k, v in st.items():
            if (k.startswith("kv_offload_") or k in ("steps", "step_seconds")) \
                    and isinstance(v, (int, float)):
                out[k] = out.get(k, 0.0) + float(v)
    return out


def decisions(url: str) -> str:
    """The proxy's remote/local prefill choices (1P1D), as ``path/reason=n``."""
    import re

    import httpx
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.findall(r'^pd_disaggregation_decisions_total\{path="(\w+)",reason="(\w+)"\} '
                       r'([0-9.e+-]+)$', text, re.M)
    return " ".join(f"{p}/{r}={int(float(n))}" for p, r, n in found if float(n)) or "-"


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def run(topology: str, config: str, args: argparse.Namespace, system: list[int],
        users: list[list[list[int]]]) -> dict[str, Any]:
    from pd_cluster.config import EngineArgs
    from pd_cluster.serving.cluster.cluster_config import load_config
    from pd_cluster.serving.cluster.launcher import launch
    label = f"{topology} {config}"
    with tempfile.TemporaryDirectory(prefix="pd-bench-offload-") as disk_dir:
        over: dict[str, Any] = {
            "model": args.model, "proxy": {"port": 0},
            "ray": {"namespace": f"bench-offload-{topology}-{CONFIGS.index(config)}-"
                                 f"{os.getpid()}"},
            "engine": {"num_kv_blocks": args.num_kv_blocks, "max_model_len": args.max_model_len,
                       **tier_config(config, args, disk_dir)}}
        if topology == "colocated":  # the CPUs 1P1D gets (one engine: --smoke, sooner up)
            over["colocated"] = {"replicas": 1 if args.smoke else 2, "num_cpus": 1}
        cfg = load_config(REPO / TOPOLOGIES[topology], over)
        tiers = {k: v for k, v in over["engine"].items() if k.startswith("kv_offloading")}
        print(f"[{label}] launching {TOPOLOGIES[topology]} {tiers or '(no tier)'} ...",
              flush=True)
        cluster = launch(cfg, progress=False)
        try:
            load = [loadavg()]
            turns = asyncio.run(run_turns(cluster.url, cfg.model_name, system, users, args,
                                          label))
            load.append(loadavg())
            time.sleep(args.settle)  # the last steps' counters land
            stats, choices = engine_stats(cluster), decisions(cluster.url)
        finally:
            cluster.shutdown()
    later = [r for t in turns[1:] for r in t]
    bs = int(cfg.engine.get("block_size", EngineArgs.model_fields["block_size"].default))
    # at best, a turn finds the previous turn's prompt and reply cached, in whole blocks
    # (less the reply's last token, whose KV was never computed)
    ideal = sum((r.prompt_tokens + r.output_tokens - 1) // bs * bs for t in turns[:-1] for r in t)
    return {"cached_share": cached_share(later),
            "ideal_share": ideal / max(1, sum(r.prompt_tokens for r in later)),
            "ttft_p50": pct([r.ttft for r in later], 50),
            "ttft_p99": pct([r.ttft for r in later], 99),
            "tpot_p99": pct([r.tpot for r in later if r.output_tokens > 1], 99),
            # controls: turn 1 restores nothing in any config; the machine's load meanwhile
            "ttft_p50_turn1": pct([r.ttft for r in turns[0]], 50),
            "load": load, "decisions": choices, "stats": stats}


def report(topology: str, runs: dict[str, dict[str, Any]]) -> None:
    off = runs["off"]
    print(f"\n=== {topology} (turns >= 2; at most {100 * off['ideal_share']:.1f}% of their "
          f"prompt tokens can be cached: the previous turns, in whole blocks)")
    print(f"{'config':<11}{'cached%':>8}{'TTFT p50':>10}{'p99':>9}{'TPOT p99':>10}"
          f"{'TTFT x':>8}{'TPOT x':>8}{'hits h/d':>10}{'MB h/d':>14}{'restore ms':>11}"
          f"{'step ms':>9}{'turn1 TTFT':>11}{'load':>10}  decisions")
    for name, r in runs.items():
        st = r["stats"]
        # bytes out of each tier: host -> device (disk hits too: they pass through a host
        # slot) and disk -> host
        mb = "/".join(f"{st.get(f'kv_offload_bytes_restored_{t}', 0.0) / 1e6:.1f}"
                      for t in TIERS)
        hits = "/".join(str(int(st.get(f"kv_offload_hit_blocks_{t}", 0))) for t in TIERS)
        step = 1e3 * st.get("step_seconds", 0.0) / max(1.0, st.get("steps", 0.0))
        load = "-".join(f"{x:.1f}" for x in r["load"])
        print(f"{name:<11}{100 * r['cached_share']:>8.1f}{1e3 * r['ttft_p50']:>10.1f}"
              f"{1e3 * r['ttft_p99']:>9.1f}{1e3 * r['tpot_p99']:>10.2f}"
              f"{off['ttft_p50'] / r['ttft_p50']:>8.2f}{r['tpot_p99'] / off['tpot_p99']:>8.2f}"
              f"{hits:>10}{mb:>14}{1e3 * st.get('kv_offload_restore_seconds', 0.0):>11.1f}"
              f"{step:>9.1f}{1e3 * r['ttft_p50_turn1']:>11.1f}{load:>10}  {r['decisions']}")
    print("(TTFT x: off's TTFT p50 over this one's; TPOT x: this one's TPOT p99 over off's; "
          "MB h/d: restored out of the host tier (disk hits included) / out of the disk tier; "
          "step ms: mean engine step; turn1 TTFT: p50 of turn 1, which restores nothing "
          "anywhere: a control for noise; load: 1-minute load average at start-end)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topologies", default="1p1d,colocated", help="comma list of: 1p1d, colocated")
    p.add_argument("--model", default="bench-50m", help="a preset or a checkpoint dir")
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=64, help="the shared system prompt")
    p.add_argument("--user-tokens", type=int, default=16, help="new user tokens a turn (+-8)")
    p.add_argument("--output-len", type=int, default=32, help="tokens of each reply")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--num-kv-blocks", type=int, default=64, help="device KV blocks per engine")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--host-share", type=float, default=2.0,
                   help="host tier of 'host', as a multiple of all conversations' histories")
    p.add_argument("--disk-host-share", type=float, default=0.25,
                   help="host tier of 'host+disk', as a share of the histories (the rest spill "
                        "to the disk tier, sized for twice them)")
    p.add_argument("--settle", type=float, default=0.5, help="s before the engines' stats")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="seconds: tiny-llama, 2 conversations x 2 turns, colocated only")
    args = p.parse_args(argv)
    if args.smoke:  # still more histories than the device holds: restores happen
        args.model, args.topologies, args.conversations, args.turns = \
            "tiny-llama", "colocated", 4, 2
        args.system_tokens, args.user_tokens, args.output_len = 32, 16, 4
        args.concurrency, args.num_kv_blocks, args.max_model_len = 2, 8, 128
        args.settle = 0.2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tops = comma_list(args.topologies, TOPOLOGIES, "topology")
    if tops is None:
        return 2
    system, users = conversations(args)
    n = history_tokens(args)
    print(f"workload: {args.conversations} conversations x {args.turns} turns of {args.model}, "
          f"a {args.system_tokens}-token system prompt, +{args.user_tokens} user tokens and the "
          f"{args.output_len}-token reply a turn, {args.concurrency} in flight; "
          f"{args.num_kv_blocks} device blocks per engine; all histories {n} tokens "
          f"({n * kv_bytes_per_token(args.model) / 2**20:.1f} MiB of KV)", flush=True)
    from pd_cluster.serving.cluster.testing import ensure_ray
    ensure_ray(num_cpus=2)  # every config gets the same 2 CPUs
    runs = {top: {c: run(top, c, args, system, users) for c in CONFIGS} for top in tops}
    for top, by_config in runs.items():
        report(top, by_config)
    summary = []
    for config, key in (("host", "host"), ("host+disk", "disk")):
        share = min(runs[t][config]["cached_share"] for t in tops)
        speedup = min(runs[t]["off"]["ttft_p50"] / runs[t][config]["ttft_p50"] for t in tops)
        tpot = max(runs[t][config]["tpot_p99"] / runs[t]["off"]["tpot_p99"] for t in tops)
        summary += [f"cached_share_{key}={share:.3f}", f"ttft_p50_speedup_{key}={speedup:.2f}",
                    f"tpot_p99_ratio_{key}={tpot:.2f}"]
    print(f"\nload average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    print(" ".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
