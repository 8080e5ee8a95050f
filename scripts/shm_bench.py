"""The shm pipe against a raw memcpy between two processes' shared buffers, for
bench_kv_transfer.py (issue 42).

End to end: the producer connector copies every layer's blocks into the consumer process's
granted (shuffled) blocks in its shared cache file, each layer with its notification and MAC
(checked by the consumer), timed from the OFFER to the consumer's ACK
(bench_kv_transfer.transfer_throughput). Raw: a buffer in a /dev/shm file mapped by a second
process; this process copies the same bytes into it, one contiguous copy per layer (raw), or
one copy per KV block into shuffled blocks (raw-blocks, the connector's pattern when the
consumer's blocks are scattered), then tells the other process and waits for its answer (one
round trip, as the ACK is): no grant, no MAC, no control messages. Both copy with torch on one
thread (the bench sets one). Beside them: the ceiling (shm_ceiling.py: the pipe's fused copy
and the other process's check with no protocol, same grant) and the pipe with a churned grant
(churned_grant.py: both ends' blocks as our pool hands them out after serving a while).
Importable with scripts/ on sys.path.
"""
from __future__ import annotations

import mmap
import os
import statistics
import time
from typing import Any, Callable

import torch

from shm_ceiling import ceiling, shared_peer

TIMEOUT_S = 120.0


def _raw_target(conn: Any, path: str, nbytes: int) -> None:
    """The other process: maps the buffer, answers each 'done' (it could read it now)."""
    fd = os.open(path, os.O_RDWR)
    buf = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
    os.close(fd)
    conn.send("mapped")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(int(buf[-1]))  # touch it, as a consumer would


def raw_shm_copy(nbytes: int, repeats: int, ways: tuple[tuple[int, int], ...]) -> list[float]:
    """Per (layers, block) of ``ways``, the best bytes/s of ``nbytes`` copied as ``layers``
    copies (or, with ``block`` not 0, one per block of that many bytes into shuffled blocks
    of each of the ``layers`` parts) into a buffer another process maps, plus one round trip
    to it. One target process serves every way (each costs a second to start)."""
    with shared_peer("raw-bench", nbytes, _raw_target) as (dst, here):
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        return [_raw_rounds(here, src, dst, layers, repeats, block) for layers, block in ways]


def _raw_rounds(here: Any, src: torch.Tensor, dst: torch.Tensor, layers: int, repeats: int,
                block: int) -> float:
    nbytes = src.numel()
    src_np, dst_np = src.numpy(), dst.numpy()
    per = nbytes // layers
    n = per // block if block else 1
    best = 0.0
    for _ in range(repeats + 1):  # the first round faults the pages in
        order = torch.randperm(n).tolist()
        t0 = time.perf_counter()
        for i in range(layers):
            base = i * per
            if not block:
                dst[base:base + per].copy_(src[base:base + per])
                continue
            for j, k in enumerate(order):  # numpy slices, as the pipe copies blocks
                dst_np[base + k * block:base + (k + 1) * block] = \
                    src_np[base + j * block:base + (j + 1) * block]
        here.send("done")
        if not here.poll(TIMEOUT_S):
            raise TimeoutError("raw shm target did not answer")
        here.recv()
        best = max(best, layers * per / (time.perf_counter() - t0))
    return best


