"""Part 4 of scripts/bench_kv_transfer.py (issues 29, 38): what each ``kv_transfer`` integrity
mode costs on each pipe, end to end, and each tag alone (connectors/pipes/integrity.py)."""
from __future__ import annotations

import os
import time
from typing import Callable

# Part 4 (issue 38): each kv_transfer integrity mode on each pipe, end to end: no proof and
# no check, the proof with CRC-32, the proof with the MAC (the default), CURVE with the MAC.
SECURITY_MODES = {"none": {"security": "none", "integrity": "none"},
                  "crc32": {"security": "token", "integrity": "crc32"},
                  "mac": {"security": "token", "integrity": "mac"},
                  "curve+mac": {"security": "curve", "integrity": "mac"}}
PIPES = {"zmq-tcp": ("zmq", "tcp"), "zmq-ipc": ("zmq", "ipc"), "gloo": ("gloo", "tcp")}


def part4(n_tokens: int, repeats: int, pipes: list[str], modes: list[str], pair: Callable,
          throughput: Callable, block_size: int) -> None:
    """The same transfer (``pair``: a producer process's connector to a consumer process's;
    ``throughput``: one transfer's GB/s) in each mode and pipe, best of ``repeats``; modes
    alternate in order per pipe (a shared machine's drift hits all alike). Then each tag
    alone over one layer message."""
    from connectors.pipes.integrity import Channel, payload_code
    from connectors.pipes.wire import tensor_bytes
    rates: dict[tuple[str, str], float] = {}
    for i, name in enumerate(pipes):
        pipe, transport = PIPES[name]
        for mode in modes[::-1] if i % 2 else modes:
            producer, here, proc, peer = pair(n_tokens, transport,
                                               {"pipe": pipe, **SECURITY_MODES[mode]})
            rates[name, mode], nbytes = throughput(n_tokens, producer, here, peer, repeats)
            here.send(None)
            proc.join(timeout=30)
            producer.close()
    print(f"integrity modes, {n_tokens} tokens ({nbytes / 2**20:.1f} MiB of KV), GB/s end to "
          f"end (load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}):")
    over = [m for m in modes if m != "none"] if "none" in modes else []  # (--smoke: mac alone)
    print(f"{'pipe':>8} " + " ".join(f"{m:>9}" for m in modes)
          + " " + " ".join(f"{m + '/none':>14}" for m in over))
    for name in pipes:
        print(f"{name:>8} " + " ".join(f"{rates[name, m] / 1e9:>9.2f}" for m in modes) + " "
              + " ".join(f"{rates[name, m] / rates[name, 'none']:>14.3f}" for m in over))
    layer = producer.kv_caches[0][0, :-(-n_tokens // block_size)]  # one K message
    data, key = tensor_bytes(layer.contiguous()), b"k" * 32
    alone = {"mac": lambda: Channel("mac", key, key).seal(b"head", [data]),
             "crc32": lambda: Channel("crc32").seal(b"head", [data]),
             "sha256 (collective payloads)": lambda: payload_code("mac", data)}
    for what, fn in alone.items():
        t0, n = time.perf_counter(), 20
        for _ in range(n):
            fn()
        print(f"{what} alone: {n * layer.nbytes / (time.perf_counter() - t0) / 1e9:.2f} GB/s "
              f"(one {layer.nbytes / 2**20:.2f} MiB message, this thread)")
    if "crc32" in modes and "mac" in modes:
        print(" ".join(f"integrity_mac_over_crc32_{n.replace('-', '_')}="
                       f"{rates[n, 'mac'] / rates[n, 'crc32']:.3f}" for n in pipes))
