"""An engine's tensor-parallel communication: its process groups and the step channel.

Each engine makes its own groups straight from a TCPStore (no process-global default group),
so several engines can share a process. The CPU (Gloo) group carries control: the step
broadcast from rank 0 and the gather of each rank's finished transfers. The device group runs
the model's collectives: NCCL on GPUs, the same Gloo group on CPUs. Every collective is bounded
by the group's timeout (a dead peer fails it at once; a hung one after the timeout).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from pd_cluster.engine.step_input import StepInput
from pd_cluster.models.layers.tp import TPGroup

_CAPACITY = 64 * 1024  # bytes broadcast per step in one collective (larger steps: one more)


class Keepalive(msgspec.Struct, tag="keepalive"):
    """Sent while the engine is idle, so a worker's wait never reaches the timeout."""


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class PeerOp(msgspec.Struct, tag="peer"):
    """Connect (handshake, off the step path: a worker runs it in a thread and reports under
    ``peerop/<seq>/<rank>`` in the store) or disconnect a KV peer on every rank."""
    op: str  # "connect" | "disconnect" | "role" (endpoint: the connector's new role)
    endpoint: str
    tag: str | None
    seq: int


class RankTransfers(msgspec.Struct):
    """One rank's connector report for a step (byte counters are totals so far)."""
    sending: list[str] = []
    recving: dict[str, int | None] = {}
    bytes_sent: int = 0
    bytes_received: int = 0
    unfenced: list[str] = []


StepMessage = StepInput | Keepalive | Shutdown | PeerOp


def create_groups(store: dist.Store, rank: int, size: int, device: torch.device,
                  timeout: float) -> tuple[Any, TPGroup]:
    """(CPU group, the TPGroup the model is built with). Blocks until every rank joined."""
    delta = timedelta(seconds=timeout)
    cpu = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, delta)
    if device.type != "cuda":
        return cpu, TPGroup(rank, size, cpu)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = delta
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, opts)
    return cpu, TPGroup(rank, size, nccl)


class StepChannel:
    """Rank 0 -> every rank: one typed message per step, msgpack in one Gloo broadcast of a
    fixed-size buffer (8-byte length, then the payload; what does not fit follows in a second
    broadcast). Ranks -> rank 0: each rank's RankTransfers."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self._buf = torch.zeros(_CAPACITY, dtype=torch.uint8)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StepMessage)
        self._transfers = msgspec.msgpack.Decoder(RankTransfers)

    def send(self, msg: StepMessage) -> None:
        if self.rank != 0:
            raise RuntimeError(f"only rank 0 broadcasts steps (this is rank {self.rank})")
        data = self._encoder.encode(msg)
        head = len(data).to_bytes(8, "little")
        inline = min(len(data), _CAPACITY - 8)
        self._buf[:8 + inline] = torch.frombuffer(bytearray(head + data[:inline]),
                                                  dtype=torch.uint8)
        self.group.broadcast(self._buf, 0).wait()
        if len(data) > inline:
            rest = torch.frombuffer(bytearray(data[inline:]), dtype=torch.uint8)
            self.group.broadcast(rest, 0).wait()

    def recv(self) -> StepMessage:
        self.group.broadcast(self._buf, 0).wait()
        n = int.from_bytes(self._buf[:8].numpy().tobytes(), "little")
        inline = min(n, _CAPACITY - 8)
        data = self._buf[8:8 + inline].numpy().tobytes()
        if n > inline:
            rest = torch.empty(n - inline, dtype=torch.uint8)
            self.group.broadcast(rest, 0).wait()
            data += rest.numpy().tobytes()
        return self._decoder.decode(data)

    def gather_transfers(self, mine: RankTransfers) -> list[RankTransfers]:
        """Every rank's report (all ranks call this after a step; rank 0 uses the result)."""
        data = self._encoder.encode(mine)
        lens = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(lens, torch.tensor([len(data)]), group=self.group)
        width = max(int(t) for t in lens)
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(parts, buf, group=self.group)
        return [self._transfers.decode(p[:int(n)].numpy().tobytes())
                for p, n in zip(parts, lens)]
