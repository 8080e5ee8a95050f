"""P/D across two OS processes over ZMQ (tcp and ipc) and the gloo pipe (the NCCL pipe's
protocol on CPUs): exactness, overlap, crashes."""
from __future__ import annotations

import time

import pytest

from connectors.transfer_params import SendKV
from pd_cluster import SamplingParams
from pd_cluster.config import EngineConfig
from pd_cluster.engine.engine_process import EngineProcess
from tests.pd_helpers import (colocated_tokens, engine, kv_config, prompts_of_lengths,
                              submit_pair)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


pytestmark = pytest.mark.timeout(600)  # pairs of engine subprocesses


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from pd_cluster.checkpoints.maker import make_model
    return str(make_model(tmp_path_factory.mktemp("pdp") / "m", arch="qwen2", num_layers=4))


def start_pair(model: str, transport: str, block_size: int, chunk: int, timeout: float = 10.0,
               pipe: str = "zmq") -> tuple[EngineProcess, EngineProcess]:
    kv = dict(transport=transport, pipe=pipe)
    d = EngineProcess(EngineConfig(model=model, block_size=block_size,
                                   kv_transfer=kv_config("consumer", timeout, **kv)))
    p = EngineProcess(EngineConfig(model=model, block_size=block_size,
                                   max_num_batched_tokens=chunk,
                                   kv_transfer=kv_config("producer", timeout, **kv)))
    return p.wait_ready(), d.wait_ready()


def stop(*procs: EngineProcess) -> None:
    for proc in procs:
        proc.shutdown()


@pytest.mark.parametrize("pipe,transport,block_size,chunk", [
    ("zmq", "tcp", 8, 32), ("zmq", "ipc", 16, 48), ("gloo", "tcp", 8, 32)])
def test_two_processes_match_colocated(model, pipe, transport, block_size, chunk):
    prompts = prompts_of_lengths([1, 9, 15, 16, 17, 40, 100, 150, 3, 64, 65, 23, 5, 7, 31, 2, 77])
    params = [GREEDY if i % 3 else SamplingParams(temperature=0.8, seed=i, max_tokens=8,
                                                  ignore_eos=True) for i in range(len(prompts))]
    p, d = start_pair(model, transport, block_size, chunk, pipe=pipe)
    try:
        assert d.kv_endpoint.startswith(f"{transport}://")
        ids = [f"{transport}-{i}" for i in range(len(prompts))]
        for rid, prompt, sp in zip(ids, prompts, params):
            submit_pair(p, d, rid, prompt, sp, d.kv_endpoint)
        got = d.wait_finished(ids, timeout=120)
        ref = colocated_tokens(model, prompts, params, block_size=block_size)
        assert [got[r]["token_ids"] for r in ids] == ref
        assert d.call("stats")["kv_fallbacks"] == 0
        _wait_leak_free(p), _wait_leak_free(d)
    finally:
        stop(p, d)


def test_first_layer_arrives_before_producer_forward_ends(tmp_path):
    from pd_cluster.checkpoints.maker import make_model
    deep = str(make_model(tmp_path / "deep", num_layers=12, hidden_size=128, intermediate_size=512,
                          num_heads=4, num_kv_heads=4))
    p, d = start_pair(deep, "tcp", 16, 4096)
    try:
        prompt = prompts_of_lengths([1800])[0]
        submit_pair(p, d, "long", prompt, SamplingParams(temperature=0, max_tokens=2),
                    d.kv_endpoint)
        d.wait_finished(["long"], timeout=120)
        saved = p.call("timings")["last_layer_saved"]["long"]
        received = d.call("timings")["first_layer_received"]["long"]
        # Layer 0 was on the consumer while the producer still computed later layers.
        assert received < saved, (received, saved)
    finally:
        stop(p, d)


@pytest.mark.parametrize("pipe", ["zmq", "gloo"])
def test_producer_sigkill_mid_transfer_falls_back(model, pipe):
    p, d = start_pair(model, "tcp", 8, 16, timeout=2.0, pipe=pipe)
    try:
        prompts = prompts_of_lengths([300] * 6 + [40] * 6)
        ids = [f"k{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            submit_pair(p, d, rid, prompt, GREEDY, d.kv_endpoint)
        deadline = time.monotonic() + 30
        while d.call("stats")["kv_bytes_received"] == 0:  # kill once KV is flowing
            assert time.monotonic() < deadline
            time.sleep(0.01)
        p.kill()
        got = d.wait_finished(ids, timeout=120)
        ref = colocated_tokens(model, prompts, [GREEDY] * len(prompts), block_size=8)
        assert [got[r]["token_ids"] for r in ids] == ref
        assert d.call("stats")["kv_fallbacks"] >= 1
        _wait_leak_free(d)
    finally:
        stop(d)


def test_consumer_gone_producer_frees_after_timeout(model):
    d = EngineProcess(EngineConfig(model=model, block_size=8,
                                   kv_transfer=kv_config("consumer"))).wait_ready()
    p = engine(model, "producer", timeout=1.0, block_size=8)
    try:
        prompt = prompts_of_lengths([50])[0]
        submit_pair(p, d, "warm", prompt, GREEDY, d.kv_endpoint)  # handshake done, peer alive
        _step_until_idle(p)
        d.kill()
        p.add_request("orphan", prompt, SamplingParams(temperature=0, max_tokens=1),
                      SendKV(to=d.kv_endpoint))
        _step_until_idle(p)
        # Over ZMQ its send failed: at once when P saw the connection drop (the link ends: no
        # longer a working peer), else when the send timed out. Over shm (the default on one
        # host) P wrote into the shared cache the dead engine left, and its blocks are free.
        # Either way nothing is held.
        if p.stats()["kv_links"].get(d.kv_endpoint) != "shm":
            assert (p.stats()["kv_send_timeouts"] >= 1 or d.kv_endpoint not in p.kv_peers())
        p.check_no_leaks()
    finally:
        p.close()
        d.shutdown()


def _step_until_idle(engine_, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine_.has_unfinished_requests():
        assert time.monotonic() < deadline
        engine_.step()
        time.sleep(0.005)


def _wait_leak_free(proc: EngineProcess, timeout: float = 15.0) -> None:
    """Blocks are released once ACKs arrive: poll the leak check for a bounded time."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            proc.check_no_leaks()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
