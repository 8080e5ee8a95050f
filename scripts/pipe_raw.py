"""Raw pyzmq throughput between two processes: the ceiling our pipes are measured against.

`raw_zmq_throughput(frame_bytes, total_bytes, transport)` sends `total_bytes` as frames of
`frame_bytes` over plain PUSH/PULL, zero-copy on both sides, from this process to a spawned
receiver, and returns bytes/s. `RawZmqSession` keeps the receiver alive across rounds so a
benchmark can interleave raw and pipe rounds (the fair way on a shared, noisy machine).
Importable by other benchmarks with scripts/ on sys.path.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import uuid
from typing import Any, Callable

import zmq

WARMUP = 4
TIMEOUT_S = 120.0


def endpoint(transport: str) -> str:
    """A bind address: tcp on an OS-chosen loopback port, or a fresh ipc path."""
    if transport == "tcp":
        return "tcp://127.0.0.1:*"
    if transport == "ipc":
        return f"ipc://{tempfile.gettempdir()}/pd-raw-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    raise ValueError(f"transport must be 'tcp' or 'ipc', got {transport!r}")


def bench_context() -> Any:
    """Where a benchmark's other ends start: forked from a server that imported torch, zmq
    and the connector once, so each starts in a fraction of a second instead of re-importing
    them (~1 s of a 2-core machine per process under spawn; --smoke starts about eight).
    The server is fresh (no thread, no socket of this process); start-ups are never timed."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "zmq", "connectors.pd_connector"])
    return ctx


def expect(conn: Any, what: str, proc: Any) -> Any:
    """The child's next message; fails fast if the child died, and after TIMEOUT_S."""
    deadline = time.monotonic() + TIMEOUT_S
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"receiver process exited ({proc.exitcode}) before {what!r}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"receiver process did not answer {what!r} in {TIMEOUT_S}s")
    return conn.recv()


def serve_rounds(conn: Any, recv_one: Callable[[], None]) -> None:
    """Child side of a session: per ("round", n) command take WARMUP + n messages."""
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            return
        for _ in range(WARMUP):
            recv_one()
        conn.send("warm")
        for _ in range(cmd[1]):
            recv_one()
        conn.send("done")


class Session:
    """A spawned receiver kept alive across rounds; subclasses define both ends."""

    def __init__(self, target: Callable[..., None], transport: str) -> None:
        ctx = bench_context()
        self._conn, there = ctx.Pipe()
        self._proc = ctx.Process(target=target, args=(transport, there), daemon=True)
        self._proc.start()
        self.addr = expect(self._conn, "address", self._proc)

    def send_one(self, frame_bytes: int) -> None:
        raise NotImplementedError

    def round(self, frame_bytes: int, total_bytes: int) -> float:
        """Bytes/s for total_bytes in frame_bytes messages (after WARMUP unmeasured ones)."""
        n = max(1, total_bytes // frame_bytes)
        self._conn.send(("round", n))
        for _ in range(WARMUP):
            self.send_one(frame_bytes)
        expect(self._conn, "warm", self._proc)
        t0 = time.perf_counter()
        for _ in range(n):
            self.send_one(frame_bytes)
        expect(self._conn, "done", self._proc)
        return n * frame_bytes / (time.perf_counter() - t0)

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(("stop",))
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _raw_receiver(transport: str, conn: Any) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.bind(endpoint(transport))
    addr = s.getsockopt_string(zmq.LAST_ENDPOINT)
    conn.send(addr)
    try:
        serve_rounds(conn, lambda: s.recv(copy=False))   # zero-copy Frame, dropped at once
    finally:
        s.close(linger=0)
        ctx.term()
        if addr.startswith("ipc://") and os.path.exists(addr[6:]):
            os.unlink(addr[6:])


class RawZmqSession(Session):
    """Plain PUSH -> PULL, zero-copy sends of one immutable buffer."""

    def __init__(self, transport: str = "tcp") -> None:
        super().__init__(_raw_receiver, transport)
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(self.addr)
        self._bufs: dict[int, memoryview] = {}

    def send_one(self, frame_bytes: int) -> None:
        buf = self._bufs.get(frame_bytes)
        if buf is None:
            buf = self._bufs[frame_bytes] = memoryview(os.urandom(frame_bytes))
        self._push.send(buf, copy=False)

    def close(self) -> None:
        super().close()
        self._push.close()
        self._ctx.term()


def raw_zmq_throughput(frame_bytes: int, total_bytes: int, transport: str = "tcp",
                       repeats: int = 1) -> float:
    """Bytes/s of plain zero-copy PUSH/PULL, sender here, receiver in a spawned process
    (the best of `repeats` rounds)."""
    with RawZmqSession(transport) as s:
        return max(s.round(frame_bytes, total_bytes) for _ in range(max(1, repeats)))


if __name__ == "__main__":
    for mib in (1, 4, 8):
        print(f"raw zmq tcp, {mib} MiB frames: "
              f"{raw_zmq_throughput(mib << 20, 1 << 30) / 1e9:.2f} GB/s")
