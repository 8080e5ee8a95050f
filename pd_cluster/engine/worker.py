"""A tensor-parallel worker process (ranks 1..N-1): its ModelRunner runs every step rank 0
broadcasts, until a Shutdown, a failed collective, or its engine's death."""
from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pd_cluster.config import EngineConfig, read_hf_config
from pd_cluster.engine.tp_comm import (Keepalive, PeerOp, RankTransfers, Shutdown, StepChannel,
                                       create_groups)

logger = logging.getLogger("pd_cluster.engine.worker")
_STARTUP_TIMEOUT = 600.0


def _watch_parent(parent: int) -> None:
    """Exit as soon as the engine process is gone (no orphans, whatever killed it)."""
    def run() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.2)
    threading.Thread(target=run, name="parent-watch", daemon=True).start()


def _device(config: EngineConfig, rank: int) -> torch.device:
    if config.device == "auto":
        raise ValueError("device: a worker runs on its engine's resolved device, got 'auto'")
    device = config.torch_device
    if device.type == "cuda":  # rank r: the engine's r-th visible device
        base = device.index or 0
        return torch.device("cuda", base + rank)
    return device


def run_worker(config: EngineConfig, rank: int, port: int) -> None:
    from pd_cluster.engine.executor import create_worker_connector, max_model_len_of
    from pd_cluster.engine.kv_tiers.setup import create_tier_store
    from pd_cluster.engine.model_runner import ModelRunner

    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", port, size, False,
                          timeout=timedelta(seconds=_STARTUP_TIMEOUT))
    store.set(f"ready/{rank}", "1")
    device = _device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cpu_group, tp = create_groups(store, rank, size, device, config.collective_timeout)
    hf_config = read_hf_config(config.model)
    runner = ModelRunner(config, hf_config, max_model_len_of(config, hf_config), tp, device)
    kv = config.kv_transfer
    store.set(f"blocks/{rank}", str(runner.fitting_blocks(kv.device_reserve_bytes() if kv else 0)))
    store.wait(["blocks/agreed"])
    runner.allocate_kv_cache(int(store.get("blocks/agreed")))
    create_tier_store(config, runner)
    create_worker_connector(config, runner, tp)
    if runner.connector is not None:
        store.set(f"endpoint/{rank}", runner.connector.endpoint() or "")
    channel = StepChannel(cpu_group, rank, size)
    try:
        while True:
            msg = channel.recv()
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, Keepalive):
                continue
            if isinstance(msg, PeerOp):
                threading.Thread(target=_peer_op, args=(runner.connector, msg, store, rank),
                                 daemon=True).start()
                continue
            runner.run_step(msg)
            if runner.connector is not None:
                channel.gather_transfers(rank_transfers(runner))
    finally:
        runner.close()
        if runner.connector is not None:
            runner.connector.close()


def rank_transfers(runner: Any) -> RankTransfers:
    ended = runner.finished_transfers()
    stats = runner.connector.stats()
    return RankTransfers(sorted(ended.sent), dict(ended.received), stats["kv_bytes_sent"],
                         stats["kv_bytes_received"], sorted(ended.unfenced))


def _peer_op(connector: Any, op: PeerOp, store: Any, rank: int) -> None:
    """A handshake blocks up to the pipe's timeout: never on the step loop."""
    error = ""
    try:
        if op.op == "connect":
            connector.connect_peer(op.endpoint, op.tag)
        elif op.op == "role":  # ``endpoint`` names the role; the new endpoint is published
            store.set(f"endpoint/{rank}", connector.set_role(op.endpoint) or "")
        else:
            connector.disconnect_peer(op.endpoint)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        error = f"{type(e).__name__}: {e}" or "failed"
    store.set(f"peerop/{op.seq}/{rank}", error)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args()
    _watch_parent(args.parent)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{args.rank} %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        run_worker(EngineConfig.model_validate_json(args.config), args.rank, args.port)
    except Exception:
        logger.exception("tensor-parallel worker rank %d failed", args.rank)
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main()
