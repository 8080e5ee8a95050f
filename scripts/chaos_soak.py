#!/usr/bin/env python
"""Chaos soak: a P/D cluster under a mixed load while its engines are paused, killed and
hung up on, then checked for wrong tokens, unclear failures, hangs, leaked KV and restarts.

The cluster is launched as a user does (`pd-cluster launch --config` a YAML written into the
log folder, in its own process group): --prefill/--decode engines of the built-in tiny-llama,
every request through P (disaggregation: always), Ray restarting killed engines without limit.
Reference outputs (greedy, fp32) come once from the offline engine (pd_cluster.LLM, no P/D)
for a fixed pool of prompts: short and long completions (some sharing long prefixes), chats,
max_tokens 8-128, some ignoring EOS.

Load: --clients closed-loop clients (httpx), completions and chat, streamed or not, every
call bounded. Some clients hang up: a stream closed after a few tokens, a non-streamed request
closed before its first token (mid-prefill). Chaos, from --chaos-workers workers at once,
each an event every 2-8 s: SIGSTOP of a random engine for 0.5-5 s (a fifth of them 5-11 s:
past the proxy's health timeout, so the engine is routed around and its requests move), then
SIGCONT; now and then a SIGKILL, of a running or a paused engine (an expected restart; the
next kill waits until Ray has restarted it). --fault-rate F also turns on the engines' fault
hook (engine.faults) at F per site and kind.

A completed request is exact when its token ids, text and finish reason equal the reference.
A failure is clear when it is an HTTP error with an OpenAI-style error body or a stream that
ends with an error event; anything else (a cut connection, a stream that ends without [DONE])
is unclear; a call past the client's timeout is hung. At the end every engine is resumed,
must be healthy, idle with every KV block free, and report no leak and no KV hold
(check_no_leaks, kv_holds over Ray); restarts are the proxy's counters (and PID changes seen).
The last line:

  requests=N completed=C exact=E failed_clear=F failed_unclear=U hung=H hangups=X
  blocks_leaked=L restarts=R expected_restarts=K PASS|FAIL

PASS: exact == completed, no unclear failure, no hang, no wrong token before a hang-up, no
block leaked and no leak report, restarts == expected_restarts, every engine back, and every
pool request exact once more after the chaos (with the fault hook on: exact or a clear
failure).

  python scripts/chaos_soak.py --minutes 10            # the soak
  python scripts/chaos_soak.py --smoke                 # 40 s of load, ~80 s in all (tests)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "tiny-llama"
URL_RE = re.compile(r"serving on (http://[0-9.]+:\d+)")
# The proxy's health checks: a paused engine is routed around after unhealthy_threshold (2)
# checks failed by this timeout.
HEALTH_INTERVAL, HEALTH_TIMEOUT = 1.0, 2.0
REQUEST_TIMEOUT = 60.0  # proxy.request_timeout: the bound on every request in the proxy
CALL_TIMEOUT = REQUEST_TIMEOUT + 30.0  # the client's bound: past it a call is hung
KV_TRANSFER_TIMEOUT = 5.0
# After the load, every engine is idle with its KV free within this: a P frees a dead D's
# blocks after kv_transfer_timeout, aborts land at once.
IDLE_TIMEOUT = 3 * KV_TRANSFER_TIMEOUT + 30.0
# The fault hook's sites and kinds this soak turns on with --fault-rate (engine.faults; control
# calls are only failed or delayed).
FAULTS = {"kv_send": ("drop", "corrupt", "fail"), "kv_recv": ("drop", "delay", "corrupt"),
          "token": ("drop", "delay", "corrupt"), "control": ("fail", "delay")}


# ---- the prompt pool and its reference outputs ----------------------------------------------
SHORT = ["The quick brown fox", "Once upon a time", "Hello world, this is", "The little cat",
         "My dog likes to", "In the forest there was", "A small bird sat", "Tom and Lily went"]
SENTENCES = ["In a distant land there lived a girl who loved to read.",
             "She had a dog named Max.", "Every morning they walked to the park.",
             "The sun was warm and the sky was blue.", "One day a big storm came to the town.",
             "The children played with a red ball.", "Cats eat fish and milk.",
             "A fox can run very fast.", "The old man sat by the river and sang a song."]
CHATS = [[{"role": "user", "content": "Tell me about cats."}],
         [{"role": "user", "content": "What do foxes eat?"}],
         [{"role": "user", "content": "Tell me a story about a dog."}],
         [{"role": "user", "content": "Hi!"},
          {"role": "assistant", "content": "Hello! What would you like to know?"},
          {"role": "user", "content": "Tell me about birds."}]]
MAX_TOKENS = (8, 16, 32, 64, 128)


@dataclass
class Item:
    name: str
    chat: bool
    prompt: Any  # text, or a list of chat messages
    max_tokens: int
    ignore_eos: bool
    ref_ids: list[int] = field(default_factory=list)
    ref_text: str = ""
    ref_finish: str = ""


def prompt_pool() -> list[Item]:
    """The fixed pool (the same for every seed): 16 short, 12 long, 8 chat requests."""
    rng = random.Random(1234)
    items = [Item(f"short-{i}", False, p, MAX_TOKENS[i % 5], i % 3 == 0)
             for i, p in enumerate(SHORT + [s + ", and then" for s in SHORT])]
    base = " ".join(rng.choice(SENTENCES) for _ in range(24))  # a long shared prefix
    for i in range(12):
        n = rng.randrange(8, 40)
        tail = " ".join(rng.choice(SENTENCES) for _ in range(n))
        text = f"{base} {tail}" if i % 2 else tail
        items.append(Item(f"long-{i}", False, text, MAX_TOKENS[(i + 2) % 5], i % 4 == 1))
    for i, conv in enumerate(CHATS * 2):
        items.append(Item(f"chat-{i}", True, conv, MAX_TOKENS[(i + 1) % 5], i >= 4))
    return items


def engine_section(args: argparse.Namespace) -> dict[str, Any]:
    return {"device": "cpu", "dtype": "float32", "num_kv_blocks": args.num_kv_blocks,
            "max_num_seqs": 32, "max_model_len": 1024}


def compute_references(items: list[Item], engine: dict[str, Any]) -> None:
    """Each item's greedy output from the offline engine, one request at a time. Eager (the
    engines serve eagerly until their compiled step is ready, token-exact either way): no
    compile competing with the cluster's start for the cores."""
    from pd_cluster import LLM, SamplingParams
    from pd_cluster.serving.cluster.cluster_config import resolve_model
    with LLM(model=resolve_model(MODEL), compile=False, **engine) as llm:
        for it in items:
            sp = SamplingParams(temperature=0.0, max_tokens=it.max_tokens,
                                ignore_eos=it.ignore_eos)
            out = (llm.chat(it.prompt, sp) if it.chat else llm.generate([it.prompt], sp))[0]
            o = out.outputs[0]
            it.ref_ids, it.ref_text, it.ref_finish = list(o.token_ids), o.text, o.finish_reason


