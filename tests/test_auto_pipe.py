"""kv_transfer.pipe: auto on a real P/D pair in one process: both engines on this host with
/dev/shm usable -> the link writes into the shared cache (shm); a producer whose host id
differs (faked) or a decode engine whose shared memory is unusable -> the link sends over zmq,
with the reason logged and kept. Exact against the colocated engine, every block freed."""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

from pd_cluster import SamplingParams
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from tests.conftest import random_prompt
from tests.pd_helpers import colocated_tokens, drain, kv_config, run_in_process, submit_pair

if not os.path.isdir("/dev/shm"):
    pytest.skip("no /dev/shm on this host", allow_module_level=True)

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tiny_model) -> tuple[str, list[list[int]], list[list[int]]]:
    model = tiny_model()
    prompts = [random_prompt(n, seed=3 * n) for n in (9, 33)]
    return model, prompts, colocated_tokens(model, prompts, [GREEDY] * 2, block_size=8)


@contextmanager
def _pair(model: str, d_extra: dict[str, Any] | None = None
          ) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    def engine(role: str, extra: dict[str, Any] | None) -> LLMEngine:
        kv = {**kv_config(role), "pipe": "auto", **({"extra": extra} if extra else {})}
        return LLMEngine(EngineConfig(model=model, block_size=8, kv_transfer=kv))
    d = engine("consumer", d_extra)
    p = engine("producer", None)
    try:
        yield p, d
    finally:
        p.close(), d.close()


def _run(p: LLMEngine, d: LLMEngine, prompts: list[list[int]],
         before: Any = None) -> tuple[list[list[int]], tuple[str, str]]:
    """Runs the prompts (``before(pipe)`` first, on the producer's pipe); returns the tokens
    and the link's (pipe, reason)."""
    pipe = p.runner.connector.pipe
    if before is not None:
        before(pipe)
    for i, prompt in enumerate(prompts):
        submit_pair(p, d, f"a{i}", prompt, GREEDY, d.kv_endpoint())
    got = run_in_process(p, d, timeout=40.0)
    drain(p, d)
    p.check_no_leaks(), d.check_no_leaks()
    assert d.stats()["kv_fallbacks"] == 0
    assert p.stats()["kv_bytes_sent"] == d.stats()["kv_bytes_received"] > 0
    return [got[f"a{i}"] for i in range(len(prompts))], pipe.link(d.kv_endpoint())


def test_one_host_links_over_shm(case) -> None:
    model, prompts, want = case
    with _pair(model) as (p, d):
        assert d.kv_endpoint().startswith("tcp://")  # producers on other hosts reach it too
        got, (pipe, why) = _run(p, d, prompts)
        assert (pipe, why) == ("shm", "both engines on one host, shared memory usable")
        sent = p.stats()["kv_bytes_sent"]
        assert p.runner.connector.pipe.stats()["shm_bytes_written"] == sent
        assert p.stats()["kv_links"] == {d.kv_endpoint(): "shm"}
        assert p.stats()["kv_pipe"] == "shm"
    assert got == want


def test_another_host_links_over_zmq(case, caplog) -> None:
    model, prompts, want = case
    with _pair(model) as (p, d), caplog.at_level(logging.INFO, "connectors.pipes.auto_pipe"):
        def elsewhere(pipe: Any) -> None:
            pipe._host = "another-host/0000"  # what a producer in another container says
        got, (pipe, why) = _run(p, d, prompts, elsewhere)
        assert (pipe, why) == ("zmq", "the decode engine runs on another host")
        assert p.runner.connector.pipe.stats()["shm_bytes_written"] == 0
        assert p.stats()["kv_links"] == {d.kv_endpoint(): "zmq"}
        assert "uses zmq (the decode engine runs on another host)" in caplog.text
    assert got == want


def test_unusable_shared_memory_links_over_zmq(case, tmp_path, caplog) -> None:
    """The decode engine's shm folder cannot be made (a file stands where it would go): it
    keeps its cache, says why, and its producer sends over zmq."""
    model, prompts, want = case
    (tmp_path / "not-a-dir").write_text("")
    extra = {"shm_dir": str(tmp_path / "not-a-dir")}
    with caplog.at_level(logging.INFO, "connectors.pipes.auto_pipe"), \
            _pair(model, extra) as (p, d):
        assert d.runner.connector.pipe._shared is None
        got, (pipe, why) = _run(p, d, prompts)
        assert pipe == "zmq"
        assert why.startswith("the decode engine's shared memory is unusable: ")
        assert "links use zmq, its KV cache stays out of shared memory" in caplog.text
        assert p.stats()["kv_links"] == {d.kv_endpoint(): "zmq"}
    assert got == want
