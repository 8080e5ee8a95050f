"""A producer stalled past the consumer's bound (SIGSTOP, a long native call, a blocking
build) never turns into wrong tokens: when its in-place write lands after the decode engine
gave up on the transfer and recomputed, the blocks it writes into are no longer anyone's
(the decode engine reuses a gave-up grant only once the producer can no longer write into it)."""
from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from connectors.pipes import shm_pipe
from pd_cluster import SamplingParams
from tests.pd_helpers import (colocated_tokens, drain, engine, prompts_of_lengths,
                              submit_pair)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
WAIT_S = 20.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from pd_cluster.checkpoints.maker import make_model
    return str(make_model(tmp_path_factory.mktemp("stall") / "m", arch="llama", num_layers=2))


def _step_until(d: Any, cond, what: str, done: dict[str, list[int]]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, what
        for out in d.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        time.sleep(0.002)


def test_a_write_that_lands_after_the_consumer_gave_up_never_reaches_a_new_request(
        model, monkeypatch) -> None:
    a, b = prompts_of_lengths([40, 41])
    ref = colocated_tokens(model, [a, b], [GREEDY, GREEDY], block_size=8)
    # D has room for two requests: B gets the blocks A gave back (A was granted 6 of 13).
    d = engine(model, "consumer", timeout=1.0, pipe="shm", block_size=8, num_kv_blocks=13,
               enable_prefix_caching=False)
    p = engine(model, "producer", timeout=WAIT_S, pipe="shm", block_size=8)
    entered, release, landed = threading.Event(), threading.Event(), threading.Event()
    real = shm_pipe.copy_and_seal

    def stalled(*args: Any) -> None:
        if not entered.is_set():  # the first write: the producer stalls in it
            entered.set()
            release.wait(WAIT_S)
            real(*args)
            landed.set()
            return
        real(*args)

    monkeypatch.setattr(shm_pipe, "copy_and_seal", stalled)
    done: dict[str, list[int]] = {}
    stop = threading.Event()

    def run_p() -> None:
        while not stop.is_set():
            p.step()
            time.sleep(0.002)

    prod = threading.Thread(target=run_p, daemon=True)
    try:
        submit_pair(p, d, "A", a, GREEDY, d.kv_endpoint())
        prod.start()
        _step_until(d, entered.is_set, "the producer's first write", done)
        _step_until(d, lambda: "A" in done, "A recomputed by the consumer", done)
        assert d.stats()["kv_fallbacks"] == 1
        assert d.stats()["num_kv_fenced_blocks"] > 0  # A's granted blocks: out of use
        d.add_request("B", b, GREEDY)
        d.step()  # B's prompt KV is in the blocks A was granted
        release.set()  # the stalled write lands now
        assert landed.wait(WAIT_S)
        time.sleep(0.05)  # (its notification reaches the consumer meanwhile)
        _step_until(d, lambda: "B" in done, "B", done)
        assert done == {"A": ref[0], "B": ref[1]}
        _step_until(d, lambda: not p.has_unfinished_requests(), "the producer", done)
        stop.set()
        prod.join(WAIT_S)
        drain(p, d)  # the last answers: the producer frees on the step after
        assert d.stats()["num_kv_fenced_blocks"] == 0  # lifted by the producer's late FIN
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        stop.set(), release.set()
        prod.join(WAIT_S)
        p.close(), d.close()


# ---- the fence's life cycle, on the receiver alone ------------------------------------------

def _receiver(timeout: float = 0.05, fence_limit: float = 120.0):
    from connectors.kv_receiver import KVReceiver
    from connectors.metadata import RecvSpec
    r = KVReceiver(num_layers=1, block_size=4, timeout=timeout, max_staging_bytes=1 << 20,
                   fence_limit=fence_limit)
    r.check_written = lambda *a: None  # a pipe that writes in place
    r.register(RecvSpec("r", (3, 4), 8))
    return r


def _offer(r: Any, peer: str) -> None:
    from connectors.metadata import OfferHeader
    r.on_message(OfferHeader("r"), None, peer)
    assert r.take_holds()  # the grant went to ``peer``


def _timed_out(r: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while "r" not in r.take_finished():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_gave_up_receive_is_fenced_until_its_writer_finishes() -> None:
    from connectors.metadata import FinHeader
    r = _receiver()
    _offer(r, "P")
    _timed_out(r)
    assert r.take_unfenced() == set() and r.num_fenced == 1
    assert r.on_message(FinHeader("r", 7, 8), None, "P") == [("P", "r", False)]  # NACKed
    assert r.take_unfenced() == {"r"} and r.num_fenced == 0


def test_a_lost_writer_lifts_its_fence_and_a_cancel_without_writers_is_unfenced_at_once() -> None:
    r = _receiver()
    _offer(r, "P")
    r.cancel("r")
    assert r.take_unfenced() == set()
    r.lose_peers(["Q"])  # someone else
    assert r.take_unfenced() == set()
    r.lose_peers(["P"])  # a dead producer writes nothing
    assert r.take_unfenced() == {"r"}
    plain = _receiver()  # no grant went out: nothing can land late
    plain.cancel("r")
    assert plain.take_unfenced() == {"r"}


def test_a_fence_has_a_bound() -> None:
    r = _receiver(fence_limit=0.0)
    _offer(r, "P")
    _timed_out(r)
    deadline = time.monotonic() + WAIT_S
    while not r.take_unfenced():
        assert time.monotonic() < deadline
        r.take_finished()
        time.sleep(0.01)
    assert r.num_fences_expired == 1


def test_the_consumer_pipe_reports_a_producer_whose_connection_closed() -> None:
    from connectors.pipes.base import PipeConfig
    from connectors.pipes.zmq_pipe import ZmqPipe
    cons, prod = ZmqPipe(PipeConfig()), ZmqPipe(PipeConfig())
    try:
        addr = cons.listen()
        prod.connect(addr, {})
        prod.send_tensor(addr, {"hi": 1}, None).result(WAIT_S)
        msg = cons.recv_tensor(WAIT_S)
        assert msg is not None
        prod.close()
        deadline, lost = time.monotonic() + WAIT_S, []
        while not lost:
            assert time.monotonic() < deadline, "no disconnect reported"
            lost = cons.take_lost_peers()
            time.sleep(0.01)
        assert lost == [msg[0]]  # (peer, header, tensor): as messages name it
    finally:
        prod.close(), cons.close()
