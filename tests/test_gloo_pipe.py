"""The collective pipe's protocol (the NCCL pipe's, with Gloo communicators) on CPUs: data in
order across processes, a killed peer, a transfer timeout, and a fresh channel after each.

Every wait has a bound, so a broken pipe fails a test instead of hanging it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from connectors.pipes import PipeConfig, PipeError, create_pipe
from tests.test_pipes import HELLO, _cases, _check_received, _validator

CASES_WITH_TENSORS = [c for c in _cases() if c[1] is not None]


def _cfg(**kw) -> PipeConfig:
    kw.setdefault("linger", 0.2)
    kw.setdefault("send_timeout", 5.0)
    kw.setdefault("handshake_timeout", 10.0)
    return PipeConfig(transport="tcp", **kw)


def _consumer(q_addr, q_out, transfer_timeout: float, read: bool) -> None:
    """A consumer process: listens, reports its address, receives (or not) until killed."""
    pipe = create_pipe("gloo", _cfg(extra={"transfer_timeout": transfer_timeout}))
    pipe.set_handshake_validator(_validator)
    q_addr.put(pipe.listen())
    while True:
        if not read:
            time.sleep(0.1)
            continue
        m = pipe.recv_tensor(timeout=1.0)
        if m is not None:
            q_out.put((m[1], m[2]))


def _start_consumer(ctx, transfer_timeout: float = 3.0, read: bool = True):
    q_addr, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_consumer, args=(q_addr, q_out, transfer_timeout, read),
                       daemon=True)
    proc.start()
    return proc, q_addr.get(timeout=60), q_out


def _kill(proc) -> None:
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=10)


def test_roundtrip_in_one_process() -> None:
    cons, prod = create_pipe("gloo", _cfg()), create_pipe("gloo", _cfg())
    try:
        addr = cons.listen()
        cons.set_handshake_validator(_validator, info={"role": "decode"})
        assert prod.connect(addr, HELLO)["info"] == {"role": "decode"}
        cases = _cases()
        futs = [prod.send_tensor(addr, h, t) for h, t in cases]
        got = []
        for _ in cases:  # receives are posted as the headers arrive
            m = cons.recv_tensor(timeout=10)
            assert m is not None
            got.append(m[1:])
        for f in futs:
            assert f.result(timeout=10) is None
        _check_received(got, cases)
        peer = m[0]
        cons.send_tensor(peer, {"ack": 1}, None).result(timeout=5)  # replies go over ZMQ
        assert prod.recv_tensor(timeout=5) == (addr, {"ack": 1}, None)
        assert prod.stats()["gloo_inflight_bytes"] == 0
    finally:
        prod.close()
        cons.close()


def test_killed_peer_fails_the_send_then_a_new_peer_gets_a_fresh_channel() -> None:
    ctx = mp.get_context("spawn")
    prod = create_pipe("gloo", _cfg(extra={"transfer_timeout": 5.0}))
    proc, addr, out = _start_consumer(ctx)
    try:
        prod.connect(addr, HELLO)
        h, t = CASES_WITH_TENSORS[0]
        prod.send_tensor(addr, h, t).result(timeout=15)
        rh, rt = out.get(timeout=15)
        assert rh == h and torch.equal(rt, t)
        _kill(proc)
        start = time.monotonic()
        with pytest.raises(PipeError):
            prod.send_tensor(addr, h, t).result(timeout=15)
        assert time.monotonic() - start < 10  # bounded: the transfer timeout, not forever
        proc, addr, out = _start_consumer(ctx)  # the engine restarted: re-linked from scratch
        prod.connect(addr, HELLO)
        for hh, tt in CASES_WITH_TENSORS:
            prod.send_tensor(addr, hh, tt).result(timeout=15)
        _check_received([out.get(timeout=15) for _ in CASES_WITH_TENSORS], CASES_WITH_TENSORS)
    finally:
        prod.close()
        _kill(proc)


def test_timeout_aborts_the_channel_and_a_reconnect_recreates_it() -> None:
    """A consumer that does not read: the send times out and aborts that channel; connecting
    again creates a new one, and the header sent on the old channel is dropped, not matched
    with the new channel's bytes."""
    ctx = mp.get_context("spawn")
    prod = create_pipe("gloo", _cfg(extra={"transfer_timeout": 2.0}))
    cons = create_pipe("gloo", _cfg(extra={"transfer_timeout": 2.0}))
    try:
        addr = cons.listen()
        cons.set_handshake_validator(_validator)
        prod.connect(addr, HELLO)
        big = torch.randn(4 << 20)  # 16 MiB: more than the socket buffers hold unread
        with pytest.raises(PipeError):
            prod.send_tensor(addr, {"kind": "stale"}, big).result(timeout=15)
        with pytest.raises(PipeError, match="no usable gloo communicator"):
            prod.send_tensor(addr, {"kind": "after"}, torch.ones(3)).result(timeout=15)
        prod.connect(addr, HELLO)  # what the connector's re-link does
        h, t = CASES_WITH_TENSORS[1]
        fut = prod.send_tensor(addr, h, t)
        got = [cons.recv_tensor(timeout=10) for _ in range(1)]
        assert got[0] is not None and got[0][1] == h and torch.equal(got[0][2], t)
        assert fut.result(timeout=10) is None
    finally:
        prod.close()
        cons.close()
