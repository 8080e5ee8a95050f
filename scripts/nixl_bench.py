"""The nixl pipe against NIXL's own raw WRITE, for bench_kv_transfer.py (issue 42).

End to end: the producer connector's WRITEs of every layer's blocks into the consumer
process's granted (shuffled) blocks, each with its notification and MAC, timed from the OFFER
to the consumer's ACK (bench_kv_transfer.transfer_throughput); a second, labelled line with
the consumer's blocks in order. With the consumer's staging slab (on by default for host
caches) the shuffled grant's writes go contiguously into it and the consumer copies them into
the blocks (connectors/pipes/nixl_staging.py): ``nixl_staged_share`` says how many bytes did.
Raw: two bare NIXL agents in
two processes, the same bytes as one contiguous WRITE per layer with a notification on each,
no grant, no MAC, timed from the first post until the target saw every notification.
Importable with scripts/ on sys.path; needs NIXL (pip install torch==2.13.0 ".[nixl]").
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any, Callable

import torch

from pipe_raw import bench_context

TIMEOUT_S = 120.0


def nixl_available() -> str | None:
    """None, or why the nixl rows are skipped."""
    from connectors.pipes.base import PipeError
    from connectors.pipes.nixl_pipe import load_nixl
    try:
        load_nixl()
    except PipeError as e:
        return str(e)
    return None


def _agent(name: str) -> Any:
    from connectors.pipes.nixl_pipe import load_nixl
    nixl = load_nixl()
    return nixl.nixl_agent(name, nixl.nixl_agent_config(backends=["UCX"]))


def _raw_target(conn: Any, nbytes: int) -> None:
    torch.set_num_threads(1)
    agent = _agent(f"raw-target-{mp.current_process().pid}")
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    agent.register_memory([buf])
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    while True:
        want = conn.recv()
        if want is None:
            return
        seen, deadline = 0, time.monotonic() + TIMEOUT_S
        while seen < want and time.monotonic() < deadline:
            seen += sum(len(m) for m in agent.get_new_notifs().values())
        conn.send(seen)


def _descs(base: int, first: int, per: int, block: int, order: Any) -> Any:
    import numpy as np
    if not block:
        return np.array([[base + first, per, 0]], dtype=np.uint64)
    rows = np.stack([base + first + order * block, np.full(len(order), block),
                     np.zeros(len(order), dtype=np.int64)], 1)
    return rows.astype(np.uint64)


def raw_nixl_write(nbytes: int, layers: int, repeats: int, block: int = 0) -> float:
    """Best bytes/s of ``nbytes`` written as ``layers`` WRITEs between two processes' agents
    (UCX), each notified: one contiguous descriptor per layer, or (``block``) one per block
    of that many bytes into shuffled destination blocks, as the connector's writes are."""
    ctx = bench_context()
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_raw_target, args=(there, nbytes), daemon=True)
    proc.start()
    try:
        agent = _agent(f"raw-initiator-{mp.current_process().pid}")
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        agent.register_memory([src])
        if not here.poll(TIMEOUT_S):
            raise TimeoutError("raw NIXL target did not start")
        md, dst = here.recv()
        remote = agent.add_remote_agent(md)
        remote = remote.decode() if isinstance(remote, bytes) else remote
        per = nbytes // layers
        import numpy as np
        best = 0.0
        for _ in range(repeats + 1):  # the first round connects and warms up
            here.send(layers)
            t0 = time.perf_counter()
            handles = []
            n = per // block if block else 1
            for i in range(layers):
                local = _descs(src.data_ptr(), i * per, per, block, np.arange(n))
                far = _descs(dst, i * per, per, block, np.random.permutation(n))
                h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"),
                                          agent.get_xfer_descs(far, "DRAM"), remote, b"l%d" % i)
                agent.transfer(h)
                handles.append(h)
            deadline = time.monotonic() + TIMEOUT_S
            for h in handles:
                while agent.check_xfer_state(h) == "PROC" and time.monotonic() < deadline:
                    pass
            assert here.poll(TIMEOUT_S) and here.recv() == layers, "raw NIXL: notifications lost"
            best = max(best, layers * per / (time.perf_counter() - t0))
            for h in handles:
                agent.release_xfer_handle(h)
        return best
    finally:
        here.send(None)
        proc.join(timeout=30)


