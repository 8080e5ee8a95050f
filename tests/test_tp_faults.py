"""Tensor-parallel faults on the CPU: a worker killed or hung mid-load fails its engine within
a bound (no hang in a collective), the engine comes back as a whole, an idle engine outlives
the collective timeout, and no worker outlives its engine."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.conftest import random_prompt
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.worker_group import WorkerError
from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams

TIMEOUT = 3.0  # collective_timeout of these engines
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def tp2_engine(model_dir: str, timeout: float = TIMEOUT) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, tensor_parallel_size=2, num_kv_blocks=64,
                                  collective_timeout=timeout))


def load(engine: LLMEngine, n: int = 4) -> list[str]:
    ids = [f"r{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, random_prompt(20 + i, seed=i), PARAMS)
    for _ in range(5):  # mid-load: prefills done, decodes under way
        engine.step()
    return ids


def steps_until_failure(engine: LLMEngine, bound: float = 120.0) -> WorkerError:
    """Step until the engine fails; an engine still stepping after ``bound`` hangs (its
    collectives wait for a peer that will never answer)."""
    deadline = time.monotonic() + bound
    with pytest.raises(WorkerError) as info:
        while time.monotonic() < deadline:
            engine.step()
    return info.value


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_worker_fault_fails_the_engine_in_bounded_time_and_it_comes_back(tiny_model,
                                                                        fault: str) -> None:
    model_dir = tiny_model(arch="llama", num_heads=4, num_kv_heads=2)
    # A dead peer closes its sockets: the engine fails without the collective timeout, here
    # longer than the test may wait. A hung one is cut off by the collective timeout.
    engine = tp2_engine(model_dir, timeout=3600.0 if fault == "kill" else TIMEOUT)
    worker = engine.executor.workers.procs[0]
    ids = load(engine)
    try:
        os.kill(worker.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        steps_until_failure(engine)
        with pytest.raises(WorkerError, match="tensor-parallel|Connection|Timed out"):
            engine.step()  # stays failed: the group is gone, nothing half-runs
        assert worker.poll() is not None  # a failed engine takes its workers down
    finally:
        engine.close()
    # The engine is restarted as a whole; its requests run again from their prompts (the
    # cluster migrates them as for any dead engine) and the new engine leaks nothing.
    with LLM(model=model_dir, tensor_parallel_size=2, num_kv_blocks=64,
             collective_timeout=TIMEOUT) as again:
        outs = again.generate([random_prompt(20 + i, seed=i) for i in range(len(ids))], PARAMS)
        assert all(len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in outs)
        again.engine.check_no_leaks()


def test_idle_engine_outlives_the_collective_timeout(tiny_model) -> None:
    model_dir = tiny_model(arch="llama", num_heads=4, num_kv_heads=2)
    with LLM(model=model_dir, tensor_parallel_size=2, num_kv_blocks=64,
             collective_timeout=1.0) as llm:
        first = llm.generate([[5, 6, 7]], PARAMS)[0].outputs[0].token_ids
        # Idle for three collective timeouts (the behaviour under test, not a synchronisation):
        # the keepalives keep the workers waiting.
        time.sleep(3.0)
        again = llm.generate([[5, 6, 7]], PARAMS)[0].outputs[0].token_ids
        assert again == first
        llm.engine.check_no_leaks()


def test_workers_die_with_their_engine_process(tiny_model) -> None:
    from pd_cluster.engine.engine_process import EngineProcess
    model_dir = tiny_model(arch="llama", num_heads=4, num_kv_heads=2)
    proc = EngineProcess(EngineConfig(model=model_dir, tensor_parallel_size=2,
                                      num_kv_blocks=32, collective_timeout=TIMEOUT))
    try:
        proc.wait_ready()
        children = _children(proc.proc.pid)
        assert len(children) == 1, children  # the rank-1 worker
        proc.kill()  # SIGKILL: no clean-up code runs in the engine
        deadline = time.monotonic() + 30.0  # a bound, not a speed: they watch every 0.2 s
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in children), "a worker outlived its engine"
    finally:
        proc.shutdown()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_failed_start_leaves_no_worker(tiny_model, tmp_path) -> None:
    """Rank 0 fails to load its model after the workers started: the error surfaces as is and
    the workers are gone with it."""
    from tests.conftest import edit_config
    model_dir = edit_config(tiny_model(arch="llama", num_heads=4, num_kv_heads=2),
                            tmp_path / "m", architectures=["NoSuchForCausalLM"])
    before = set(_children(os.getpid()))
    with pytest.raises(ValueError, match="NoSuchForCausalLM"):
        tp2_engine(model_dir)
    assert [p for p in _children(os.getpid()) if p not in before and _alive(p)] == []