# ---- the cluster --------------------------------------------------------------------------
def cluster_yaml(args: argparse.Namespace, namespace: str) -> dict[str, Any]:
    role = lambda n: {"replicas": n, "num_cpus": 1, "max_restarts": -1}  # noqa: E731
    engine = engine_section(args)
    if args.fault_rate > 0:
        engine["faults"] = {**{site: {kind: args.fault_rate for kind in FAULTS[site]}
                               for site in args.fault_sites}, "seed": args.seed}
    return {"mode": "disaggregated", "model": MODEL,
            "prefill": role(args.prefill), "decode": role(args.decode), "engine": engine,
            "kv_transfer": {"pipe": "auto", "transport": "tcp", "host": "127.0.0.1",
                            "kv_transfer_timeout": KV_TRANSFER_TIMEOUT},
            "proxy": {"host": "127.0.0.1", "port": 0, "request_timeout": REQUEST_TIMEOUT,
                      "health_check_interval": HEALTH_INTERVAL,
                      "health_check_timeout": HEALTH_TIMEOUT, "disaggregation": "always",
                      "shutdown_timeout": 5.0},
            "ray": {"namespace": namespace}}


class Cluster:
    """`pd-cluster launch --config FILE` in its own process group, its output in a file."""

    def __init__(self, config: Path, sets: list[str], log_dir: Path):
        self.log = log_dir / "launch.log"
        self.state_dir = log_dir / "state"
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        env.update(PD_CLUSTER_STATE_DIR=str(self.state_dir), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH"))
                                              if p))
        argv = [sys.executable, "-m", "pd_cluster.cli", "launch", "--config", str(config)]
        for s in sets:
            argv += ["--set", s]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_stop_with_parent)
        self.url = ""

    def wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = URL_RE.search(self.log.read_text(errors="replace"))
            if m:
                self.url = m.group(1)
                return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError(f"the cluster did not start (see {self.log}):\n" + self.tail())

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def record(self, namespace: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.state_dir / f"{namespace}.json").read_text())
        except (OSError, ValueError):
            return None

    def stop(self, timeout: float = 90.0) -> None:
        """SIGTERM the launcher (it drains and stops everything), then SIGKILL its group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its group is left
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def _stop_with_parent() -> None:
    """In the launcher's child: SIGTERM (drain and stop) when this script dies, however it
    dies: its own process group keeps it out of a killpg of ours."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def is_engine(pid: int) -> bool:
    """``pid`` is a live engine actor process (never signal a recycled PID)."""
    try:
        return b"EngineActor" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


