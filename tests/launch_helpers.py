"""Running `pd-cluster` as a user does (a subprocess whose output is read on a thread), and
the module-scoped cluster launched in the test process that the cluster tests share."""
from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from pd_cluster.serving.cluster.testing import REPO_ROOT, ensure_ray, local_config

URL_RE = re.compile(r"serving on (http://[0-9.]+:\d+)")


class Launcher:
    """A `python -m pd_cluster.cli ...` subprocess whose output is read on a thread."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pd_cluster.cli", *args], cwd=REPO_ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)  # our SIGINT goes to the launcher only, as we choose
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for_url(self, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            m = URL_RE.search(line)
            if m:
                return m.group(1)
        self.kill()
        raise AssertionError("launcher never printed its URL:\n" + "".join(self.output))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("PD_CLUSTER_STATE_DIR", str(tmp_path))  # ClusterState.load here too
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(PD_CLUSTER_STATE_DIR=str(tmp_path), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH"))
                                          if p))
    return env


def _cli(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pd_cluster.cli", *args], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def launched_cluster(tmp_path_factory: pytest.TempPathFactory, config: str, name: str,
                     **sections: dict[str, Any]) -> Iterator[Any]:
    """For a module fixture to ``yield from``: configs/<config>.yaml with ``sections``
    overriding it, launched in this process in its own Ray namespace and state dir; shut down
    at the module's end."""
    from pd_cluster.serving.cluster.launcher import launch  # imports Ray: only when used

    mp = pytest.MonkeyPatch()
    mp.setenv("PD_CLUSTER_STATE_DIR", str(tmp_path_factory.mktemp("state")))
    try:
        ensure_ray()
        c = launch(local_config(config, f"test-{name}-{os.getpid()}", **sections),
                   progress=False)
        try:
            yield c
        finally:
            c.shutdown()
    finally:
        mp.undo()


async def stream_completion(http: httpx.AsyncClient, model: str, prompt: list[int],
                            max_tokens: int, started: asyncio.Event | None = None,
                            seed: int | None = None) -> tuple[str, list[int], str | None]:
    """('ok'|'error'|'http-<status>', token ids, error message) for one streamed completion
    (greedy, or sampled at temperature 0.8 with ``seed``); sets ``started`` after 3 tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    if seed is not None:
        body.update(temperature=0.8, seed=seed)
    ids: list[int] = []
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return f"http-{resp.status_code}", ids, (await resp.aread()).decode()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return "error", ids, data["error"]["message"]
            ids.extend(data["choices"][0].get("token_ids") or [])
            if started is not None and len(ids) >= 3:
                started.set()
    return "ok", ids, None
