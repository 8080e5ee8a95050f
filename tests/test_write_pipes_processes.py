"""The pipes that write into the consumer's blocks (nixl: UCX between the processes; shm: the
decode engine's cache in a /dev/shm file) across two OS processes: exact against the
colocated engine; a producer killed mid-transfer and a consumer killed under a producer end
in recompute / freed blocks, never in wrong tokens or held blocks (and for shm, no cache file
left once the next consumer starts). The nixl cases are skipped, with the reason, where NIXL
is not installed (pip install torch==2.13.0 ".[nixl]")."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from connectors.pipes.base import PipeError
from connectors.pipes.nixl_pipe import load_nixl
from connectors.pipes.shm_arena import shm_folder, sweep_stale
from connectors.transfer_params import SendKV
from pd_cluster import SamplingParams
from pd_cluster.config import EngineConfig
from pd_cluster.engine.engine_process import EngineProcess
from pd_cluster.engine.llm_engine import LLMEngine
from tests.pd_helpers import colocated_tokens, kv_config, prompts_of_lengths, submit_pair
from tests.test_pd_processes import _step_until_idle, _wait_leak_free

pytestmark = pytest.mark.timeout(600)  # pairs of engine subprocesses
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from pd_cluster.checkpoints.maker import make_model
    return str(make_model(tmp_path_factory.mktemp("nixlp") / "m", arch="qwen2", num_layers=4))


@pytest.fixture(params=["nixl", "shm"])
def pipe(request) -> str:
    if request.param == "nixl":
        try:
            load_nixl()
        except PipeError as e:
            pytest.skip(str(e))
    return request.param


def _config(model: str, pipe: str, role: str, timeout: float, **args) -> EngineConfig:
    return EngineConfig(model=model, block_size=8,
                        kv_transfer={**kv_config(role, timeout), "pipe": pipe}, **args)


def _pair(model: str, pipe: str, timeout: float = 10.0) -> tuple[EngineProcess, EngineProcess]:
    d = EngineProcess(_config(model, pipe, "consumer", timeout))
    p = EngineProcess(_config(model, pipe, "producer", timeout, max_num_batched_tokens=16))
    return p.wait_ready(), d.wait_ready()


def _cache_files(d: EngineProcess) -> list[Path]:
    """The shm cache files of consumer process ``d``."""
    return sorted(shm_folder("/dev/shm").glob(f"kv-{d.proc.pid}-*"))


def test_two_processes_match_colocated_then_producer_killed_mid_transfer(model, pipe) -> None:
    """One pair: first exact transfers, then the producer dies while KV is flowing; the
    consumer recomputes what it lacks (exact) and holds no block."""
    p, d = _pair(model, pipe, timeout=3.0)
    try:
        prompts = prompts_of_lengths([1, 9, 16, 17, 40, 65, 150])
        ids = [f"ok{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            submit_pair(p, d, rid, prompt, GREEDY, d.kv_endpoint)
        got = d.wait_finished(ids, timeout=120)
        assert [got[r]["token_ids"] for r in ids] == colocated_tokens(
            model, prompts, [GREEDY] * len(prompts), block_size=8)
        assert d.call("stats")["kv_fallbacks"] == 0
        _wait_leak_free(p)

        received = d.call("stats")["kv_bytes_received"]
        doomed = prompts_of_lengths([300] * 4 + [40] * 4, vocab=400)
        ids = [f"k{i}" for i in range(len(doomed))]
        for rid, prompt in zip(ids, doomed):
            submit_pair(p, d, rid, prompt, GREEDY, d.kv_endpoint)
        deadline = time.monotonic() + 60
        while d.call("stats")["kv_bytes_received"] == received:  # kill once KV is flowing
            assert time.monotonic() < deadline
            time.sleep(0.01)
        p.kill()
        got = d.wait_finished(ids, timeout=120)
        assert [got[r]["token_ids"] for r in ids] == colocated_tokens(
            model, doomed, [GREEDY] * len(doomed), block_size=8)
        assert d.call("stats")["kv_fallbacks"] >= 1
        _wait_leak_free(d)
    finally:
        p.shutdown(), d.shutdown()
    assert pipe != "shm" or not _cache_files(d)  # removed on the way out


def test_consumer_killed_producer_frees(model, pipe) -> None:
    d = EngineProcess(_config(model, pipe, "consumer", 10.0)).wait_ready()
    p = LLMEngine(_config(model, pipe, "producer", 1.0))
    try:
        prompt = prompts_of_lengths([50])[0]
        submit_pair(p, d, "warm", prompt, GREEDY, d.kv_endpoint)  # handshake, one transfer
        _step_until_idle(p)
        d.kill()
        p.add_request("orphan", prompt, SamplingParams(temperature=0, max_tokens=1),
                      SendKV(to=d.kv_endpoint))
        _step_until_idle(p)
        # No grant ever comes (or the write fails): the request is given up, nothing held.
        p.check_no_leaks()
        if pipe == "shm":  # a killed consumer's file goes when the next one starts
            assert len(_cache_files(d)) == 1
            sweep_stale(shm_folder("/dev/shm"))
            assert not _cache_files(d)
    finally:
        p.close()
        d.shutdown()