# ---- the load -----------------------------------------------------------------------------
@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)  # failures by their message's start
    log: Any = None  # anomalies.jsonl

    def add(self, outcome: str, item: Item, detail: dict[str, Any] | None = None) -> None:
        self.counts["requests"] += 1
        self.counts[outcome] += 1
        if outcome in ("exact", "inexact"):
            self.counts["completed"] += 1
        if detail is not None:
            if "error" in detail:
                self.reasons[f"{outcome}: {str(detail['error'])[:90]}"] += 1
            self.log.write(json.dumps({"t": round(time.time(), 3), "outcome": outcome,
                                       "item": item.name, **detail}) + "\n")
            self.log.flush()


def error_message(body: bytes) -> str | None:
    """An OpenAI-style error body's message, else None."""
    try:
        err = json.loads(body)["error"]
        return str(err["message"])
    except (ValueError, KeyError, TypeError):
        return None


def request_body(item: Item, stream: bool) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": item.max_tokens, "temperature": 0,
                            "ignore_eos": item.ignore_eos, "return_token_ids": True,
                            "stream": stream}
    body["messages" if item.chat else "prompt"] = item.prompt
    return ("/v1/chat/completions" if item.chat else "/v1/completions"), body


def judge(item: Item, ids: list[int], text: str, finish: str | None) -> tuple[str, dict | None]:
    if ids == item.ref_ids and text == item.ref_text and finish == item.ref_finish:
        return "exact", None
    at = next((i for i, (a, b) in enumerate(zip(ids, item.ref_ids)) if a != b),
              min(len(ids), len(item.ref_ids)))
    return "inexact", {"first_diff": at, "got": ids, "want": item.ref_ids, "got_text": text,
                       "want_text": item.ref_text, "finish": finish, "want_finish": item.ref_finish}


async def one_request(http: Any, item: Item, stream: bool, hangup_after: int | None,
                      cancel_after: float | None, tally: Tally) -> None:
    """One call, judged and counted. ``hangup_after``: close the stream after that many
    tokens; ``cancel_after``: close a non-streamed call after that many seconds."""
    import httpx
    path, body = request_body(item, stream)
    start = time.monotonic()
    rid = ""
    try:
        if not stream:
            call = asyncio.ensure_future(http.post(path, json=body))
            if cancel_after is not None:
                done, _ = await asyncio.wait({call}, timeout=cancel_after)
                if not done:
                    call.cancel()
                    await asyncio.gather(call, return_exceptions=True)
                    tally.add("hangup", item)
                    return
            resp = await asyncio.wait_for(call, CALL_TIMEOUT)
            rid = resp.headers.get("x-request-id", "")
            if resp.status_code != 200:
                msg = error_message(resp.content)
                tally.add("failed_clear" if msg and resp.status_code >= 400 else "failed_unclear",
                          item, {"status": resp.status_code, "error": msg or resp.text[:300]})
                return
            data = resp.json()
            rid = data.get("id", rid)
            ch = data["choices"][0]
            text = ch["message"]["content"] if item.chat else ch["text"]
            outcome, detail = judge(item, ch.get("token_ids") or [], text or "",
                                    ch.get("finish_reason"))
            tally.add(outcome, item, detail and {**detail, "rid": rid, "stream": False})
            return
        await asyncio.wait_for(_stream(http, path, body, item, hangup_after, tally),
                               CALL_TIMEOUT)
    except (asyncio.TimeoutError, httpx.TimeoutException) as e:
        tally.add("hung", item, {"error": f"no answer in {time.monotonic() - start:.0f}s "
                                          f"({type(e).__name__})", "rid": rid, "stream": stream})
    except (httpx.HTTPError, ValueError, KeyError) as e:
        tally.add("failed_unclear", item, {"error": f"{type(e).__name__}: {e}"[:300],
                                           "rid": rid, "stream": stream})


