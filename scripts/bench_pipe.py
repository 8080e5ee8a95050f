"""Throughput of our ZMQ pipe vs raw pyzmq with the same frame sizes, measured in one run.

    PYTHONPATH=. python scripts/bench_pipe.py [--total-mib 512] [--transport tcp] [--repeats 5]
    python scripts/bench_pipe.py --smoke    # a few seconds, figures meaningless (CI)

Producer here, consumer in a spawned process (as P and D are). Raw and pipe rounds alternate
so machine noise hits both alike; prints the best GB/s of each and the pipe/raw ratio for 1, 4
and 8 MiB messages (one message = one payload frame; frames are at most 8 MiB).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from connectors.pipes import PipeConfig, create_pipe  # noqa: E402
from pipe_raw import RawZmqSession, Session, serve_rounds  # noqa: E402


def _pipe_receiver(transport: str, conn: Any) -> None:
    pipe = create_pipe("zmq", PipeConfig(transport=transport))
    conn.send(pipe.listen())

    def recv_one() -> None:
        if pipe.recv_tensor(timeout=60) is None:
            raise TimeoutError("no message from the producer")

    try:
        serve_rounds(conn, recv_one)
    finally:
        pipe.close()


class PipeSession(Session):
    """ZmqPipe.send_tensor -> recv_tensor, bf16 tensors, a KV-like header per message."""

    def __init__(self, transport: str = "tcp") -> None:
        super().__init__(_pipe_receiver, transport)
        self.pipe = create_pipe("zmq", PipeConfig(transport=transport))
        self.pipe.connect(self.addr, {"bench": True})
        self._tensors: dict[int, torch.Tensor] = {}
        self._i = 0

    def send_one(self, frame_bytes: int) -> None:
        t = self._tensors.get(frame_bytes)
        if t is None:
            t = torch.randint(-99, 99, (frame_bytes // 2,), dtype=torch.int16).view(torch.bfloat16)
            self._tensors[frame_bytes] = t
        self._i += 1
        self.pipe.send_tensor(self.addr, {"req": "bench", "layer": self._i % 32}, t)

    def close(self) -> None:
        super().close()
        self.pipe.close()


def pipe_throughput(frame_bytes: int, total_bytes: int, transport: str = "tcp",
                    repeats: int = 1) -> float:
    """Bytes/s of our pipe across two processes (the best of `repeats` rounds)."""
    with PipeSession(transport) as s:
        return max(s.round(frame_bytes, total_bytes) for _ in range(max(1, repeats)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total-mib", type=int, default=512)
    ap.add_argument("--transport", default="tcp", choices=["tcp", "ipc"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true",
                    help="a few seconds (CI): 8 MiB per round, one round each")
    a = ap.parse_args()
    from connectors.secret import has_secret, install, new_secret
    if not has_secret():  # the processes below prove it to each other (inherited)
        install(new_secret())
    if a.smoke:
        a.total_mib, a.repeats = 8, 1
    total = a.total_mib << 20
    print(f"zmq {a.transport}, {a.total_mib} MiB per round, best of {a.repeats} alternating "
          f"rounds, {os.cpu_count()} CPUs")
    print(f"{'frame':>6} {'raw GB/s':>9} {'pipe GB/s':>10} {'pipe/raw':>9}")
    with RawZmqSession(a.transport) as raw, PipeSession(a.transport) as ours:
        for mib in (1, 4, 8):
            r = p = 0.0
            for _ in range(a.repeats):
                r = max(r, raw.round(mib << 20, total))
                p = max(p, ours.round(mib << 20, total))
            print(f"{mib:>4}Mi {r / 1e9:>9.2f} {p / 1e9:>10.2f} {p / r:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
