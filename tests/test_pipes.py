"""Pipes: ZMQ over tcp/ipc in one process and across processes; NCCL import/guard and 2-GPU run.

Every wait below has a timeout, so a broken pipe fails a test instead of hanging it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
import types

import msgpack
import pytest
import torch
import zmq

from connectors.pipes import (HandshakeError, PipeClosed, PipeConfig, PipeError, PipeTimeout,
                              create_pipe)
from connectors.pipes.sync import InflightGate
from connectors.pipes import wire

MiB = 1 << 20
HELLO = {"model": "tiny-llama", "dtype": "bfloat16", "block_size": 16, "num_layers": 2,
         "num_kv_heads": 2, "head_dim": 8}


def _validator(hello: dict):
    for k, v in HELLO.items():
        if hello.get(k) != v:
            return f"{k} mismatch: mine {v!r}, yours {hello.get(k)!r}"
    return None


def _cfg(transport: str = "tcp", **kw) -> PipeConfig:
    kw.setdefault("linger", 0.2)
    kw.setdefault("send_timeout", 5.0)
    kw.setdefault("handshake_timeout", 5.0)
    return PipeConfig(transport=transport, **kw)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view for exact comparison (NaN-safe, works for bf16/fp16)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _cases() -> list:
    """(header, tensor) pairs: dtypes, sizes across the 64 KiB copy threshold and 8 MiB frames."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(5 * MiB, generator=g)                       # 20 MiB fp32: 3 frames
    return [
        ({"kind": "fp32", "layer": 0, "blocks": [3, 1, 4]}, torch.randn(4, 16, 8, generator=g)),
        ({"kind": "fp16"}, torch.randn(2, 300, 64, generator=g).half()),       # ~75 KiB
        ({"kind": "bf16", "nested": {"a": [1, 2], "b": None}},
         torch.randn(3, 70000, generator=g).to(torch.bfloat16)),
        ({"kind": "small", "raw": b"\x00\xff"}, torch.arange(10, dtype=torch.int64)),
        ({"kind": "big"}, big),
        ({"kind": "none"}, None),
        ({"kind": "empty"}, torch.empty(0, 5, dtype=torch.float16)),
        ({"kind": "scalar"}, torch.tensor(3.5, dtype=torch.bfloat16)),
        ({"kind": "noncontig"}, torch.randn(64, 64, generator=g).t()),
    ]


def _check_received(got: list, cases: list) -> None:
    assert len(got) == len(cases)
    for (hdr, t), (rhdr, rt) in zip(cases, got):
        assert rhdr == hdr
        assert (rt is None) if t is None else _same(rt, t), hdr["kind"]


@pytest.fixture(params=["tcp", "ipc"])
def pair(request):
    cons = create_pipe("zmq", _cfg(request.param))
    prod = create_pipe("zmq", _cfg(request.param))
    addr = cons.listen()
    cons.set_handshake_validator(_validator, info={"role": "decode"})
    reply = prod.connect(addr, HELLO)
    assert reply["ok"] and reply["info"] == {"role": "decode"}
    yield cons, prod, addr
    prod.close()
    cons.close()


def test_roundtrip_and_reply(pair):
    cons, prod, addr = pair
    cases = _cases()
    futs = [prod.send_tensor(addr, h, t) for h, t in cases]
    for f in futs:
        assert f.result(timeout=10) is None
    got, peer = [], None
    for _ in cases:
        m = cons.recv_tensor(timeout=10)
        assert m is not None
        peer = m[0]
        got.append(m[1:])
    _check_received(got, cases)
    # consumer -> producer: the peer name recv_tensor gave is the reply address
    cons.send_tensor(peer, {"ack": "req-1"}, None).result(timeout=5)
    cons.send_tensor(peer, {"ack": "t"}, torch.ones(3)).result(timeout=5)
    assert prod.recv_tensor(timeout=5) == (addr, {"ack": "req-1"}, None)
    p, h, t = prod.recv_tensor(timeout=5)
    assert (p, h) == (addr, {"ack": "t"}) and torch.equal(t, torch.ones(3))
    assert cons.recv_tensor(timeout=0.05) is None
    assert prod.stats()["inflight_bytes"] == 0