async def _stream(http: Any, path: str, body: dict[str, Any], item: Item,
                  hangup_after: int | None, tally: Tally) -> None:
    ids: list[int] = []
    text, finish, done = "", None, False
    async with http.stream("POST", path, json=body) as resp:
        rid = resp.headers.get("x-request-id", "")
        if resp.status_code != 200:
            raw = await resp.aread()
            msg = error_message(raw)
            tally.add("failed_clear" if msg else "failed_unclear", item,
                      {"status": resp.status_code, "rid": rid, "stream": True,
                       "error": msg or raw[:300].decode(errors="replace")})
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            data = json.loads(line[6:])
            if "error" in data:
                tally.add("failed_clear", item, {"error": data["error"].get("message"),
                                                 "rid": rid, "stream": True, "tokens": len(ids)})
                return
            if not data.get("choices"):
                continue
            ch = data["choices"][0]
            ids.extend(ch.get("token_ids") or [])
            text += (ch.get("delta", {}).get("content") if item.chat else ch.get("text")) or ""
            finish = ch.get("finish_reason") or finish
            if hangup_after is not None and len(ids) >= hangup_after:
                break  # leaving the block closes the connection mid-stream
    if hangup_after is not None and not done:
        wrong = ids != item.ref_ids[:len(ids)]
        tally.add("hangup_wrong" if wrong else "hangup", item,
                  {"got": ids, "want": item.ref_ids, "rid": rid} if wrong else None)
        return
    if not done:
        tally.add("failed_unclear", item, {"error": "stream ended without [DONE]",
                                           "rid": rid, "stream": True, "tokens": len(ids)})
        return
    outcome, detail = judge(item, ids, text, finish)
    tally.add(outcome, item, detail and {**detail, "rid": rid, "stream": True})


async def client(url: str, items: list[Item], rng: random.Random, stop: asyncio.Event,
                 tally: Tally, args: argparse.Namespace) -> None:
    import httpx
    limits = httpx.Limits(max_connections=4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(CALL_TIMEOUT, connect=10.0),
                                 limits=limits) as http:
        while not stop.is_set():
            item = rng.choice(items)
            roll = rng.random()
            hangup_after = cancel_after = None
            if roll < args.hangup_stream:
                stream, hangup_after = True, rng.randint(1, max(1, min(6, len(item.ref_ids))))
            elif roll < args.hangup_stream + args.hangup_prefill:
                stream, cancel_after = False, rng.uniform(0.01, 0.4)
            else:
                stream = rng.random() < 0.5
            await one_request(http, item, stream, hangup_after, cancel_after, tally)
            await asyncio.sleep(rng.uniform(0.0, 0.2))


# ---- watching the cluster, and the chaos ---------------------------------------------------
@dataclass
class Watch:
    """The cluster as /cluster/status shows it, polled; PID changes seen per engine."""
    url: str
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    pid_changes: Counter = field(default_factory=Counter)
    errors: int = 0

    async def poll(self, http: Any) -> dict[str, Any] | None:
        try:
            st = (await http.get(f"{self.url}/cluster/status", timeout=15.0)).json()
        except Exception:  # noqa: BLE001 - counted; the proxy may be busy for a moment
            self.errors += 1
            return None
        for e in st["engines"]:
            self.engines[e["name"]] = e
            pid = e.get("pid") or 0
            old = self.pids.get(e["name"])
            if pid and old and pid != old:
                self.pid_changes[e["name"]] += 1
            if pid:
                self.pids[e["name"]] = pid
        return st


