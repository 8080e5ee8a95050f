"""The KV transfer failure contract: a failed send fails its request at once, a consumer that
gives up frees the producer at once, and a producer holds blocks under a lease the consumer
renews (a silent consumer frees them after the lease, not after a long fixed hold)."""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import torch

from connectors.config import KVTransferConfig
from connectors.metadata import FinHeader, FinishSpec, KVConnectorMetadata, RecvSpec, SendSpec
from connectors.pd_connector import PDConnectorWorker
from connectors.pipes.base import PipeError
from pd_cluster import SamplingParams
from tests import pd_helpers
from tests.pd_helpers import colocated_tokens, prompts_of_lengths, run_in_process
from tests.pd_helpers import submit_pair

INFO = {"model_id": "t", "dtype": "torch.float32", "block_size": 4, "num_layers": 2,
        "num_kv_heads": 2, "head_dim": 8}
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def engine(model: str, role: str, **args):
    """These tests are of the ZMQ pipe's messages (frames, FINs, ACKs): pinned to it."""
    return pd_helpers.engine(model, role, pipe="zmq", **args)


def _pair(consumer_timeout: float = 30.0, lease: float = 30.0) -> tuple[Any, Any, list]:
    cons = PDConnectorWorker(KVTransferConfig(role="consumer", pipe="zmq",
                                              kv_transfer_timeout=consumer_timeout), INFO)
    prod = PDConnectorWorker(KVTransferConfig(role="producer", pipe="zmq",
                                              lease_seconds=lease), INFO)
    src = [torch.randn(2, 12, 4, 2, 8) for _ in range(2)]
    prod.register_kv_caches(src)
    cons.register_kv_caches([torch.zeros(2, 12, 4, 2, 8) for _ in range(2)])
    prod.connect_peer(cons.endpoint())
    return prod, cons, src


def _send(prod: Any, peer: str, layers: range, fin: bool = True) -> None:
    prod.bind_connector_metadata(KVConnectorMetadata(sends=[SendSpec("r", peer, (1, 2), 0)]))
    # The consumer (registered) answers the producer's offer: the layers then go out in
    # this step, deferred until its answer (decode-side reuse: what it holds is skipped).
    _until(lambda: prod._held_tokens("r") is not None, 5.0, "the consumer's HOLD")
    for layer in layers:
        prod.save_kv_layer(layer, prod.kv_caches[layer], None)
    prod.wait_for_save()
    if fin:
        prod.bind_connector_metadata(KVConnectorMetadata(finishes=[FinishSpec("r", peer, 7, 8)]))


def _fin_unread(cons: Any) -> None:
    """The consumer has not read the FIN yet (a backlog): it keeps receiving. (A FIN it reads
    with layers missing fails the transfer at once: test_kv_security.py.)"""
    real = cons.receiver.on_message
    cons.receiver.on_message = lambda h, t, p: [] if isinstance(h, FinHeader) else real(h, t, p)


def _until(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout}s: {what}")


def test_a_failed_send_fails_the_request_and_the_consumer_recomputes_at_once(tiny_model):
    model = tiny_model()
    p = engine(model, "producer", timeout=60.0, block_size=8)
    d = engine(model, "consumer", timeout=60.0, block_size=8)
    real = p.runner.connector.pipe.send_tensor

    def failing(peer: str, header: dict, tensor: Any) -> Future:
        if tensor is None:
            return real(peer, header, tensor)  # FIN / control messages go through
        f: Future = Future()
        f.set_exception(PipeError("connection reset by peer"))
        return f
    p.runner.connector.pipe.send_tensor = failing
    prompt = prompts_of_lengths([40])[0]
    submit_pair(p, d, "r", prompt, GREEDY, d.kv_endpoint())
    got = run_in_process(p, d, timeout=20.0)  # far less than the 60 s transfer timeout
    assert got["r"] == colocated_tokens(model, [prompt], [GREEDY], block_size=8)[0]
    assert d.stats()["kv_fallbacks"] == 1  # told by the FIN, not by a timeout
    p.check_no_leaks(), d.check_no_leaks()
    p.close(), d.close()


def test_a_consumer_that_gives_up_frees_the_producer_at_once():
    prod, cons, _ = _pair(consumer_timeout=0.5, lease=60.0)
    peer = cons.endpoint()
    _fin_unread(cons)
    cons.bind_connector_metadata(KVConnectorMetadata(recvs=[RecvSpec("r", (3, 4), 8)]))
    _send(prod, peer, range(1))  # layer 1 never comes: the consumer will give up
    assert prod.get_finished()[0] == set()  # held: waiting for the consumer
    assert _until(lambda: cons.get_finished()[1], 5.0, "consumer fallback") == {"r": None}
    assert _until(lambda: prod.get_finished()[0], 5.0, "NACK") == {"r"}  # not 60 s
    prod.close(), cons.close()


