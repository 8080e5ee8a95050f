"""A newcomer's first `pd-cluster serve tiny-llama`: an empty cache (the C++ kernels unbuilt,
nothing compiled), the defaults a user gets (compiled steps in the background), and the first
completion served through prefill and decode, with no engine restart, no fallback and no
traceback: the KV send path never waits for the kernels' first build."""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import openai
import pytest

from pd_cluster.serving.cluster.testing import wait_until
from tests.launch_helpers import Launcher, _env

pytestmark = pytest.mark.timeout(600)  # `pd-cluster serve` starts a Ray cluster

_READY = re.compile(r"(prefill-0|decode-0): ready: pid (\d+)")
_BAD = ("Traceback", "engine loop died", "fatal engine error", "falling back",
        "prefilling locally", "degraded", "still pending", "marked unhealthy")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_first_completion_on_an_empty_cache_goes_through_p_and_d_with_no_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _env(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    env["PD_CLUSTER_CACHE"] = str(cache)
    for key in ("PD_CLUSTER_KERNEL_CACHE", "PD_CLUSTER_COMPILE", "PD_CLUSTER_COMPILE_MODE",
                "PD_CLUSTER_CPU_KERNELS", "TORCHINDUCTOR_CACHE_DIR"):
        env.pop(key, None)  # as a user's shell has them: the defaults
    launcher = Launcher(["serve", "tiny-llama", "--mode", "disaggregated", "--port", "0",
                         "--namespace", f"test-cold-{os.getpid()}", "--num-kv-blocks", "512",
                         "--shutdown-timeout", "2"], env)
    try:
        url = launcher.wait_for_url()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60,
                               max_retries=0)
        out = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=8,
                                        temperature=0)
        assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
        wait_until(lambda: any("pd_cluster.access" in ln and " 200 success " in ln
                               for ln in launcher.output), 60, "the access-log line")
        access = next(ln for ln in launcher.output if "pd_cluster.access" in ln)
        assert "route=prefill-0->decode-0" in access, access
        pids = dict(_READY.findall("".join(launcher.output)))
        assert set(pids) == {"prefill-0", "decode-0"}, launcher.output
        assert all(_alive(int(pid)) for pid in pids.values()), "an engine restarted"
        os.killpg(launcher.proc.pid, signal.SIGINT)
        assert launcher.proc.wait(timeout=120) == 0, "".join(launcher.output)
    finally:
        launcher.kill()
    text = "".join(launcher.output)
    for bad in _BAD:
        assert bad not in text, (bad, text)
    assert len(_READY.findall(text)) == 2, text  # one start each: nothing was restarted
