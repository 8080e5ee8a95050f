"""Where one KV transfer's time goes (issue 42): bench_kv_transfer.py's end-to-end transfer
(producer connector -> pipe -> consumer connector in another process, timed to the ACK) of
one prompt size over each pipe named, with wall time summed per stage on both sides:

producer: save_kv_layer (the engine thread's per-layer Python), the shm pipe's copy and seal
(its thread; a copy-only and a seal-only pass over the same blocks split the two), the
notifications, the ZMQ pipe's gather into send buffers; consumer: the MAC check of written
blocks (shm), the scatter of received layers into blocks (zmq), the receiver's handling of
each message. Stages overlap across threads and processes, so they need not add up to the
end-to-end time; the share of each says what a cut can win. Prints one table per pipe.

    python scripts/profile_kv_transfer.py --tokens 16384 --pipes shm zmq
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import bench_kv_transfer as bench  # noqa: E402

Timers = dict[str, list[float]]  # stage -> [seconds, calls]


def _wrap(owner: Any, name: str, label: str, timers: Timers) -> None:
    fn = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            cell = timers[label]
            cell[0] += time.perf_counter() - t0
            cell[1] += 1
    setattr(owner, name, timed)


def _instrument(timers: Timers) -> None:
    from connectors import kv_landing, kv_receiver, layer_sender, pd_connector
    from connectors.pipes import shm_pipe, zmq_pipe
    _wrap(pd_connector.PDConnectorWorker, "save_kv_layer", "P save_kv_layer (engine thread)",
          timers)
    _wrap(shm_pipe, "copy_and_seal", "P shm copy+seal (pipe thread)", timers)
    _wrap(shm_pipe.ShmPipe, "_notify", "P shm notification", timers)
    _wrap(layer_sender.LayerSender, "layer_messages", "P zmq gather+queue", timers)
    _wrap(zmq_pipe.ZmqPipe, "recv_tensor", "D recv_tensor (pipe check, dequeue)", timers)
    _wrap(kv_landing, "check_written", "D shm MAC check", timers)
    _wrap(kv_landing, "scatter_blocks", "D zmq scatter into blocks", timers)
    _wrap(kv_receiver.KVReceiver, "on_message", "D on_message (all)", timers)


def _report(side: str, timers: Timers, total: float | None) -> None:
    for label, (secs, calls) in sorted(timers.items(), key=lambda kv: -kv[1][0]):
        share = f"{secs / total:6.1%}" if total else "      "
        print(f"  {label:<42} {secs * 1e3:9.1f} ms {share} {int(calls):>6} calls", flush=True)


def _consumer(conn: Any, *args: Any) -> None:
    """bench_kv_transfer's consumer, timed; prints its table when told to stop."""
    timers: Timers = defaultdict(lambda: [0.0, 0])
    _instrument(timers)
    real = conn.recv

    def recv() -> Any:  # the first command of a measured round resets the timers
        cmd = real()
        if isinstance(cmd, tuple) and cmd[0].endswith("-1"):
            timers.clear()
        return cmd
    conn.recv = recv
    bench._consumer(conn, *args)
    print("consumer (one measured transfer):", flush=True)
    _report("D", timers, None)


def seal_split(tokens: int, integrity: str) -> None:
    """The shm pipe's copy and its MAC over the same blocks, apart (one thread)."""
    from connectors.pipes.shm_pipe import copy_and_seal
    from connectors.pipes.written_check import Sealer
    num_blocks = -(-tokens // bench.SHAPE["block_size"])
    src = bench._caches(2 * num_blocks, torch.float32)
    dst = bench._caches(2 * num_blocks, torch.float32)
    ids = list(range(num_blocks))
    dst_ids = torch.randperm(2 * num_blocks)[:num_blocks].tolist()
    as_u8 = lambda c: c.reshape(2, c.shape[1], -1).view(torch.uint8)  # noqa: E731
    for mode in ("none", integrity):
        t0 = time.perf_counter()
        for s, d in zip(src, dst):
            copy_and_seal(as_u8(s), as_u8(d), ids, dst_ids, Sealer(mode, bytes(32),
                                                                    bytes(16), b"h"))
        dt = time.perf_counter() - t0
        nbytes = sum(s[:, :num_blocks].nbytes for s in src)
        print(f"  copy+seal {mode:<5} one thread: {dt * 1e3:8.1f} ms "
              f"({nbytes / dt / 1e9:.2f} GB/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--pipes", nargs="+", default=["shm", "zmq"], choices=["shm", "zmq"])
    parser.add_argument("--integrity", default="mac", choices=["mac", "crc32", "none"])
    args = parser.parse_args()
    from connectors.secret import has_secret, install, new_secret
    if not has_secret():
        install(new_secret())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    bench._consumer = _consumer  # spawned by reference: this module's, timed
    timers: Timers = defaultdict(lambda: [0.0, 0])
    _instrument(timers)
    for pipe in args.pipes:
        transport = "ipc" if pipe == "shm" else "tcp"
        producer, here, proc, peer = bench._pair(args.tokens, transport, {
            "pipe": pipe, "integrity": args.integrity})
        real = here.send

        def send(cmd: Any) -> None:  # round 0 warms up; round 1 is measured
            if isinstance(cmd, tuple) and cmd[0].endswith("-1"):
                timers.clear()
            real(cmd)
        here.send = send
        try:
            rate, nbytes = bench.transfer_throughput(args.tokens, producer, here, peer, 2)
            total = nbytes / rate
            print(f"{pipe} (integrity {args.integrity}), {args.tokens} tokens, "
                  f"{nbytes / 2**20:.0f} MiB: best {total * 1e3:.1f} ms end to end "
                  f"({rate / 1e9:.2f} GB/s); producer (the second transfer):", flush=True)
            _report("P", timers, total)
        finally:
            here.send = real
            here.send(None)
            proc.join(timeout=60)
            producer.close()
    print("the shm pipe's copy and MAC apart:")
    seal_split(args.tokens, args.integrity)


if __name__ == "__main__":
    main()
