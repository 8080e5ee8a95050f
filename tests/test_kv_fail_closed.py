"""KV that fails closed, and a KV plane only the cluster's engines reach, on a real P/D pair
(in process, a tiny model): a byte flipped in flight or a layer lost ends in the exact answer
by recompute, never in wrong tokens; a forged producer (the project's own pipe, the right
model hello, no secret) or a valid engine holding another secret is refused while the
requests in flight stay exact; CURVE mode is exact end to end. Leak checks after each."""
from __future__ import annotations

import secrets
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest
import torch

from connectors.pipes import PipeConfig, create_pipe, wire
from connectors.pipes.base import HandshakeError
from connectors.pipes.zmq_peers import Outgoing
from connectors.secret import ENV
from pd_cluster import SamplingParams
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.serving.cluster.testing import wait_until
from tests.pd_helpers import (colocated_tokens, drain, kv_config, prompts_of_lengths,
                              run_in_process, submit_pair)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# One prompt per test: none finds another's blocks in D's prefix cache (those are not shipped).
PROMPTS = dict(zip(("flipped", "lost", "genuine", "curve"), prompts_of_lengths([37, 41, 45, 29])))


def _engine(model: str, role: str, **kv: Any) -> LLMEngine:
    # the tampering reaches into the ZMQ pipe's receive queue (shm's checks: test_shm_pipe)
    return LLMEngine(EngineConfig(model=model, block_size=8,
                                  kv_transfer={**kv_config(role, 30.0, pipe="zmq"), **kv}))


@pytest.fixture(scope="module")
def expected(tiny_model) -> dict[str, list[int]]:
    """The colocated engine's tokens for each prompt (the reference)."""
    outs = colocated_tokens(tiny_model(), list(PROMPTS.values()), [GREEDY] * len(PROMPTS),
                            block_size=8)
    return dict(zip(PROMPTS, outs))


@pytest.fixture(scope="module")
def pair(tiny_model, expected) -> Iterator[tuple[LLMEngine, LLMEngine, dict[str, list[int]]]]:
    model = tiny_model()
    p, d = _engine(model, "producer"), _engine(model, "consumer")
    yield p, d, expected
    p.close(), d.close()


@contextmanager
def _tampered(d: LLMEngine, change: Callable[[dict, torch.Tensor], torch.Tensor | None]):
    """Messages D's pipe receives pass through ``change`` in flight, before its integrity
    check (None: the message is lost)."""
    queue = d.runner.connector.pipe._rq
    real = queue.put

    def put(item: Any, nbytes: int) -> None:
        peer, body, tensor, tag = item
        if tensor is not None and body.get("kind") == "kv":
            tensor = change(body, tensor)
            if tensor is None:
                return
        real((peer, body, tensor, tag), nbytes)
    queue.put = put
    try:
        yield
    finally:
        del queue.put


def _run(p: LLMEngine, d: LLMEngine, rid: str) -> list[int]:
    submit_pair(p, d, rid, PROMPTS[rid], GREEDY, d.kv_endpoint())
    got = run_in_process(p, d, timeout=25.0)[rid]  # < the 30 s transfer timeout: no waiting
    drain(p, d)
    p.check_no_leaks(), d.check_no_leaks()
    return got


def _stat(d: LLMEngine, key: str) -> int:
    return d.runner.connector.stats()[key]


def test_a_byte_flipped_in_flight_is_recomputed_exactly(pair) -> None:
    p, d, expected = pair
    flipped: list[int] = []

    def flip(header: dict, t: torch.Tensor) -> torch.Tensor:
        if flipped or header["layer"] != 1:
            return t
        t = t.clone()
        t.view(-1).view(torch.uint8)[t.nbytes // 2] ^= 0x01  # one bit of one byte
        flipped.append(header["layer"])
        return t
    failed, fallbacks = _stat(d, "kv_digest_failures"), d.stats()["kv_fallbacks"]
    forged = _stat(d, "kv_integrity_failures")
    with _tampered(d, flip):
        assert _run(p, d, "flipped") == expected["flipped"]
    assert flipped and _stat(d, "kv_digest_failures") == failed + 1
    assert _stat(d, "kv_integrity_failures") == forged + 1  # the MAC caught it
    assert d.stats()["kv_fallbacks"] == fallbacks + 1


def test_a_lost_layer_is_recomputed_exactly(pair) -> None:
    p, d, expected = pair
    lost: list[int] = []

    def drop(header: dict, t: torch.Tensor) -> torch.Tensor | None:
        if lost or header["layer"] != 0:
            return t
        lost.append(0)
        return None
    failed = _stat(d, "kv_digest_failures")
    with _tampered(d, drop):
        assert _run(p, d, "lost") == expected["lost"]
    assert lost and _stat(d, "kv_digest_failures") == failed + 1


def test_a_forged_producer_is_refused_and_requests_stay_exact(pair) -> None:
    p, d, expected = pair
    endpoint = d.kv_endpoint()
    auth_failures, refused = _stat(d, "kv_auth_failures"), _stat(d, "kv_refused_messages")
    fallbacks = d.stats()["kv_fallbacks"]
    forger = create_pipe("zmq", PipeConfig(security="none", handshake_timeout=5.0))
    try:
        with pytest.raises(HandshakeError, match="authentication failed$"):
            forger.connect(endpoint, dict(p.runner.connector.hello))  # the right model hello
        # It sends KV for the request in flight anyway, on a socket of its own.
        submit_pair(p, d, "genuine", PROMPTS["genuine"], GREEDY, endpoint)
        junk = torch.zeros(2, 5, 8, 2, 16)
        head = wire.pack("d", {"kind": "kv", "request_id": "genuine", "layer": 0,
                               "first_block": 0}, wire.tensor_meta(junk))
        forger._run_in_io(lambda: forger._open_dealer(
            endpoint, secrets.token_hex(8).encode(), __import__("concurrent.futures").futures
            .Future(), Outgoing(endpoint, head, [junk.numpy().tobytes()], None)))
        wait_until(lambda: _stat(d, "kv_refused_messages") > refused, 10, "refused data")
        got = run_in_process(p, d, timeout=25.0)["genuine"]
        drain(p, d)
    finally:
        forger.close()
    # its own KV, unharmed
    assert got == expected["genuine"] and d.stats()["kv_fallbacks"] == fallbacks
    assert _stat(d, "kv_auth_failures") == auth_failures + 1
    p.check_no_leaks(), d.check_no_leaks()


def test_a_valid_engine_with_another_secret_is_refused(pair, tiny_model, monkeypatch) -> None:
    _, d, _ = pair
    monkeypatch.setenv(ENV, secrets.token_hex(32))  # another cluster's engine
    stranger = _engine(tiny_model(), "producer")
    try:
        with pytest.raises(HandshakeError, match="did not prove the cluster secret"):
            stranger.connect_kv_peer(d.kv_endpoint())
        assert not stranger.kv_peers()
    finally:
        stranger.close()


def test_curve_is_exact_end_to_end(tiny_model, expected) -> None:
    model = tiny_model()
    p = _engine(model, "producer", security="curve")
    d = _engine(model, "consumer", security="curve")
    try:
        assert _run(p, d, "curve") == expected["curve"]
        assert d.stats()["kv_fallbacks"] == 0 and _stat(d, "kv_bytes_received") > 0
    finally:
        p.close(), d.close()
