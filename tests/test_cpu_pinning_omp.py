"""The engine's compute threads run on the cores it claimed: the engine thread and every
OpenMP worker of torch's intra-op pool (at::parallel_for, MKL, oneDNN), not only the thread
that called sched_setaffinity. Read from outside, /proc/<pid>/task/*/status, for every
thread of an engine process while it runs.

On CI's 2-core machine an engine of 2 threads claims both cores (its mask is the node's, so
nothing would be proven), so the probe claims 1 core and runs 2 intra-op threads: both OpenMP
threads must share that one core. The probe is an engine process built as
pd_cluster/engine/engine_process.py builds it (LLMEngine on the main thread, the EngineLoop
driver pinning its thread, tcmalloc and Intel OpenMP preloaded where found), with the core
count taken apart from the thread count. (Checked by hand with libiomp5 preloaded too: its
workers, like libgomp's, are started by the engine thread's first parallel region, after
pinning, and inherit its mask.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pd_cluster.driver.cpu_setup import node_cores, preload_env

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")

THREADS = 2
PROMPT = 700  # tokens: elementwise ops over 700 x hidden rows pass at::parallel_for's grain

_PROBE = r"""
import json, os, sys, threading
import torch
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # as engine_process's __main__
from pd_cluster import SamplingParams
from pd_cluster.config import EngineConfig
from pd_cluster.driver.cpu_setup import claim_cores
from pd_cluster.driver.engine_loop import EngineLoop
from pd_cluster.driver.messages import EngineRequest
from pd_cluster.engine.llm_engine import LLMEngine

engine = LLMEngine(EngineConfig(model=sys.argv[1]))
claim = claim_cores(1, reserve=1)
done, errors = threading.Event(), []
def emit(deltas):
    errors.extend(d.error for d in deltas if d.error)
    if any(d.finished for d in deltas):
        done.set()
loop = EngineLoop(engine, emit, num_threads=int(os.environ["OMP_NUM_THREADS"]),
                  cores=claim.cores)
loop.start()
def say(**kw):
    print(json.dumps(kw), flush=True)
say(pid=os.getpid(), engine_tid=loop.thread_id, cores=list(claim.cores), why=claim.why_not)
sys.stdin.readline()  # the parent reads every thread's run time before the step
loop.submit(EngineRequest("r0", [4 + i % 400 for i in range(int(sys.argv[2]))],
                          SamplingParams(max_tokens=4, ignore_eos=True)))
ok = done.wait(120)
leaks = loop.call(lambda e: e.check_no_leaks() or True).result(60)
say(finished=ok, errors=errors, no_leaks=leaks)
sys.stdin.readline()  # the parent reads every thread's mask and run time after it
loop.stop()
"""


def _threads(pid: int) -> dict[int, tuple[set[int], int]]:
    """Every thread of ``pid``: (its allowed CPUs from Cpus_allowed_list, ns it has run)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            ran = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except FileNotFoundError:  # a thread that just ended
            continue
        [line] = [x for x in status.splitlines() if x.startswith("Cpus_allowed_list:")]
        out[int(tid)] = (_cpu_list(line.split(":", 1)[1].strip()), ran)
    return out


def _cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


@pytest.mark.timeout(300)  # an engine subprocess
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_engine_thread_and_openmp_workers_run_on_the_claimed_core(
        tiny_model, tmp_path: Path) -> None:
    model = tiny_model(hidden_size=256, intermediate_size=1024)  # parallel-sized ops
    # Its own TMPDIR: the core locks of engines other tests run at the same time are not ours.
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": str(THREADS)}
    env.update(preload_env(env.get("LD_PRELOAD"))[0])  # tcmalloc / libiomp5, as launched
    proc = subprocess.Popen([sys.executable, "-c", _PROBE, model, str(PROMPT)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        start = json.loads(proc.stdout.readline())
        pid, engine_tid, cores = start["pid"], start["engine_tid"], set(start["cores"])
        assert cores == {node_cores()[-1]}, start["why"]  # off the reserved (lowest) core
        before = _threads(pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        end = json.loads(proc.stdout.readline())
        assert end == {"finished": True, "errors": [], "no_leaks": True}
        after = _threads(pid)

        ran = {tid: ns - before.get(tid, (None, 0))[1] for tid, (_, ns) in after.items()}
        # Compute threads: the engine thread, and the threads that did a share of its work
        # during the step (OpenMP's workers; they are started by the engine thread's first
        # parallel region, or reused from an earlier one).
        # The probe's main thread (tid == pid) only submits and waits, unpinned: its
        # wake-ups can pass a tenth of a short step's time, and it computes nothing.
        compute = {tid for tid, ns in ran.items() if tid == engine_tid
                   or (tid != pid and ns >= ran[engine_tid] // 10)}
        workers = compute - {engine_tid}
        assert workers, (f"no OpenMP worker ran beside the engine thread: the step did not "
                         f"run {THREADS} intra-op threads ({ran})")
        masks = {tid: after[tid][0] for tid in compute}
        assert all(m == cores for m in masks.values()), (
            f"compute threads outside the claimed cores {sorted(cores)}: {masks}")
        # ...while the process's main thread (serving path) still floats over the node
        assert after[pid][0] == set(node_cores())
    finally:
        if proc.poll() is None:
            proc.stdin.write("\n")
            proc.stdin.flush()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
