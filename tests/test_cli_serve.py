"""`pd-cluster serve MODEL` end to end, as a user runs it: no YAML, the official `openai` SDK
against it (vLLM's naming rule, a 404 naming what is served), then Ctrl-C stops everything it
started: no process of its session is left, the port is closed, and its (piped) output holds
no terminal colour codes."""
from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

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


def test_serve_model_answers_the_openai_sdk_then_ctrl_c_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(tmp_path, monkeypatch)
    launcher = Launcher(["serve", "tiny-llama", "--port", "0", "--namespace",
                         f"test-serve-{os.getpid()}", "--served-model-name", "tiny-llama",
                         "my-alias", "--num-kv-blocks", "256", "--no-progress"], env)
    sid = launcher.proc.pid
    try:
        url = launcher.wait_for_url()
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
        os.killpg(launcher.proc.pid, signal.SIGINT)  # Ctrl-C in its terminal
        assert launcher.proc.wait(timeout=90) == 0, "".join(launcher.output)
    finally:
        launcher.kill()
    wait_until(lambda: not _session_pids(sid), 30, "every process serve started to exit")
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    with socket.socket() as s:
        assert s.connect_ex((host, int(port))) != 0, "the API port is still open"
    text = "".join(launcher.output)
    assert "stopped in" in text and "\x1b[" not in text, text
