#!/usr/bin/env python
"""Checks one launched cluster against the colocated engine: the comparison logic of
scripts/gpu_check.sh (which launches each cluster), kept here so that it is testable.

  check_cluster.py reference --config C [--set K=V ...] --out ref.json
      the colocated engine (this process, the config's engine arguments: same model, dtype and
      device) answers the fixed requests below, one at a time; run it before the cluster starts
  check_cluster.py check --url URL --reference ref.json [--bench-args "..."]
      the cluster answers the same requests (before and after a scripts/bench_serving.py load),
      then must be idle with no KV block held; decode engines must have received KV (no local
      prefill fallback). Exit 1 on any failure.

The last line printed is the summary: ``check_cluster: ok ...`` or ``check_cluster: FAIL`` and
what failed.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The fixed requests: (name, prompt text, sampling fields). Requests run one at a time on both
# sides, so batch composition cannot change a result (it may in bf16 on a GPU).
GREEDY = {"temperature": 0.0, "max_tokens": 24}
SEEDED = {"temperature": 0.8, "top_p": 0.95, "max_tokens": 16}
EXTRA = {"ignore_eos": True}  # outside the openai client's own arguments: extra_body
REQUESTS: list[tuple[str, str, dict[str, Any]]] = [  # one prompt per entry
    ("greedy-fox", "The quick brown fox", GREEDY),
    ("greedy-story", "Once upon a time", GREEDY),
    ("greedy-hello", "Hello world, this is", GREEDY),
    ("greedy-long", "In a distant land there lived a girl who loved to read. " * 6, GREEDY),
    ("seeded-7", "Once upon a time, a little bird", {**SEEDED, "seed": 7}),
    ("seeded-1234", "The little cat", {**SEEDED, "seed": 1234}),
]
STREAMED = "greedy-story"  # also requested as a stream: the streamed text must be the same
# Each pass asks its own prompts (the pass's prefix + the prompt): a prompt asked again could be
# served from P's prefix cache, whose numerics may differ from a full prefill in bf16.
PASSES = {"before load": "", "after load": "Later that day. "}


def reference(config: str, sets: list[str], out: Path) -> int:
    """Every fixed request's token ids and text from the colocated engine."""
    from pd_cluster import LLM, SamplingParams
    from pd_cluster.serving.cluster.cluster_config import (load_config, parse_overrides,
                                                           resolve_model)
    cfg = load_config(config, parse_overrides(sets))
    llm = LLM(model=resolve_model(cfg.model), **dict(cfg.engine))
    tok = llm.get_tokenizer()
    refs: dict[str, dict[str, Any]] = {}
    for when, prefix in PASSES.items():
        for name, prompt, fields in REQUESTS:
            ids = list(tok.encode(prefix + prompt))  # as the proxy tokenizes a text prompt
            o = llm.generate([ids], SamplingParams(**fields, **EXTRA))[0].outputs[0]
            refs.setdefault(when, {})[name] = {"token_ids": list(o.token_ids), "text": o.text}
    llm.engine.check_no_leaks()
    out.write_text(json.dumps({"config": config, "model": cfg.model_name, "requests": refs}))
    print(f"reference: {len(PASSES)} x {len(REQUESTS)} requests from the colocated engine ({cfg.model_name}, "
          f"{cfg.engine.get('device', 'auto')}, {cfg.engine.get('dtype', 'auto')}) -> {out}")
    return 0


def _compare(client: Any, model: str, refs: dict[str, Any], when: str) -> list[str]:
    """Names of the requests whose answer differs from the reference (with a short why)."""
    failed = []
    refs, prefix = refs[when], PASSES[when]
    for name, prompt, fields in REQUESTS:
        want = refs[name]
        try:
            r = client.completions.create(model=model, prompt=prefix + prompt, **fields,
                                          extra_body={**EXTRA, "return_token_ids": True})
            got = list(r.choices[0].token_ids)  # type: ignore[attr-defined]
            text = r.choices[0].text
        except Exception as e:  # noqa: BLE001 - a failed request is a failed check
            failed.append(f"{name} {when}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if got != want["token_ids"] or text != want["text"]:
            at = next((i for i, (a, b) in enumerate(zip(got, want["token_ids"])) if a != b),
                      min(len(got), len(want["token_ids"])))
            failed.append(f"{name} {when}: differs at token {at}")
            print(f"  {name} {when}: got {got}\n  {' ' * len(name)} reference {want['token_ids']}")
    name, prompt, fields = next(r for r in REQUESTS if r[0] == STREAMED)
    try:
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=prefix + prompt, stream=True, **fields, extra_body=EXTRA)
            if c.choices)
    except Exception as e:  # noqa: BLE001
        text = f"<{type(e).__name__}: {e}>"
    if text != refs[name]["text"]:
        failed.append(f"{name} streamed {when}: text differs")
        print(f"  streamed: {text!r}\n  reference: {refs[name]['text']!r}")
    return failed


