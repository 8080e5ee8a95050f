#!/usr/bin/env python
"""The SLO controller for real (issue 40's benchmark, the mechanics): a cluster of the
built-in model (tiny-llama, fp32 CPU) on 3 engine slots, started 1P2D with the planner on
(bounds 1-2 per role, 3 engines at most, short interval and cooldown), so it may switch
engines between roles on its own. A load that shifts phase (long prompts and short answers,
then short prompts and long answers), greedy streamed requests at a steady pace. Reported:
every decision the controller made (/cluster/status planner.last, polled, and /metrics
pd_planner_decisions_total), every output against the offline engine (pd_cluster.LLM,
temperature 0, ignore_eos), requests lost, and a leak check at the end (no request, KV
block or KV hold on any engine). The policy is the simulator's business
(scripts/bench_planner.py); this checks that its switches lose and change nothing.

  python scripts/bench_planner_real.py            # ~2-3 min on 2 cores
  python scripts/bench_planner_real.py --smoke    # fewer, shorter requests (the test)

Last lines: decisions=N real_outputs_equal=True/False requests_lost=N leaks=none/...
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

MODEL = "tiny-llama"
DEFAULT_PROFILE = Path(__file__).resolve().parent / "profiles" / "llama-58m-cpu.json"
_SHOWN = ("enabled", "measured", "pending", "decisions", "next_action")
IDLE_HOLDS = {"kv_staging_bytes": 0, "kv_receiving": 0, "kv_send_holds": 0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE,
                   help="the controller's cost table (default: bench-50m measured here)")
    p.add_argument("--per-phase", type=int, default=80, help="requests per phase")
    p.add_argument("--gap-s", type=float, default=0.25, help="s between arrivals")
    p.add_argument("--long-prompt", type=int, default=400)
    p.add_argument("--long-answer", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="30 requests per phase, shorter")
    args = p.parse_args(argv)
    if args.smoke:
        args.per_phase, args.long_prompt, args.long_answer = 30, 300, 32
    return args


def phases(args: argparse.Namespace) -> list[tuple[str, list[tuple[list[int], int]]]]:
    """(name, [(prompt ids, max_tokens)]) per phase: deterministic token ids."""
    def prompt(i: int, n: int, seed: int) -> list[int]:
        return [4 + (seed * 97 + i * 31 + j * 7) % 490 for j in range(n)]
    n = args.per_phase
    return [("long_prompts", [(prompt(i, args.long_prompt - i % 7, 1), 2) for i in range(n)]),
            ("long_answers", [(prompt(i, 6 + i % 5, 2), args.long_answer) for i in range(n)])]


def cluster_config(args: argparse.Namespace, namespace: str) -> Any:
    from pd_cluster.serving.cluster.testing import local_config
    return local_config(
        "local", namespace,
        prefill={"replicas": 1}, decode={"replicas": 2},
        engine={"num_kv_blocks": 512, "max_model_len": 512},
        kv_transfer={"kv_transfer_timeout": 5.0},
        proxy={"request_timeout": 120.0, "health_check_timeout": 5.0,
               "disaggregation": "always", "slo": {"ttft_ms": 20000, "tpot_ms": 2000}},
        planner={"enabled": True, "profile": str(args.profile), "interval_s": 1.0,
                 "cooldown_s": 3.0, "min_prefill": 1, "max_prefill": 2, "min_decode": 1,
                 "max_decode": 2, "max_engines": 3, "hysteresis": 0.15,
                 "scale_down_after_s": 3600.0})


async def _one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int
               ) -> tuple[str, list[int], str | None]:
    from pd_cluster.serving.cluster.testing import stream_completion
    try:
        return await stream_completion(http, MODEL, prompt, max_tokens)
    except httpx.HTTPError as e:  # counted as lost, not a crash of the benchmark
        return "transport", [], repr(e)


async def drive(url: str, work: list[tuple[list[int], int]], gap_s: float
                ) -> list[tuple[str, list[int], str | None]]:
    """Every request of ``work``, one started every ``gap_s`` s; all awaited (bounded)."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        tasks = []
        for prompt, max_tokens in work:
            tasks.append(asyncio.create_task(_one(http, prompt, max_tokens)))
            await asyncio.sleep(gap_s)
        return await asyncio.wait_for(asyncio.gather(*tasks), 600)


class DecisionLog:
    """Polls /cluster/status on a thread: every distinct planner.last and the roles seen."""

    def __init__(self, url: str):
        self.url, self.decisions, self.roles = url, [], []
        self.planner: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                st = httpx.get(f"{self.url}/cluster/status", timeout=10).json()
            except httpx.HTTPError:
                continue
            self.planner = st.get("planner") or {}
            last = dict(self.planner.get("last") or {})
            last.pop("ago_s", None)  # the same decision, seen later
            if last and (not self.decisions or last != self.decisions[-1]):
                self.decisions.append(last)
            roles = "".join(sorted(e["role"][0].upper() + ("" if e["state"] == "serving"
                                                           else "~") for e in st["engines"]))
            if not self.roles or self.roles[-1] != roles:
                self.roles.append(roles)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