def test_a_renewed_lease_holds_and_a_silent_consumer_frees_after_the_lease():
    lease = 1.2
    prod, cons, _ = _pair(consumer_timeout=30.0, lease=lease)
    renewals: list[list[str]] = []
    renew = prod.leases.renew
    prod.leases.renew = lambda rids: (renewals.append(list(rids)), renew(rids))
    peer = cons.endpoint()
    _fin_unread(cons)
    cons.bind_connector_metadata(KVConnectorMetadata(recvs=[RecvSpec("r", (3, 4), 8)]))
    _send(prod, peer, range(1))  # incomplete: the consumer keeps receiving and renewing
    # The consumer renews at most every lease / 3: seven renewals span two leases or more.
    _until(lambda: sum("r" in rids for rids in renewals) >= 7, 60.0, "seven renewals")
    assert prod.get_finished()[0] == set()  # held past its first lease: renewed
    assert prod.stats()["kv_send_timeouts"] == 0
    cons.close()  # the consumer dies: no more renewals
    assert _until(lambda: prod.get_finished()[0], 30.0, "lease expiry") == {"r"}
    assert prod.stats()["kv_send_timeouts"] == 1
    prod.close()


def test_pipe_fails_a_send_no_peer_accepts_within_send_timeout():
    from connectors.pipes.base import PipeConfig, PipeError
    from connectors.pipes.zmq_pipe import ZmqPipe
    cons = ZmqPipe(PipeConfig(hwm=1))
    prod = ZmqPipe(PipeConfig(hwm=1, send_timeout=0.5))
    try:
        addr = cons.listen()
        prod.connect(addr, {})
        cons.close()  # gone: the producer's queue fills up and nothing drains it
        futures = [prod.send_tensor(addr, {"i": i}, torch.zeros(1 << 16)) for i in range(50)]
        # zmq keeps the first few queued for a reconnect (their memory stays referenced, so
        # they stay pending; the connector's wait_for_save bounds those); the rest are refused
        # and must fail after send_timeout instead of being retried forever.
        _until(lambda: any(f.done() for f in futures), 10.0, "a bounded send")
        done = [f for f in futures if f.done()]
        # (or, once the producer saw the connection lost, fail at once: a PipeError)
        assert all(isinstance(f.exception(), PipeError) for f in done)
    finally:
        prod.close()


def test_a_peer_whose_send_failed_is_relinked_from_scratch():
    """After a failed send (an NCCL communicator that timed out, a broken connection) the FIN
    still tells the consumer to recompute; then the link is dropped, and a new handshake (a
    fresh connection / communicator) makes the peer usable again."""
    prod, cons, _ = _pair(consumer_timeout=30.0)
    peer = cons.endpoint()
    real = prod.pipe.send_tensor

    def failing(p: str, header: dict, tensor: Any) -> Future:
        if tensor is None:
            return real(p, header, tensor)
        f: Future = Future()
        f.set_exception(PipeError("communicator aborted after a timeout"))
        return f
    prod.pipe.send_tensor = failing
    cons.bind_connector_metadata(KVConnectorMetadata(recvs=[RecvSpec("r", (3, 4), 8)]))
    _send(prod, peer, range(2))  # fails; the FIN (first token None) still goes out
    assert _until(lambda: cons.get_finished()[1], 5.0, "consumer told") == {"r": None}
    assert peer not in prod.peers()
    prod.pipe.send_tensor = real
    prod.connect_peer(peer)  # what the peer linker does next
    assert peer in prod.peers()
    prod.close(), cons.close()


def test_first_token_does_not_wait_for_the_sends(tiny_model) -> None:
    """P settles a step's sends before the next forward writes the cache, not before the
    step's tokens are sampled: within each step, no wait_for_save after a save_kv_layer; the
    sends are settled before any later forward; outputs stay exact with chunked prefill (a
    chunk's sends still in flight while the next chunk is scheduled)."""
    from pd_cluster import SamplingParams
    from tests.pd_helpers import (colocated_tokens, engine, prompts_of_lengths, run_in_process,
                                  submit_pair)
    model = tiny_model()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = prompts_of_lengths([45, 70])
    want = colocated_tokens(model, prompts, [params] * 2)
    d = engine(model, "consumer", block_size=8)
    p = engine(model, "producer", block_size=8, max_num_batched_tokens=32)
    calls: list[str] = []
    conn = p.runner.connector
    for name in ("save_kv_layer", "wait_for_save"):
        real = getattr(conn, name)
        setattr(conn, name, lambda *a, _real=real, _name=name: (calls.append(_name),
                                                                 _real(*a))[1])
    real_step = p.runner.run_step
    p.runner.run_step = lambda step: (calls.append("step"), real_step(step))[1]
    try:
        for i, prompt in enumerate(prompts):
            submit_pair(p, d, f"r{i}", prompt, params, d.kv_endpoint())
        got = run_in_process(p, d)
        assert [got["r0"], got["r1"]] == want
        steps = "".join({"step": "|", "save_kv_layer": "s", "wait_for_save": "w"}[c]
                        for c in calls).split("|")
        saving = [s for s in steps if "s" in s]
        assert len(saving) >= 4  # 115 tokens in 32-token chunks
        assert all("w" not in s[s.index("s"):] for s in saving)  # never after a save
        assert all(nxt.startswith("w") for s, nxt in zip(steps, steps[1:]) if "s" in s and
                   "s" in nxt)  # settled before the next forward that saves again
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()
