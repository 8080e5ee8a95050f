"""What `pd-cluster serve` does before its first answer (scripts/serve_startup.py measures it):
the proxy's tokenizer loads while the engines do; an engine's start does not import inductor
(a niced kernel-build thread may hold that import); the start trace's marks and table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pd_cluster.serving.api import proxy_state
from pd_cluster.serving.cluster import proxy_actor
from pd_cluster.serving.cluster.proxy_actor import ProxyActor

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"mode": "colocated", "colocated": {"replicas": 1},
          "proxy": {"host": "127.0.0.1", "port": 0, "log_stats_interval": 0}}


def _run(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_a_deferred_proxy_has_its_tokenizer_before_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_actor, "_restarted", lambda: False)
    # no engines to look up (else Ray's list_named_actors starts a local Ray: ~10 s)
    monkeypatch.setattr(proxy_actor, "current_engines", lambda launched, namespace: [])
    proxy: Any = ProxyActor(CONFIG, [], "unused", {}, False, True)
    try:
        assert proxy._tokenizer is not None  # loaded while the engines load

        def no_second_load(_cfg: Any) -> Any:
            raise AssertionError("the tokenizer was loaded again after the engines were ready")
        monkeypatch.setattr(proxy_state, "load_tokenizer", no_second_load)
        url = proxy.start()
        assert url.startswith("http://127.0.0.1:")
        assert proxy.app.state.proxy.tokenizer.encode("hello")
    finally:
        proxy.stop()


def test_artifact_dir_does_not_import_inductor(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    code = ("import sys; from pd_cluster.engine.compile_cache import artifact_dir; "
            "print(artifact_dir()); print('torch._inductor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT,
                         env={**env, "PD_CLUSTER_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    path, imported = out.stdout.split()
    assert path == str(tmp_path / "inductor" / "pd_cluster") and imported == "False"


def test_the_start_trace_marks_each_process(tmp_path: Path) -> None:
    code = ("from pd_cluster import start_trace as t; t.mark_process_start('launcher'); "
            "t.mark('launcher', 'cli main')")
    before = time.time()
    _run(code, PD_START_TRACE=str(tmp_path))
    events = [json.loads(ln) for f in tmp_path.glob("*.jsonl") for ln in f.read_text().split("\n")
              if ln]
    assert [e["ev"] for e in events] == ["process start", "cli main"]
    assert before - 1.0 < events[0]["t"] <= events[1]["t"] <= time.time()


def test_the_start_trace_is_off_by_default(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PD_START_TRACE"}
    out = subprocess.run([sys.executable, "-c", "from pd_cluster import start_trace as t; "
                          "t.mark('x', 'y'); print(t.enabled())"], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path,
                         env={**env, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "False" and not list(tmp_path.iterdir())


def test_serve_startup_smoke() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_startup.py"), "--smoke"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "prefill-0" in out.stdout and "engine ready 6.50" in out.stdout


def test_the_kernel_build_thread_never_outranks_a_niced_server() -> None:
    """Its level is relative (as the compile child's os.nice): a server started at nice 15 (or
    more) builds at 19, not at 10, above its own engines (where it may: as root)."""
    code = ("import os, threading; from pd_cluster.thread_priority import "
            "lower_this_thread as lower; out = []; t = threading.Thread(target=lambda: "
            "out.append(lower(10))); t.start(); t.join(); "
            "print(out[0], os.getpriority(os.PRIO_PROCESS, 0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, preexec_fn=lambda: os.nice(15))
    assert out.returncode == 0, out.stderr[-2000:]
    thread, process = map(int, out.stdout.split())
    assert thread == 19 and process >= 15  # the thread lowered (to the floor), never raised


def test_serve_startup_passes_flags_after_the_double_dash() -> None:
    import importlib.util
    spec = importlib.util.spec_from_file_location("serve_startup",
                                                  ROOT / "scripts" / "serve_startup.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = script.parse_args(["bench-50m", "--runs", "2", "--", "--set", "cpu.x=false"])
    assert (args.model, args.runs, args.extra) == ("bench-50m", 2, ["--set", "cpu.x=false"])
    assert script.parse_args([]).extra == [] and script.parse_args([]).model == "tiny-llama"