@dataclass
class Chaos:
    stops: int = 0
    long_stops: int = 0
    kills: int = 0
    killed_paused: int = 0  # of the kills, those of a paused engine
    killed: Counter = field(default_factory=Counter)
    paused: set[int] = field(default_factory=set)  # PIDs SIGSTOPped now
    restart_waits: list[float] = field(default_factory=list)
    restart_timeouts: int = 0

    pending: tuple[str, int, float] | None = None  # the killed engine not back yet

    def kill(self, name: str, pid: int, say: Any, how: str = "") -> None:
        os.kill(pid, signal.SIGKILL)
        self.kills += 1
        self.killed[name] += 1
        self.pending = (name, pid, time.monotonic())
        say(f"chaos: SIGKILL {name} (pid {pid}){how}")

    def check_pending(self, watch: Watch, timeout: float, say: Any) -> None:
        """The killed engine is back (healthy, a new PID), or overdue."""
        if self.pending is None:
            return
        name, old_pid, since = self.pending
        e = watch.engines.get(name, {})
        if e.get("healthy") and e.get("pid") not in (None, 0, old_pid):
            self.restart_waits.append(time.monotonic() - since)
            self.pending = None
        elif time.monotonic() - since > timeout:
            self.restart_timeouts += 1
            say(f"chaos: {name} not back {timeout:.0f}s after its SIGKILL")
            self.pending = None

    def resume(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        self.paused.discard(pid)

    def resume_all(self) -> None:
        for pid in list(self.paused):
            self.resume(pid)


async def chaos_loop(watch: Watch, chaos: Chaos, rng: random.Random, stop: asyncio.Event,
                     t0: float, duration: float, args: argparse.Namespace, say: Any) -> None:
    """One chaos worker: an event every --chaos-gap s until the run ends. Workers share
    ``chaos``: their pauses may overlap (on other engines), one killed engine at a time."""
    async def pause(seconds: float) -> bool:
        """Sleep unless the run ends first (True: it did)."""
        try:
            await asyncio.wait_for(stop.wait(), seconds)
            return True
        except asyncio.TimeoutError:
            return False

    while not await pause(rng.uniform(*args.chaos_gap)):
        chaos.check_pending(watch, args.restart_timeout, say)
        targets = [(n, e["pid"]) for n, e in watch.engines.items()
                   if e.get("healthy") and n != (chaos.pending or ("",))[0]
                   and e["pid"] not in chaos.paused and is_engine(e.get("pid") or 0)]
        if not targets:
            continue
        name, pid = rng.choice(sorted(targets))
        elapsed = time.monotonic() - t0
        if chaos.pending is None and (rng.random() < args.kill_rate or
                                      (chaos.kills == 0 and elapsed > 0.2 * duration)):
            chaos.kill(name, pid, say)
            continue
        long = rng.random() < 0.2
        seconds = rng.uniform(5.0, 11.0) if long else rng.uniform(0.5, 5.0)
        # Now and then a paused engine is killed instead of resumed (it dies frozen).
        kill_paused = rng.random() < args.kill_rate / 2
        os.kill(pid, signal.SIGSTOP)
        chaos.paused.add(pid)
        chaos.stops += 1
        chaos.long_stops += long
        try:
            await asyncio.sleep(seconds)  # not cut short: the run's end waits for the SIGCONT
            if kill_paused and chaos.pending is None:
                chaos.kill(name, pid, say, f" after {seconds:.1f}s paused")
                chaos.killed_paused += 1
        finally:
            chaos.resume(pid)


async def watch_loop(watch: Watch, stop: asyncio.Event, tally: Tally, chaos: Chaos,
                     t0: float, say: Any) -> None:
    import httpx
    last = 0.0
    async with httpx.AsyncClient() as http:
        while not stop.is_set():
            await watch.poll(http)
            now = time.monotonic()
            if now - last >= 10.0:
                last = now
                c = tally.counts
                say(f"[{now - t0:5.0f}s] requests={c['requests']} completed={c['completed']} "
                    f"exact={c['exact']} failed_clear={c['failed_clear']} failed_unclear="
                    f"{c['failed_unclear']} hung={c['hung']} hangups={c['hangup']} | "
                    f"stops={chaos.stops} kills={chaos.kills} paused={len(chaos.paused)}")
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass


async def soak(url: str, items: list[Item], args: argparse.Namespace, tally: Tally,
               watch: Watch, chaos: Chaos, say: Any) -> None:
    rng = random.Random(args.seed)
    stop = asyncio.Event()
    duration = args.minutes * 60.0
    t0 = time.monotonic()
    import httpx
    async with httpx.AsyncClient() as http:
        await watch.poll(http)
    watcher = asyncio.create_task(watch_loop(watch, stop, tally, chaos, t0, say))
    chaos_tasks = [asyncio.create_task(chaos_loop(watch, chaos, random.Random(rng.random()),
                                                  stop, t0, duration, args, say))
                   for _ in range(args.chaos_workers)]
    clients = [asyncio.create_task(client(url, items, random.Random(rng.random()), stop,
                                          tally, args)) for _ in range(args.clients)]
    try:
        await asyncio.sleep(duration)
    finally:
        stop.set()
        # Each client ends after its call (each call bounded by CALL_TIMEOUT).
        await asyncio.gather(*chaos_tasks, *clients, return_exceptions=True)
        chaos.resume_all()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


# ---- the end: everything back, nothing held ------------------------------------------------
def wait_back(watch: Watch, healthy_timeout: float, idle_timeout: float, require_idle: bool
              ) -> tuple[dict[str, Any] | None, list[str]]:
    """Until every engine is healthy (within ``healthy_timeout``), and with ``require_idle``
    then idle with no KV block used (within ``idle_timeout`` more: a P frees the blocks of a
    dead D's KV after kv_transfer_timeout): the last status and what was still wrong."""
    import httpx
    deadline = time.monotonic() + healthy_timeout
    why: list[str] = ["no status"]
    st = None
    idle_phase = False
    with httpx.Client() as http:
        while time.monotonic() < deadline:
            try:
                st = http.get(f"{watch.url}/cluster/status", timeout=15.0).json()
            except Exception as e:  # noqa: BLE001
                why = [f"status: {type(e).__name__}: {e}"]
                time.sleep(1.0)
                continue
            why = [f"{e['name']} unhealthy ({e.get('last_error')})"
                   for e in st["engines"] if not e["healthy"]]
            if not why and require_idle:
                if not idle_phase:
                    idle_phase, deadline = True, time.monotonic() + idle_timeout
                why = [f"{st['inflight']} request(s) in flight"] if st["inflight"] else []
                for e in st["engines"]:
                    s = e.get("stats", {})
                    if e["inflight"] or s.get("num_running") or s.get("num_waiting") \
                            or s.get("kv_blocks_used"):
                        why.append(f"{e['name']}: inflight {e['inflight']}, running "
                                   f"{s.get('num_running')}, waiting {s.get('num_waiting')}, "
                                   f"kv_blocks_used {s.get('kv_blocks_used')}")
            if not why:
                return st, []
            time.sleep(1.0)
    return st, why


async def after_pass(url: str, items: list[Item], tally: Tally) -> None:
    """Every pool request once more, four at a time, on the cluster left by the chaos."""
    import httpx
    sem = asyncio.Semaphore(4)

    async def one(http: Any, item: Item, stream: bool) -> None:
        async with sem:
            await one_request(http, item, stream, None, None, tally)
    async with httpx.AsyncClient(base_url=url,
                                 timeout=httpx.Timeout(CALL_TIMEOUT, connect=10.0)) as http:
        await asyncio.gather(*(one(http, it, i % 2 == 1) for i, it in enumerate(items)))


def leak_reports(record: dict[str, Any] | None, names: list[str]) -> dict[str, str]:
    """check_no_leaks and kv_holds of every engine over Ray: name -> what is left."""
    if record is None or not record.get("address"):
        return {"ray": "no launch record: not checked"}
    import ray

    from pd_cluster.serving.cluster.ray_runtime import connect
    out: dict[str, str] = {}
    try:
        connect(record["address"], record["namespace"])
        for name in names:
            actor = ray.get_actor(name, namespace=record["namespace"])
            for attempt in range(10):  # a control call the fault hook failed: once more
                try:
                    ray.get(actor.check_no_leaks.remote(), timeout=30)
                    out.pop(name, None)
                    held = {k: v for k, v in
                            ray.get(actor.kv_holds.remote(), timeout=30).items() if v}
                    if held:
                        out[name] = f"KV held: {held}"
                    break
                except Exception as e:  # noqa: BLE001 - AssertionError: what leaked
                    out[name] = str(e).strip().splitlines()[-1][:300]
                    if isinstance(e, AssertionError):
                        break
    except Exception as e:  # noqa: BLE001
        out["ray"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        ray.shutdown()
    return out


def metric_sums(url: str, names: tuple[str, ...]) -> dict[str, float]:
    import httpx
    try:
        text = httpx.get(f"{url}/metrics", timeout=15.0).text
    except httpx.HTTPError:
        return {}
    out = {n: 0.0 for n in names}
    for line in text.splitlines():
        for n in names:
            if line.startswith(n + "{") or line.startswith(n + " "):
                out[n] += float(line.rsplit(" ", 1)[1])
    return out


# ---- main ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long the load and chaos run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--fault-rate", type=float, default=0.0,
                   help="engine.faults at this rate per site and kind (0: the hook off)")
    p.add_argument("--fault-sites", default=",".join(FAULTS),
                   help=f"comma list of the sites --fault-rate applies to: {', '.join(FAULTS)}")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--num-kv-blocks", type=int, default=256, help="per engine (16 tokens each)")
    p.add_argument("--kill-rate", type=float, default=0.15, help="share of chaos events that "
                   "are SIGKILLs (at least one per run)")
    p.add_argument("--chaos-workers", type=int, default=2,
                   help="chaos events this many at a time (pauses of different engines overlap)")
    p.add_argument("--hangup-stream", type=float, default=0.08,
                   help="share of requests: a stream closed after 1-6 tokens")
    p.add_argument("--hangup-prefill", type=float, default=0.05,
                   help="share of requests: a non-streamed call closed after 10-400 ms")
    p.add_argument("--restart-timeout", type=float, default=240.0,
                   help="s a killed engine has to come back")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="cluster config override (repeatable), as `pd-cluster launch --set`")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="about 40 s of load (CI)")
    args = p.parse_args(argv)
    args.fault_sites = [x.strip() for x in args.fault_sites.split(",") if x.strip()]
    if unknown := [x for x in args.fault_sites if x not in FAULTS]:
        p.error(f"--fault-sites: unknown {unknown}; choose from {', '.join(FAULTS)}")
    args.chaos_gap = (2.0, 8.0)
    if args.smoke:
        args.minutes, args.clients, args.chaos_gap = 0.67, 3, (2.0, 4.0)
    return args


