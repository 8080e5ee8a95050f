"""Rank 0's handle on an engine's other ranks: worker processes it starts, feeds one broadcast
per step, keeps alive while idle, and takes down with it.

Workers are child processes of the engine (packed on the engine's node; on GPUs rank r uses
the engine's r-th visible device). They die with the engine: each watches its parent, and a
closed or timed-out collective ends it too. A worker that exits fails the engine's next step
with an error naming it; the engine is then restarted as a whole.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from pd_cluster.config import EngineConfig
from pd_cluster.engine.tp_comm import (Keepalive, PeerOp, RankTransfers, Shutdown, StepChannel,
                                       create_groups)
from pd_cluster.engine.step_input import StepInput
from pd_cluster.models.layers.tp import TPGroup

logger = logging.getLogger(__name__)
_STARTUP_TIMEOUT = 600.0  # s: worker start, model load and cache sizing


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


class WorkerError(RuntimeError):
    """A tensor-parallel worker died, hung past the collective timeout, or failed."""


class WorkerGroup:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.size = config.tensor_parallel_size
        self.timeout = config.collective_timeout
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, True, wait_for_workers=False,
                                   timeout=timedelta(seconds=_STARTUP_TIMEOUT))
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        # Rank 0's device, not "auto": a worker must not pick another kind of device.
        config_json = config.on_device(device).model_dump_json()
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "pd_cluster.engine.worker", "--config",
             config_json, "--rank", str(r), "--port", str(self.store.port),
             "--parent", str(os.getpid())], env=env) for r in range(1, self.size)]
        # Killed when this handle is collected or the interpreter exits, whatever happens.
        weakref.finalize(self, _kill, list(self.procs))
        self._lock = threading.Lock()  # one collective sequence at a time (steps, keepalives)
        self._failed: str | None = None
        self._last = time.monotonic()
        self._closed = threading.Event()
        self._peer_ops = 0
        try:
            self._wait_keys([f"ready/{r}" for r in range(1, self.size)], "worker start")
            self.cpu_group, self.tp = create_groups(self.store, 0, self.size, device,
                                                    self.timeout)
        except BaseException:
            self.kill()
            raise
        self.channel = StepChannel(self.cpu_group, 0, self.size)

    def start(self) -> None:
        """Every rank is set up (model, cache, connector): keep them alive while idle from now
        (earlier, a keepalive would time out against a worker still loading its model)."""
        self._last = time.monotonic()
        threading.Thread(target=self._keepalive, name="tp-keepalive", daemon=True).start()

    @property
    def tp_group(self) -> TPGroup:
        return self.tp

    def agree_num_blocks(self, mine: int) -> int:
        """The KV budget is per rank; every rank allocates the smallest rank's block count."""
        self._wait_keys([f"blocks/{r}" for r in range(1, self.size)], "worker model load")
        counts = [mine] + [int(self.store.get(f"blocks/{r}")) for r in range(1, self.size)]
        agreed = min(counts)
        self.store.set("blocks/agreed", str(agreed))
        return agreed

    @contextmanager
    def step(self, step: StepInput) -> Iterator[None]:
        """Broadcast ``step``; rank 0 runs its part inside the block (collectives in lockstep)."""
        with self._lock:
            self.check()
            try:
                self.channel.send(step)
                yield
            except Exception as e:
                self._fail(f"{type(e).__name__}: {e}")
                raise WorkerError(self._failed) from e
            finally:
                self._last = time.monotonic()

    def endpoints(self) -> list[str]:
        """Ranks 1..N-1's KV endpoints (published once their connectors listen)."""
        keys = [f"endpoint/{r}" for r in range(1, self.size)]
        self._wait_keys(keys, "worker KV endpoints")
        return [self.store.get(k).decode() for k in keys]

    def peer_op(self, op: str, endpoint: str, tag: str | None) -> int:
        """Start ``op`` on every worker (one broadcast); ``wait_peer_op`` collects the results."""
        with self._lock:
            self.check()
            self._peer_ops += 1
            try:
                self.channel.send(PeerOp(op, endpoint, tag, self._peer_ops))
            except Exception as e:
                self._fail(f"{type(e).__name__}: {e}")
                raise WorkerError(self._failed) from e
            self._last = time.monotonic()
            return self._peer_ops

    def wait_peer_op(self, seq: int, timeout: float) -> None:
        keys = [f"peerop/{seq}/{r}" for r in range(1, self.size)]
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                raise WorkerError(f"tensor-parallel workers did not finish a KV handshake "
                                  f"within {timeout:.0f}s")
            time.sleep(0.02)
        errors = [(r, self.store.get(k).decode()) for r, k in enumerate(keys, start=1)]
        for rank, error in errors:
            if error:
                raise ValueError(f"rank {rank}: {error}")

    def gather_transfers(self, mine: RankTransfers) -> list[RankTransfers]:
        return self.channel.gather_transfers(mine)

    def check(self) -> None:
        if self._failed is None:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    self._fail(f"tensor-parallel worker rank {rank} exited ({proc.returncode})")
        if self._failed is not None:
            raise WorkerError(self._failed)

    def close(self) -> None:
        """Stop the workers (a Shutdown broadcast, then kill whatever is left)."""
        if self._closed.is_set():  # closed or failed before: nothing to say to the workers
            self.kill()
            return
        self._closed.set()
        if self._failed is None and self._lock.acquire(timeout=self.timeout):
            try:
                self.channel.send(Shutdown())
            except Exception:  # noqa: BLE001 - a dead worker: killed below
                pass
            finally:
                self._lock.release()
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        self._closed.set()
        _kill(self.procs)

    # ---- internals -----------------------------------------------------------------------
    def _fail(self, why: str) -> None:
        if self._failed is None:
            self._failed = why
            logger.error("tensor-parallel engine failed: %s", why)
        self.kill()  # the group is unusable now: no worker outlives it

    def _wait_keys(self, keys: list[str], what: str) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        while not self.store.check(keys):
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    raise WorkerError(f"tensor-parallel worker rank {rank} exited "
                                      f"({proc.returncode}) during {what}")
            if time.monotonic() > deadline:
                raise WorkerError(f"timed out after {_STARTUP_TIMEOUT}s waiting for {what}")
            time.sleep(0.05)

    @property
    def failed(self) -> bool:
        return self._failed is not None

    def _keepalive(self) -> None:
        """While idle: keep the workers' waits short of the timeout, and notice a worker that
        died (the engine then fails on its next step, which it takes at once)."""
        period = self.timeout / 4
        while not self._closed.wait(min(period / 2, 1.0)):
            if self._failed is None and any(p.poll() is not None for p in self.procs):
                with self._lock:
                    try:
                        self.check()
                    except WorkerError:
                        pass
            if time.monotonic() - self._last < period or self._failed is not None:
                continue
            if not self._lock.acquire(timeout=period):
                continue
            try:
                if not self._closed.is_set() and self._failed is None:
                    self.channel.send(Keepalive())
                    self._last = time.monotonic()
            except Exception as e:  # noqa: BLE001 - reported by the next step
                self._fail(f"{type(e).__name__}: {e}")
            finally:
                self._lock.release()