def part_shm(sizes: list[int], repeats: int, pair: Callable, throughput: Callable,
             num_layers: int, modes: tuple[str, ...] = ("mac", "none")) -> float:
    """Each size end to end over the shm pipe (each integrity mode in ``modes``, mac first:
    the default and the figure) and raw, side by side; prints and returns ``shm_efficiency``
    (median of ours with mac / raw)."""
    raws = {}
    print("shm pipe (the consumer's cache in /dev/shm, one copy per run of blocks) against a "
          "raw memcpy into another process's shared buffer:")
    print("(raw: one contiguous copy per layer; raw-blocks: one copy per KV block into "
          "shuffled blocks, the connector's pattern here)")
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    same: list[float] = []
    churned: list[float] = []
    tops: list[float] = []
    for mode in modes:
        producer, here, proc, peer = pair(max(sizes), "ipc", {"pipe": "shm", "integrity": mode})
        print(f"integrity {mode}:")
        print(f"{'tokens':>7} {'KV MiB':>8} {'ours GB/s':>10} {'raw GB/s':>9} {'ratio':>6} "
              f"{'raw-blocks GB/s':>15} {'ratio':>6}")
        block = producer.kv_caches[0][0, 0].nbytes
        block_tokens = producer.kv_caches[0].shape[2]
        try:
            for n in sizes:
                ours, nbytes = throughput(n, producer, here, peer, repeats)
                if n not in raws:
                    raws[n] = raw_shm_copy(nbytes, repeats, ((num_layers, 0),
                                                             (2 * num_layers, block)))
                raw, raw_blocks = raws[n]
                ratios[mode].append(ours / raw)
                if mode == modes[0]:
                    same.append(ours / raw_blocks)
                print(f"{n:>7} {nbytes / 2**20:>8.1f} {ours / 1e9:>10.2f} {raw / 1e9:>9.2f} "
                      f"{ours / raw:>6.2f} {raw_blocks / 1e9:>15.2f} {ours / raw_blocks:>6.2f}")
            if mode == modes[0]:
                print("ceiling (shm_ceiling.py: the fused copy and the other process's check "
                      "alone, same shuffled grant, no protocol; raw as above):")
                for n in sizes:
                    nb = -(-n // block_tokens)
                    gen = torch.Generator().manual_seed(n)  # transfer_throughput's grant
                    dst_ids = torch.randperm(2 * nb, generator=gen)[:nb].tolist()
                    top = ceiling(list(range(nb)), dst_ids, num_layers, 2,
                                  producer.kv_caches[0].shape[1], block, repeats)
                    if top is None:
                        print("(no GHASH kernel here: no ceiling)")
                        break
                    tops.append(top / raws[n][0])
                    print(f"{n:>7} {'':>8} {top / 1e9:>10.2f} {raws[n][0] / 1e9:>9.2f} "
                          f"{top / raws[n][0]:>6.2f}")
                print("churned grant (both ends' blocks as our engine's pool hands them out "
                      "after serving a while: churned_grant.py; raw as above):")
                for n in sizes:
                    ours, _ = throughput(n, producer, here, peer, repeats, churned=True)
                    churned.append(ours / raws[n][0])
                    print(f"{n:>7} {'':>8} {ours / 1e9:>10.2f} {raws[n][0] / 1e9:>9.2f} "
                          f"{ours / raws[n][0]:>6.2f}")
        finally:
            here.send(None)
            proc.join(timeout=30)
            producer.close()
    for mode in modes[1:]:
        print(f"shm_efficiency_integrity_{mode}={statistics.median(ratios[mode]):.3f}")
    print(f"shm_efficiency_same_copies={statistics.median(same):.3f}")
    print(f"shm_efficiency_churned_grant={statistics.median(churned):.3f}")
    if tops:
        print(f"shm_ceiling_with_mac={statistics.median(tops):.3f}")
    seal_rates((256 << 10, 4 << 20), 64 << 20 if len(sizes) > 1 else 8 << 20)
    efficiency = statistics.median(ratios[modes[0]])
    print(f"shm_efficiency={efficiency:.3f}")
    return efficiency


def seal_rates(pieces: tuple[int, ...], total: int, rounds: int = 3) -> None:
    """What a write's copy and MAC cost per piece size on this thread, GB/s over ``total``
    bytes (out of cache, as a layer's blocks are): copy alone, copy then OpenSSL's GMAC over
    the piece (the path without the kernel), the GHASH kernel's fused copy (written_check
    with kernels/ghash_copy.py), and each hash alone (the consumer's check). Best of
    ``rounds``."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from kernels import ghash_copy
    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    dst = torch.zeros(total, dtype=torch.uint8)
    key = bytes(32)

    def gmac() -> Any:
        return Cipher(algorithms.AES(key), modes.GCM(bytes(12))).encryptor()

    def copy(n: int) -> None:  # numpy, as copy_and_seal without the kernel
        src_np, dst_np = src.numpy(), dst.numpy()
        for i in range(0, total, n):
            dst_np[i:i + n] = src_np[i:i + n]

    def copy_openssl(n: int) -> None:
        mac, src_np, dst_np = gmac(), src.numpy(), dst.numpy()
        for i in range(0, total, n):
            dst_np[i:i + n] = src_np[i:i + n]
            mac.authenticate_additional_data(src_np[i:i + n])
        mac.finalize()

    def openssl(n: int) -> None:
        mac, src_np = gmac(), src.numpy()
        for i in range(0, total, n):
            mac.authenticate_additional_data(src_np[i:i + n])
        mac.finalize()

    def fused(n: int) -> None:  # as copy_and_seal: the pieces as one layer's blocks
        mac = ghash_copy.Gmac(key, bytes(12))
        ids = list(range(total // n))
        mac.copy_blocks(src.view(1, -1, n), dst.view(1, -1, n), ids, ids)
        mac.tag()

    def kernel_hash(n: int) -> None:
        mac = ghash_copy.Gmac(key, bytes(12))
        for i in range(0, total, n):
            mac.update(src[i:i + n])
        mac.tag()

    ways: dict[str, Callable[[int], None]] = {"copy": copy, "copy+openssl": copy_openssl,
                                              "openssl hash": openssl}
    if ghash_copy.available(wait=True):
        ways.update({"fused copy+ghash": fused, "kernel hash": kernel_hash})
    else:
        print("(no GHASH kernel here: fused and kernel rows left out)")
    print(f"a write's copy and MAC alone, GB/s over {total >> 20} MiB, this thread:")
    print(f"{'piece':>8} " + " ".join(f"{w:>17}" for w in ways))
    for n in pieces:
        rates = []
        for fn in ways.values():
            best = float("inf")
            for _ in range(rounds + 1):  # the first faults the pages in
                t0 = time.perf_counter()
                fn(n)
                best = min(best, time.perf_counter() - t0)
            rates.append(total / best / 1e9)
        print(f"{n >> 10:>6}Ki " + " ".join(f"{r:>17.2f}" for r in rates))