def _interrupted(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)  # the cleanup below runs, as on Ctrl-C
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="chaos-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def say(msg: str) -> None:
        with lock:
            print(msg, flush=True)

    import yaml
    namespace = f"chaos-soak-{os.getpid()}"
    config = log_dir / "cluster.yaml"
    config.write_text(yaml.safe_dump(cluster_yaml(args, namespace), sort_keys=False))
    say(f"chaos soak: {args.minutes:g} min, {args.prefill}P{args.decode}D {MODEL}, "
        f"{args.clients} clients, seed {args.seed}, fault rate {args.fault_rate:g}; "
        f"logs {log_dir}")
    t_start = time.monotonic()
    cluster = Cluster(config, args.set, log_dir)  # starts while the references are computed
    tally = Tally(log=open(log_dir / "anomalies.jsonl", "w"))
    chaos = Chaos()
    try:
        items = prompt_pool()
        compute_references(items, engine_section(args))
        say(f"references: {len(items)} requests ({time.monotonic() - t_start:.0f}s)")
        url = cluster.wait_for_url(600.0)
        say(f"cluster serving on {url} ({time.monotonic() - t_start:.0f}s)")
        watch = Watch(url)
        asyncio.run(soak(url, items, args, tally, watch, chaos, say))
        say(f"load over; waiting for every engine back, idle and with its KV free "
            f"({time.monotonic() - t_start:.0f}s)")
        _, not_back = wait_back(watch, args.restart_timeout, 0.0, require_idle=False)
        after = Tally(log=tally.log)
        if not not_back:
            asyncio.run(after_pass(url, items, after))
        t_idle = time.monotonic()
        st, not_back = wait_back(watch, 60.0, IDLE_TIMEOUT, require_idle=True)
        say(f"engines back and idle ({time.monotonic() - t_start:.0f}s; idle after "
            f"{time.monotonic() - t_idle:.0f}s)")
        names = sorted(watch.engines)
        leaks = leak_reports(cluster.record(namespace), names)
        metrics = metric_sums(url, ("pd_migrations_total", "pd_retries_total",
                                    "pd_degraded_requests_total",
                                    "pd_first_token_mismatch_total"))
    except BaseException:
        chaos.resume_all()
        say("cluster log tail:\n" + cluster.tail())
        cluster.stop()
        raise
    cluster.stop()
    tally.log.close()
    return report(args, tally, after, chaos, watch, st, not_back, leaks, metrics,
                  time.monotonic() - t_start, say)