def _bench(url: str, bench_args: str) -> list[str]:
    """A scripts/bench_serving.py load against the cluster: every request must succeed."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--url", url,
           "--modes", "pd", "--no-progress", *shlex.split(bench_args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(proc.stdout.rstrip())
    summary = next((ln for ln in proc.stdout.splitlines() if ln.startswith("=== pd:")), None)
    if proc.returncode != 0 or summary is None or " 0 failed" not in summary:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [f"load: {summary or tail}"]
    return []


def _idle_and_leak_free(url: str, timeout: float) -> tuple[list[str], dict[str, Any]]:
    """Wait (bounded) until nothing is in flight; then every KV block must be free."""
    import httpx
    deadline = time.monotonic() + timeout
    while True:
        st = httpx.get(f"{url}/cluster/status", timeout=30).json()
        held = {e["name"]: (e["inflight"], e["stats"].get("num_active", 0),
                            e["stats"].get("kv_blocks_used", 0)) for e in st["engines"]}
        if not st["inflight"] and not any(any(v) for v in held.values()):
            return [], st
        if time.monotonic() > deadline:
            return [f"leak: {name} holds {r} request(s), {a} active, {b} KV block(s)"
                    for name, (r, a, b) in held.items() if any((r, a, b))] or \
                   [f"leak: {st['inflight']} request(s) in flight at the proxy"], st
        time.sleep(0.5)


def _kv_moved(st: dict[str, Any]) -> list[str]:
    """In a disaggregated cluster, decode engines got the prompts' KV from prefill engines."""
    failed = []
    for e in st["engines"]:
        s = e["stats"]
        print(f"  {e['name']}: healthy={e['healthy']} requests={s.get('requests_total')} "
              f"KV blocks {s.get('kv_blocks_used')}/{s.get('kv_blocks_total')} used, KV bytes "
              f"sent {s.get('kv_bytes_sent', 0)} received {s.get('kv_bytes_received', 0)}, "
              f"fallbacks {s.get('kv_fallbacks', 0)}")
        if not e["healthy"]:
            failed.append(f"{e['name']} unhealthy: {e.get('last_error')}")
        if e["role"] == "decode" and (not s.get("kv_bytes_received") or s.get("kv_fallbacks")):
            failed.append(f"{e['name']}: KV did not arrive from prefill (received "
                          f"{s.get('kv_bytes_received', 0)} bytes, "
                          f"{s.get('kv_fallbacks', 0)} fallback(s))")
    return failed


def check(url: str, ref_path: Path, bench_args: str, idle_timeout: float) -> int:
    import openai
    refs = json.loads(ref_path.read_text())["requests"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    failed = _compare(client, model, refs, "before load")
    if bench_args != "none":
        failed += _bench(url, bench_args)
    failed += _compare(client, model, refs, "after load")
    leaks, st = _idle_and_leak_free(url, idle_timeout)  # after the load, as the last check
    failed += leaks + _kv_moved(st)
    if failed:
        more = f"; and {len(failed) - 6} more" if len(failed) > 6 else ""
        print(f"check_cluster: FAIL {len(failed)}: " + "; ".join(failed[:6]) + more)
        return 1
    print(f"check_cluster: ok: {len(REQUESTS)} requests (+1 streamed) equal the colocated "
          f"engine before and after the load; idle with every KV block free")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("reference", help="the colocated engine's answers, saved as JSON")
    r.add_argument("--config", required=True)
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("check", help="a running cluster against a saved reference")
    c.add_argument("--url", required=True)
    c.add_argument("--reference", type=Path, required=True)
    c.add_argument("--bench-args", default="--smoke",
                   help="arguments of scripts/bench_serving.py for the load ('none': no load)")
    c.add_argument("--idle-timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    if args.command == "reference":
        return reference(args.config, args.set, args.out)
    return check(args.url, args.reference, args.bench_args, args.idle_timeout)


if __name__ == "__main__":
    sys.exit(main())
