"""`pd-cluster serve MODEL` end to end, as a user runs it: no YAML, the official `openai` SDK
against it (vLLM's naming rule, a 404 naming what is served), then Ctrl-C during 8 streams: the
shutdown finishes what it started (each stream finishes or ends with "server shutting down", a
new request meanwhile gets 503 with Retry-After, nothing logs a 500) and stops everything it
started: no process of its session or Ray session folder is left, the port is closed, and its
(piped) output holds no terminal colour codes.

One launch serves both halves (a `serve` starts its own Ray instance and cluster: one of the
suite's most expensive set-ups); the drain's parts without a cluster: tests/test_shutdown_drain.py.
Ctrl-C with nothing in flight: tests/test_cluster_launch.py."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pd_cluster.serving.cluster.testing import wait_until
from tests.launch_helpers import Launcher, _env


pytestmark = pytest.mark.timeout(900)  # `pd-cluster serve` starts a Ray cluster


def _session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the launcher's own, started with setsid)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # state, ppid, pgrp, session
            pids.append(int(entry.name))
    return pids


def _stream(url: str, out: dict[int, Any], i: int, started: threading.Event,
            counter: list[int], lock: threading.Lock) -> None:
    body = {"model": "tiny-llama", "prompt": f"Story {i}:", "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[Any] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            out[i] = {"status": r.status_code, "events": events}
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 1:
                    with lock:
                        counter[0] += 1
                        if counter[0] == 8:
                            started.set()
    except httpx.HTTPError as e:
        out[i] = {"status": None, "events": events, "error": repr(e)}


def _sdk_and_access_log(url: str, launcher: Launcher, sid: int) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny-llama", "my-alias"]
    out = client.completions.create(model="my-alias", prompt="Once upon a time",
                                    max_tokens=4, temperature=0)
    assert out.model == "tiny-llama" and out.usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError, match="serves `tiny-llama`, `my-alias`"):
        client.completions.create(model="tiny-lama", prompt="x", max_tokens=1)
    assert len(_session_pids(sid)) > 1  # the engines and Ray run in the launcher's session
    # The proxy's access log reaches the console through Ray: plain text in a pipe.
    wait_until(lambda: any("pd_cluster.access" in ln and " 200 success " in ln
                           for ln in launcher.output), 60, "the access-log line")


def _sigint_during_streams(url: str, launcher: Launcher) -> tuple[dict[int, Any], Any]:
    """Ctrl-C once 8 streams run; (each stream's outcome, the 503 a new request got)."""
    out: dict[int, Any] = {}
    started, lock, counter = threading.Event(), threading.Lock(), [0]
    threads = [threading.Thread(target=_stream, args=(url, out, i, started, counter, lock),
                                daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    assert started.wait(120), out
    os.killpg(launcher.proc.pid, signal.SIGINT)  # Ctrl-C in its terminal
    refused = None
    for _ in range(200):  # a new request while the 8 drain: refused, not served
        try:
            r = httpx.post(f"{url}/v1/completions", timeout=10, json={
                "model": "tiny-llama", "prompt": "x", "max_tokens": 1})
        except httpx.HTTPError:
            break
        if r.status_code == 503:
            refused = r
            break
    for t in threads:
        t.join(60)
    return out, refused


def test_serve_answers_the_sdk_then_ctrl_c_drains_8_streams_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = set(Path("/tmp").glob("pd-cluster-ray-*"))
    env = _env(tmp_path, monkeypatch)
    launcher = Launcher(["serve", "tiny-llama", "--port", "0", "--namespace",
                         f"test-serve-{os.getpid()}", "--served-model-name", "tiny-llama",
                         "my-alias", "--num-kv-blocks", "1024", "--shutdown-timeout", "2",
                         "--no-progress"], env)
    sid = launcher.proc.pid
    try:
        url = launcher.wait_for_url()
        _sdk_and_access_log(url, launcher, sid)
        out, refused = _sigint_during_streams(url, launcher)
        assert launcher.proc.wait(timeout=120) == 0, "".join(launcher.output)
    finally:
        launcher.kill()
    assert refused is not None and refused.headers.get("retry-after"), "no 503 while draining"
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert len(out) == 8, out
    for i, res in out.items():
        assert res["status"] == 200, res
        last = [e for e in res["events"] if e != "[DONE]"][-1]
        finished = last.get("choices") and last["choices"][0].get("finish_reason") == "length"
        ended = last.get("error", {}).get("message") == "server shutting down"
        assert finished or ended, (i, last)
        assert res["events"][-1] == "[DONE]", (i, res["events"][-3:])
    text = "".join(launcher.output)
    assert " 500 " not in text and "no healthy engine" not in text, text
    assert "request(s) in flight finished" in text, text  # the launcher drained first
    assert "Token authentication" not in text, text  # no Ray auth warning at start
    assert "shape: colocated: one engine on 2 cores" in text, text  # mode auto said why
    assert "stopped in" in text and "\x1b[" not in text, text
    wait_until(lambda: not _session_pids(sid), 30, "every process serve started to exit")
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    with socket.socket() as s:
        assert s.connect_ex((host, int(port))) != 0, "the API port is still open"
    assert set(Path("/tmp").glob("pd-cluster-ray-*")) == before, "a Ray temp dir was left"
    assert not list(Path("/tmp/ray").glob(f"session_*_{sid}")), "a /tmp/ray session was made"