def report(args: argparse.Namespace, tally: Tally, after: Tally, chaos: Chaos, watch: Watch,
           st: dict[str, Any] | None, not_back: list[str], leaks: dict[str, str],
           metrics: dict[str, float], wall: float, say: Any) -> int:
    c = tally.counts
    engines = st["engines"] if st else []
    leaked = sum(int(e.get("stats", {}).get("kv_blocks_used") or 0) for e in engines)
    proxy_restarts = sum(int(e.get("restarts") or 0) for e in engines)
    restarts = max(proxy_restarts, sum(watch.pid_changes.values()))
    fallbacks = sum(int(e.get("stats", {}).get("kv_fallbacks") or 0) for e in engines)
    waits = ", ".join(f"{w:.0f}s" for w in chaos.restart_waits if w >= 0) or "-"
    late = f"; {chaos.restart_timeouts} not back in time" if chaos.restart_timeouts else ""
    say(f"\n=== chaos soak: {args.minutes:g} min of load ({wall:.0f}s in all), "
        f"{args.prefill}P{args.decode}D, {args.clients} clients, seed {args.seed}, "
        f"fault rate {args.fault_rate:g} ===")
    say(f"chaos: {chaos.stops} SIGSTOPs ({chaos.long_stops} of 5-11 s), {chaos.kills} SIGKILLs "
        f"({chaos.killed_paused} of them paused; {dict(chaos.killed)}; back in {waits}{late})")
    say(f"hang-ups: {c['hangup']} ({c['hangup_wrong']} with a wrong token before)")
    say("proxy: " + ", ".join(f"{k.removeprefix('pd_').removesuffix('_total')} {v:g}"
                              for k, v in metrics.items())
        + f"; engines: kv_fallbacks {fallbacks}; restarts by proxy {proxy_restarts}, "
          f"PID changes {dict(watch.pid_changes)}")
    for reason, n in tally.reasons.most_common(8):
        say(f"  {n:4d}x {reason}")
    a = after.counts
    say(f"after the chaos: {a['exact']}/{a['requests']} pool requests exact"
        + (f" ({dict(a)})" if a["exact"] != a["requests"] else "")
        + (" (the fault hook still on: clear failures allowed)" if args.fault_rate > 0 else ""))
    if not_back:
        say("not back (healthy and idle) at the end: " + "; ".join(not_back))
    say("leak reports: " + (json.dumps(leaks) if leaks else "none"))
    ok = (c["exact"] == c["completed"] and not c["failed_unclear"] and not c["hung"]
          and not c["hangup_wrong"] and leaked == 0 and not leaks and not not_back
          and a["requests"] and a["exact"] == a["completed"] and not a["failed_unclear"]
          and not a["hung"] and (args.fault_rate > 0 or a["exact"] == a["requests"])
          and restarts == chaos.kills and not chaos.restart_timeouts)
    say(f"requests={c['requests']} completed={c['completed']} exact={c['exact']} "
        f"failed_clear={c['failed_clear']} failed_unclear={c['failed_unclear']} hung={c['hung']} "
        f"hangups={c['hangup'] + c['hangup_wrong']} blocks_leaked={leaked} restarts={restarts} "
        f"expected_restarts={chaos.kills} {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