def settle(url: str, timeout: float = 90.0) -> None:
    """Wait (bounded) for a change under way to end: every engine serving again."""
    from pd_cluster.serving.cluster.testing import cluster_status, wait_until
    wait_until(lambda: all(e["state"] == "serving" for e in cluster_status(url)["engines"]),
               timeout, "every engine serving")


def decisions_metric(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("pd_planner_decisions_total{")}


def leaks(cluster: Any) -> list[str]:
    """Every engine idle with all KV blocks free, no leak report, no KV hold."""
    import ray
    from pd_cluster.serving.cluster.testing import wait_idle, wait_until
    out = []
    try:
        st = wait_idle(cluster.url, timeout=60)
    except AssertionError as e:
        return [str(e)]
    for e in st["engines"]:
        if e["stats"].get("kv_blocks_used"):
            out.append(f"{e['name']}: kv_blocks_used {e['stats']['kv_blocks_used']}")
    handles = {e["name"]: ray.get_actor(e["name"], namespace=cluster.namespace)
               for e in st["engines"]}
    for name, h in handles.items():
        try:
            ray.get(h.check_no_leaks.remote(), timeout=30)
        except Exception as err:  # noqa: BLE001 - reported, not raised
            out.append(f"{name}: {err}")
    try:
        wait_until(lambda: all(ray.get(h.kv_holds.remote(), timeout=30) == IDLE_HOLDS
                               for h in handles.values()), 30, "no KV hold")
    except AssertionError as e:
        out.append(str(e))
    return out


def expected(work: list[tuple[list[int], int]]) -> list[list[int]]:
    from pd_cluster import LLM, SamplingParams
    from pd_cluster.serving.cluster.cluster_config import resolve_model
    llm = LLM(model=resolve_model(MODEL), num_kv_blocks=512, max_model_len=512)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    return [list(o.outputs[0].token_ids) for o in llm.generate([p for p, _ in work], params)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pd_cluster.serving.cluster.launcher import launch
    from pd_cluster.serving.cluster.testing import ensure_ray
    os.environ.setdefault("PD_CLUSTER_STATE_DIR", tempfile.mkdtemp(prefix="pd-bench-"))
    ensure_ray()
    t0 = time.monotonic()
    cluster = launch(cluster_config(args, f"bench-planner-{os.getpid()}"), progress=False)
    print(f"cluster up in {time.monotonic() - t0:.1f}s at {cluster.url}", flush=True)
    log = DecisionLog(cluster.url)
    got, work_all, lost = [], [], []
    try:
        for name, work in phases(args):
            t = time.monotonic()
            results = asyncio.run(drive(cluster.url, work, args.gap_s))
            print(f"phase {name}: {len(work)} requests in {time.monotonic() - t:.1f}s, "
                  f"engines now {log.roles[-1] if log.roles else '?'}; planner: "
                  f"{json.dumps({k: log.planner.get(k) for k in _SHOWN})}", flush=True)
            lost += [(name, i, o, e) for i, (o, _, e) in enumerate(results) if o != "ok"]
            got += [ids for _, ids, _ in results]
            work_all += work
        settle(cluster.url)
        log.stop()
        metric = decisions_metric(cluster.url)
        leak = leaks(cluster)
    finally:
        log.stop()
        cluster.shutdown()
    want = expected(work_all)
    differ = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    return {"decisions": log.decisions, "metric": metric, "roles": log.roles, "lost": lost,
            "differ": differ, "leaks": leak, "requests": len(work_all)}


def report(r: dict[str, Any]) -> None:
    for d in r["decisions"]:
        print("decision:", json.dumps(d, sort_keys=True))
    for k, v in r["metric"].items():
        print(f"{k} {v:g}")
    print("engine roles over the run:", " -> ".join(r["roles"]))
    for x in r["lost"][:5]:
        print("lost:", x)
    if r["differ"]:
        print("outputs differing from offline (indices):", r["differ"][:20])
    print(f"requests={r['requests']} decisions={int(sum(r['metric'].values()))} "
          f"real_outputs_equal={not r['differ'] and not r['lost']} "
          f"requests_lost={len(r['lost'])} leaks={'; '.join(r['leaks']) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    r = run(parse_args(argv))
    report(r)
    ok = r["metric"] and not r["differ"] and not r["lost"] and not r["leaks"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