def _producer_proc(addr: str, transport: str, q) -> None:
    try:
        prod = create_pipe("zmq", _cfg(transport))
        prod.connect(addr, HELLO)
        for h, t in _cases():
            prod.send_tensor(addr, h, t)
        reply = prod.recv_tensor(timeout=20)
        q.put(("ok", reply[1] if reply else None))
        prod.close()
    except BaseException as e:  # reported to the parent, which fails the test
        q.put(("error", repr(e)))


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_producer_in_another_process(transport):
    ctx = mp.get_context("spawn")
    cons = create_pipe("zmq", _cfg(transport))
    try:
        addr = cons.listen()
        cons.set_handshake_validator(_validator)
        q = ctx.Queue()
        proc = ctx.Process(target=_producer_proc, args=(addr, transport, q), daemon=True)
        proc.start()
        cases, got, peer = _cases(), [], None
        for _ in cases:
            m = cons.recv_tensor(timeout=30)
            assert m is not None, "no message from the producer process"
            peer, got = m[0], got + [m[1:]]
        _check_received(got, cases)
        cons.send_tensor(peer, {"done": True}, None).result(timeout=5)
        assert q.get(timeout=20) == ("ok", {"done": True})
        proc.join(timeout=10)
        assert proc.exitcode == 0
    finally:
        cons.close()


def test_handshake_mismatch_and_timeout():
    cons, prod = create_pipe("zmq", _cfg()), create_pipe("zmq", _cfg(handshake_timeout=0.5))
    try:
        addr = cons.listen()
        cons.set_handshake_validator(_validator)
        with pytest.raises(HandshakeError, match="block_size mismatch: mine 16, yours 32"):
            prod.connect(addr, {**HELLO, "block_size": 32})
        with pytest.raises(PipeTimeout):
            prod.connect("tcp://127.0.0.1:1", HELLO)    # nobody listens there
        assert prod.connect(addr, HELLO)["ok"]          # a corrected hello is accepted
        with pytest.raises(TypeError):
            prod.send_tensor(addr, {"bad": object()}, None)
    finally:
        prod.close()
        cons.close()


def test_unknown_peers_fail_the_future():
    cons, prod = create_pipe("zmq", _cfg()), create_pipe("zmq", _cfg())
    try:
        cons.listen()
        with pytest.raises(PipeError, match="unknown or disconnected peer"):
            cons.send_tensor("nobody", {}, torch.ones(2)).result(timeout=5)
        with pytest.raises(PipeError, match="not connected"):
            prod.send_tensor("tcp://127.0.0.1:1", {}, None).result(timeout=5)
        assert cons.stats()["inflight_bytes"] == prod.stats()["inflight_bytes"] == 0
    finally:
        prod.close()
        cons.close()


def test_inflight_gate_blocks_then_proceeds_or_times_out():
    gate = InflightGate(cap=3)
    gate.acquire(2, timeout=1)
    entered = threading.Event()
    t = threading.Thread(target=lambda: (gate.acquire(2, timeout=5), entered.set()))
    t.start()
    assert not entered.wait(0.2)            # blocked at the cap
    gate.release(2)
    assert entered.wait(5)                  # proceeds once memory is released
    t.join(5)
    with pytest.raises(PipeTimeout):
        gate.acquire(2, timeout=0.1)
    gate.release(2)
    gate.acquire(10, timeout=0.1)           # bigger than the cap, but nothing in flight: goes
    assert gate.peak == 10


