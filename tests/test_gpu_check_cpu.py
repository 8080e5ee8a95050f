"""scripts/gpu_check.sh --cpu in CI: the script that checks the CUDA path on a GPU machine runs
its cluster checks (scripts/check_cluster.py) against the CPU configs here, so it cannot rot
before a GPU ever runs it; and the comparison itself fails on a wrong answer or a held block."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pd_cluster.serving.cluster.testing import REPO_ROOT


def _check_cluster() -> Any:
    spec = importlib.util.spec_from_file_location("check_cluster",
                                                  REPO_ROOT / "scripts" / "check_cluster.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.mark.timeout(900)  # the script launches a Ray cluster and a benchmark
def test_gpu_check_cpu_mode_passes(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(PYTHON=sys.executable, GPU_CHECK_DIR=str(tmp_path / "logs"), OMP_NUM_THREADS="1",
               PD_CLUSTER_STATE_DIR=str(tmp_path / "state"),
               # the GPU-path rows' CPU halves: the suite runs their files itself (ci8: 37 s
               # in all here); the row's logic is checked on one test of each
               GPU_CHECK_CPU_K="test_cpu_has_one_slot_and_no_copies or "
                               "test_off_by_default_and_the_reference_says_why")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.strip().splitlines()[-1].startswith("gpu_check: ok (cpu mode"), out
    assert "cpu-1p1d-cluster             ok    check_cluster: ok" in out, out
    assert "=== pd: 8 requests" in out and " 0 failed" in out, out  # bench_serving --smoke ran
    # The CPU halves of the GPU-path rows (double-buffered inputs, graph buckets, agreement).
    assert re.search(r"^gpu path logic cpu\s+ok\s+2 passed", out, re.M), out


class _Client:
    """An OpenAI client whose completions answer from a table (wrong where we choose)."""

    def __init__(self, answers: dict[str, list[int]]):
        self.answers = answers
        self.completions = SimpleNamespace(create=self.create)

    def create(self, model: str, prompt: str, stream: bool = False, **_kw: Any) -> Any:
        ids = self.answers[prompt]
        choice = SimpleNamespace(token_ids=ids, text=" ".join(map(str, ids)))
        r = SimpleNamespace(choices=[choice])
        return [r] if stream else r


def test_check_cluster_fails_on_a_wrong_answer() -> None:
    cc = _check_cluster()
    when, prefix = "after load", cc.PASSES["after load"]
    refs = {when: {name: {"token_ids": [i, i + 1], "text": f"{i} {i + 1}"}
                   for i, (name, _, _) in enumerate(cc.REQUESTS)}}
    right = {prefix + prompt: refs[when][name]["token_ids"] for name, prompt, _ in cc.REQUESTS}
    assert cc._compare(_Client(right), "m", refs, when) == []
    name, prompt, _ = cc.REQUESTS[-1]  # a seeded one
    wrong = {**right, prefix + prompt: [refs[when][name]["token_ids"][0], 999]}
    failed = cc._compare(_Client(wrong), "m", refs, when)
    assert failed == [f"{name} after load: differs at token 1"]


@pytest.mark.parametrize("engine_stats, inflight, expect", [
    ({"kv_blocks_used": 0, "kv_bytes_received": 10}, 0, []),
    ({"kv_blocks_used": 3, "kv_bytes_received": 10}, 0, ["leak: decode-0 holds 0 request(s), "
                                                         "0 active, 3 KV block(s)"]),
    ({"kv_blocks_used": 0, "kv_bytes_received": 10}, 1, ["leak: 1 request(s) in flight at the "
                                                         "proxy"]),
])
def test_check_cluster_fails_on_a_held_block(monkeypatch: pytest.MonkeyPatch,
                                              engine_stats: dict, inflight: int,
                                              expect: list[str]) -> None:
    cc = _check_cluster()
    status = {"inflight": inflight, "engines": [
        {"name": "decode-0", "role": "decode", "healthy": True, "inflight": 0,
         "stats": engine_stats}]}
    import httpx
    monkeypatch.setattr(httpx, "get", lambda *a, **k: SimpleNamespace(json=lambda: status))
    leaks, st = cc._idle_and_leak_free("http://x", timeout=0.0)
    assert leaks == expect
    assert cc._kv_moved(st) == []
    st["engines"][0]["stats"]["kv_fallbacks"] = 1  # D prefilled by itself: KV never came
    assert cc._kv_moved(st) and "KV did not arrive" in cc._kv_moved(st)[0]