def part_nixl(sizes: list[int], repeats: int, pair: Callable, throughput: Callable,
              num_layers: int) -> float | None:
    """Each size end to end over the nixl pipe and raw, side by side; prints and returns
    ``nixl_efficiency`` (median of ours / raw), or None when NIXL is not installed."""
    why = nixl_available()
    if why is not None:
        print(f"nixl rows skipped: {why}")
        return None
    producer, here, proc, peer = pair(max(sizes), "tcp", {"pipe": "nixl"})
    ratios = []
    print("nixl pipe (UCX, CPU memory, integrity mac) against NIXL's raw WRITE:")
    print("(raw: one contiguous WRITE per layer; raw-blocks: the same bytes as one descriptor "
          "per KV block into shuffled blocks, the connector's pattern)")
    print(f"{'tokens':>7} {'KV MiB':>8} {'ours GB/s':>10} {'raw GB/s':>9} {'ratio':>6} "
          f"{'raw-blocks GB/s':>15} {'ratio':>6}")
    block = producer.kv_caches[0][0, 0].nbytes
    same, in_order, churned, raws = [], [], [], []
    before = producer.pipe.stats()
    try:
        for n in sizes:
            ours, nbytes = throughput(n, producer, here, peer, repeats)
            raw = raw_nixl_write(nbytes, num_layers, repeats)
            raw_blocks = raw_nixl_write(nbytes, num_layers, repeats, block)
            ratios.append(ours / raw)
            same.append(ours / raw_blocks)
            raws.append(raw)
            print(f"{n:>7} {nbytes / 2**20:>8.1f} {ours / 1e9:>10.2f} {raw / 1e9:>9.2f} "
                  f"{ours / raw:>6.2f} {raw_blocks / 1e9:>15.2f} {ours / raw_blocks:>6.2f}")
        after = producer.pipe.stats()
        staged, written = (after[k] - before[k] for k in ("nixl_staged_bytes",
                                                           "nixl_bytes_written"))
        # of the shuffled grant's bytes, how many went through the consumer's staging slab
        # (connectors/pipes/nixl_staging.py; kv_transfer.extra.nixl_staging_mb)
        print(f"nixl_staged_share={staged / max(written, 1):.3f}")
        # Not the figure above: the consumer's blocks in order (a fresh free pool), so each
        # layer's K and V go as one descriptor each (nixl_layout.CacheLayout.write_descs)
        print("contiguous grant (the consumer's blocks in order; raw as above):")
        for n, raw in zip(sizes, raws):
            ours, _ = throughput(n, producer, here, peer, repeats, dst_in_order=True)
            in_order.append(ours / raw)
            print(f"{n:>7} {'':>8} {ours / 1e9:>10.2f} {raw / 1e9:>9.2f} {ours / raw:>6.2f}")
        print("churned grant (both ends' blocks as our engine's pool hands them out after "
              "serving a while: churned_grant.py; raw as above):")
        for n, raw in zip(sizes, raws):
            ours, _ = throughput(n, producer, here, peer, repeats, churned=True)
            churned.append(ours / raw)
            print(f"{n:>7} {'':>8} {ours / 1e9:>10.2f} {raw / 1e9:>9.2f} {ours / raw:>6.2f}")
    finally:
        here.send(None)
        proc.join(timeout=30)
        producer.close()
    efficiency = statistics.median(ratios)
    print(f"nixl_efficiency_same_descriptors={statistics.median(same):.3f}")
    print(f"nixl_efficiency_contiguous_grant={statistics.median(in_order):.3f}")
    print(f"nixl_efficiency_churned_grant={statistics.median(churned):.3f}")
    print(f"nixl_efficiency={efficiency:.3f}")
    return efficiency