def test_backpressure_bounds_memory_and_all_data_arrives(pair):
    cons, prod, addr = pair
    cap = 2 * MiB + 4096
    prod2 = create_pipe("zmq", _cfg(prod.config.transport, max_inflight_bytes=cap))
    try:
        prod2.connect(addr, HELLO)
        tensors = [torch.full((MiB // 4,), float(i)) for i in range(16)]   # 16 x 1 MiB
        futs: list = []
        sender = threading.Thread(
            target=lambda: futs.extend(prod2.send_tensor(addr, {"i": i}, t)
                                       for i, t in enumerate(tensors)))
        sender.start()
        for i in range(16):
            m = cons.recv_tensor(timeout=10)
            assert m is not None and m[1] == {"i": i} and torch.equal(m[2], tensors[i])
            time.sleep(0.01)                # a slow reader
        sender.join(10)
        assert len(futs) == 16 and all(f.result(timeout=5) is None for f in futs)
        assert prod2.stats()["peak_inflight_bytes"] <= cap
    finally:
        prod2.close()


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_send_times_out_when_receiver_never_reads(transport):
    # The consumer takes at most ~1 MiB off the socket and its zmq queues hold 2 messages, so
    # after what the kernel buffers absorb (a few MiB) nothing is released and sends must block.
    cons = create_pipe("zmq", _cfg(transport, max_recv_bytes=MiB, hwm=2))
    prod = create_pipe("zmq", _cfg(transport, max_inflight_bytes=2 * MiB, hwm=2,
                                   send_timeout=0.3))
    try:
        addr = cons.listen()
        prod.connect(addr, HELLO)
        t = torch.zeros(MiB // 4)
        with pytest.raises(PipeTimeout, match="receiver not draining"):
            for _ in range(200):
                prod.send_tensor(addr, {}, t)
        assert prod.stats()["inflight_bytes"] <= 2 * MiB + 4096
        # draining resumes the flow
        assert cons.recv_tensor(timeout=5) is not None
    finally:
        prod.close()
        cons.close()


def _recv_frames(sock: zmq.Socket, timeout_ms: int = 5000) -> list:
    assert sock.poll(timeout_ms), "no reply"
    return sock.recv_multipart()


def test_garbage_does_not_kill_the_receiver():
    # security none, integrity none: a raw socket can handshake and send untagged data
    # (test_kv_security.py and test_kv_integrity.py cover the proofs and the tags)
    cons = create_pipe("zmq", _cfg(security="none", integrity="none"))
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        addr = cons.listen()
        cons.set_handshake_validator(_validator)
        raw.connect(addr)
        good = torch.arange(6, dtype=torch.float32)
        good_frames = [wire.pack("d", {"ok": 1}, wire.tensor_meta(good)), good.numpy().tobytes()]
        raw.send_multipart(good_frames)                  # before any handshake: dropped
        raw.send_multipart([wire.pack("hello", {**HELLO, "_integrity": "none"})])
        ack = msgpack.unpackb(_recv_frames(raw)[0])
        assert ack["k"] == "ack" and ack["h"]["ok"]
        garbage = [
            [os.urandom(100)],                           # random bytes
            [b""],                                       # empty header
            [good_frames[0][:7]],                        # truncated msgpack
            [msgpack.packb([1, 2, 3])],                  # not a map
            [msgpack.packb({"v": 1, "k": "d"})],         # missing header
            [msgpack.packb({"v": 9, "k": "d", "h": {}})],                    # wrong version
            [wire.pack("d", {}, ["complex1024", [2]]), b"x" * 8],            # unknown dtype
            [wire.pack("d", {}, ["float32", [-1]]), b""],                    # negative dim
            [wire.pack("d", {}, ["float32", "abc"]), b""],                   # shape not a list
            [good_frames[0], good_frames[1][:-1]],                           # truncated payload
            [good_frames[0], good_frames[1], b"extra"],                      # too much payload
            [wire.pack("d", {}, None), b"stray"],                            # payload, no meta
            [wire.pack("ack", {"ok": True})],                                # wrong direction
            [b"\x00" * (2 * MiB)],                                           # oversized header
        ]
        for frames in garbage:
            raw.send_multipart(frames)
        raw.send_multipart(good_frames)
        m = cons.recv_tensor(timeout=5)
        assert m is not None and m[1] == {"ok": 1} and torch.equal(m[2], good)
        assert cons.stats()["dropped"] == len(garbage)
        assert cons.stats()["refused"] == 1  # the data before the handshake
        # and a real producer is still served
        prod = create_pipe("zmq", _cfg(security="none", integrity="none"))
        prod.connect(addr, HELLO)
        prod.send_tensor(addr, {"after": True}, torch.ones(2)).result(timeout=5)
        assert cons.recv_tensor(timeout=5)[1] == {"after": True}
        prod.close()
    finally:
        raw.close()
        ctx.term()
        cons.close()


def test_close_is_idempotent_and_fails_pending():
    # A consumer that stops reading at 1 MiB (one that closed ends the link at once: sends
    # then fail, tests/test_kv_peer_binding.py)
    # hwm 1 on both ends: zmq's own queues (1000 messages by default) and the consumer's I/O
    # thread would otherwise take all 10 MiB, and every send could be released before close.
    cons = create_pipe("zmq", _cfg(max_recv_bytes=MiB, hwm=1))
    prod = create_pipe("zmq", _cfg(send_timeout=600.0, hwm=1))
    addr = cons.listen()
    prod.connect(addr, HELLO)
    futs = [prod.send_tensor(addr, {}, torch.zeros(MiB // 4)) for _ in range(40)]
    # Nothing reads 10 MiB: sends are pending here (the send timeout is far off).
    pending = [f for f in futs if not f.done()]
    assert pending
    prod.close()
    prod.close()
    cons.close()
    cons.close()
    assert all(f.done() for f in futs)
    assert any(isinstance(f.exception(), PipeClosed) for f in pending)
    with pytest.raises(PipeClosed):
        prod.send_tensor(addr, {}, None)
    with pytest.raises(PipeClosed):
        for _ in range(50):  # what was already received, then closed
            cons.recv_tensor(timeout=0.1)


def test_registry_and_config():
    with pytest.raises(ValueError, match=r"unknown pipe 'carrier-pigeon'.*'zmq'"):
        create_pipe("carrier-pigeon", PipeConfig())
    with pytest.raises(ValueError, match="transport"):
        PipeConfig(transport="udp")
    with pytest.raises(ValueError, match="unknown pipe config keys"):
        PipeConfig.from_dict({"transport": "tcp", "bogus": 1})
    assert PipeConfig.from_dict({"port": 5}).port == 5


# ------------------------------------------------------------------------------- NCCL


def test_nccl_pipe_imports_without_cupy_and_says_what_is_missing(monkeypatch):
    for mod in ("cupy", "cupy.cuda", "cupy.cuda.nccl"):
        monkeypatch.setitem(sys.modules, mod, None)    # `import cupy` now raises ImportError
    import connectors.pipes.nccl_pipe as nccl_pipe
    with pytest.raises(RuntimeError, match=r"nccl pipe needs cupy-cuda12x and a CUDA GPU; "
                                           r"install pd-cluster\[nccl\]"):
        create_pipe("nccl", PipeConfig())
    assert nccl_pipe.NEEDS.startswith("nccl pipe needs")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_nccl_pipe_with_cupy_but_no_gpu_says_so(monkeypatch):
    fake = types.ModuleType("cupy")
    fake.cuda = types.ModuleType("cupy.cuda")
    fake.cuda.nccl = types.ModuleType("cupy.cuda.nccl")
    for name, mod in (("cupy", fake), ("cupy.cuda", fake.cuda), ("cupy.cuda.nccl", fake.cuda.nccl)):
        monkeypatch.setitem(sys.modules, name, mod)
    with pytest.raises(RuntimeError,
                       match=r"nccl pipe needs cupy-cuda12x.*\(torch sees no CUDA GPU\)"):
        create_pipe("nccl", PipeConfig())


def _have_two_gpus_and_cupy() -> bool:
    try:
        import cupy  # noqa: F401
        from cupy.cuda import nccl  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _nccl_dtype_cases() -> list:
    g = torch.Generator().manual_seed(1)
    return [({"i": 0}, torch.randn(3, 1000, generator=g)),
            ({"i": 1}, torch.randn(5, 4096, generator=g).half()),
            ({"i": 2}, torch.randn(64, 16, 8, generator=g).to(torch.bfloat16)),
            ({"i": 3}, torch.randn(5 * MiB, generator=g)),
            ({"i": 4}, None)]


def _nccl_consumer_proc(q_addr, q_result, q_done) -> None:
    try:
        pipe = create_pipe("nccl", _cfg(extra={"device": 1}, handshake_timeout=60))
        pipe.set_handshake_validator(_validator)
        q_addr.put(pipe.listen())
        ok = []
        for h, t in _nccl_dtype_cases():
            peer, rh, rt = pipe.recv_tensor(timeout=60)
            ok.append(rh == h and ((rt is None) if t is None else
                                   (rt.device.index == 1 and _same(rt.cpu(), t))))
        pipe.send_tensor(peer, {"all_ok": all(ok)}, None).result(timeout=10)
        q_result.put(ok)
        q_done.get(timeout=120)  # the producer has our answer: closing cannot cut it off
        pipe.close()
    except BaseException as e:
        q_result.put(repr(e))


@pytest.mark.two_gpu
@pytest.mark.skipif(not _have_two_gpus_and_cupy(), reason="needs 2 CUDA GPUs and cupy-cuda12x")
def test_nccl_transfer_between_two_processes():
    ctx = mp.get_context("spawn")
    q_addr, q_result, q_done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_nccl_consumer_proc, args=(q_addr, q_result, q_done), daemon=True)
    proc.start()
    pipe = create_pipe("nccl", _cfg(extra={"device": 0}, handshake_timeout=60))
    try:
        addr = q_addr.get(timeout=120)
        pipe.connect(addr, HELLO)
        futs = [pipe.send_tensor(addr, h, None if t is None else t.cuda(0))
                for h, t in _nccl_dtype_cases()]
        for f in futs:
            f.result(timeout=60)
        assert q_result.get(timeout=120) == [True] * len(futs)
        assert pipe.recv_tensor(timeout=30)[1] == {"all_ok": True}
    finally:
        q_done.put(True)
        pipe.close()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
