"""Point-to-point tensor channels under the collective pipe: one 2-rank group per peer, rank 0
(the producer) sends, rank 1 (the consumer) receives, in the order both sides post.

The pipe (collective.py) owns everything else: headers over ZMQ, ordering, sizes, timeouts,
reconnects. Two backends: CuPy NCCL for CUDA tensors (the fast path between GPUs) and
torch.distributed's Gloo for CPU tensors, so the pipe's protocol runs and is tested on any
machine. Backend libraries are imported lazily: this module imports without CuPy or CUDA.
"""
from __future__ import annotations

import datetime
import os
import threading
import time
from abc import ABC, abstractmethod
from typing import Any

import torch

from connectors.pipes.base import PipeError, PipeTimeout

NCCL_NEEDS = "nccl pipe needs cupy-cuda12x and a CUDA GPU; install pd-cluster[nccl]"


class Communicator(ABC):
    """One peer's channel. ``send``/``recv`` post an operation; ``wait`` blocks until the
    operations posted so far completed, at most ``timeout`` seconds, else aborts the channel
    (its state is unknown after a timeout: it is re-created by a new handshake) and raises."""

    @abstractmethod
    def send(self, t: torch.Tensor, ready: Any) -> None:
        """Post a send of ``t`` once ``ready`` (the producer's marker) has passed."""

    @abstractmethod
    def recv(self, out: torch.Tensor) -> None:
        """Post a receive into ``out``."""

    @abstractmethod
    def wait(self, timeout: float, what: str) -> None:
        """Raises PipeTimeout (after aborting) or PipeError."""

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Release the channel; ``abort`` when it may be mid-operation or broken."""


class CommBackend(ABC):
    name = ""
    device_type = "cpu"  # where the tensors it moves live

    @abstractmethod
    def handles(self, t: torch.Tensor) -> bool:
        """Whether tensors like ``t`` travel through this backend (others go over ZMQ)."""

    @abstractmethod
    def new_group(self, host: str) -> tuple[Any, Any]:
        """Rank 0: (a msgpack-able group id for the hello, a handle kept until joined)."""

    @abstractmethod
    def join(self, group_id: Any, rank: int, host: str, handle: Any, timeout: float
             ) -> Communicator:
        """Create this rank's communicator (blocks until both ranks joined, at most timeout)."""

    def ready_marker(self, t: torch.Tensor) -> Any:
        """Something the send waits for: the producer's queued work on ``t``."""
        return None

    def on_sender_thread(self) -> None:
        """Set-up the pipe's sending thread needs (the CUDA device)."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)


# ------------------------------------------------------------------------------------ gloo
class GlooCommunicator(Communicator):
    def __init__(self, group: Any, rank: int, store: Any):
        self.group, self.peer = group, 1 - rank
        self.store = store  # rank 0 serves the rendezvous: it must live as long as the group
        self._work: list[Any] = []

    def send(self, t: torch.Tensor, ready: Any) -> None:
        self._work.append(self.group.send([_as_bytes(t)], self.peer, 0))

    def recv(self, out: torch.Tensor) -> None:
        self._work.append(self.group.recv([_as_bytes(out)], self.peer, 0))

    def wait(self, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        try:
            while self._work:
                left = max(deadline - time.monotonic(), 0.001)
                self._work[0].wait(datetime.timedelta(seconds=left))
                self._work.pop(0)
        except RuntimeError as e:
            self._work.clear()
            self.close(abort=True)
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise PipeTimeout(f"gloo {what} timed out after {timeout}s") from None
            raise PipeError(f"gloo {what} failed: {str(e).splitlines()[0][:200]}") from None

    def close(self, abort: bool = False) -> None:
        group, self.group = self.group, None
        if group is not None and abort:
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - already broken; nothing more to release
                pass


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor: Gloo lacks some dtypes (bf16); send/recv is a copy."""
    return t.reshape(-1).view(torch.uint8)


class GlooBackend(CommBackend):
    """torch.distributed's Gloo over TCP: rank 0 serves a TCPStore for the rendezvous."""
    name = "gloo"

    def handles(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def new_group(self, host: str) -> tuple[Any, Any]:
        from torch.distributed import TCPStore
        store = TCPStore(host, 0, 2, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))
        # A fresh prefix per group: a re-created channel never meets the old one's keys.
        return {"host": host, "port": store.port, "prefix": os.urandom(8).hex()}, store

    def join(self, group_id: Any, rank: int, host: str, handle: Any, timeout: float
             ) -> Communicator:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore
        if not (isinstance(group_id, dict) and {"host", "port", "prefix"} <= set(group_id)):
            raise PipeError(f"malformed gloo group id {group_id!r}")
        span = datetime.timedelta(seconds=max(timeout, 0.1))
        store = handle if handle is not None else TCPStore(
            group_id["host"], int(group_id["port"]), 2, is_master=False, timeout=span)
        opts = ProcessGroupGloo._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = span
        try:
            group = ProcessGroupGloo(PrefixStore(f"pd/{group_id['prefix']}", store), rank, 2,
                                     opts)
        except RuntimeError as e:
            raise PipeError(f"gloo group init failed: {str(e).splitlines()[0][:200]}") from None
        return GlooCommunicator(group, rank, store)


# ------------------------------------------------------------------------------------ nccl
def load_nccl() -> Any:
    """The cupy.cuda.nccl module, or a RuntimeError that says what is missing."""
    try:
        from cupy.cuda import nccl
    except Exception as e:  # ImportError, or a CUDA library that fails to load
        raise RuntimeError(f"{NCCL_NEEDS} (cannot import cupy.cuda.nccl: {e})") from e
    if not torch.cuda.is_available():
        raise RuntimeError(f"{NCCL_NEEDS} (torch sees no CUDA GPU)")
    return nccl


def _nccl_type(nccl: Any, t: torch.Tensor) -> tuple[int, int]:
    """(NCCL datatype, element count); dtypes NCCL lacks go as raw bytes (send/recv is a copy)."""
    names = {torch.float32: "NCCL_FLOAT32", torch.float16: "NCCL_FLOAT16",
             torch.bfloat16: "NCCL_BFLOAT16", torch.float64: "NCCL_FLOAT64",
             torch.int32: "NCCL_INT32", torch.int64: "NCCL_INT64", torch.int8: "NCCL_INT8"}
    const = getattr(nccl, names.get(t.dtype, ""), None)
    if const is not None:
        return const, t.numel()
    return getattr(nccl, "NCCL_UINT8", None) or nccl.NCCL_CHAR, t.numel() * t.element_size()


class NcclCommunicator(Communicator):
    """Transfers run on the channel's own CUDA stream, which first waits for the producer's
    event (or the consumer's current stream): vLLM #20263, garbage from unsynchronised streams.
    Completion is an event polled against the deadline, never an unbounded synchronize."""

    def __init__(self, nccl: Any, comm: Any, rank: int, device: torch.device):
        self.nccl, self.comm, self.peer, self.device = nccl, comm, 1 - rank, device
        self.stream = torch.cuda.Stream(device)
        self.lock = threading.Lock()

    def send(self, t: torch.Tensor, ready: Any) -> None:
        self.stream.wait_event(ready)
        dtype, count = _nccl_type(self.nccl, t)
        with self.lock:
            self.comm.send(t.data_ptr(), count, dtype, self.peer, self.stream.cuda_stream)

    def recv(self, out: torch.Tensor) -> None:
        # `out` may reuse memory the caller's stream still works on: wait for it first.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        dtype, count = _nccl_type(self.nccl, out)
        with self.lock:
            self.comm.recv(out.data_ptr(), count, dtype, self.peer, self.stream.cuda_stream)

    def wait(self, timeout: float, what: str) -> None:
        done = torch.cuda.Event()
        done.record(self.stream)
        deadline = time.monotonic() + timeout
        while not done.query():
            if time.monotonic() > deadline:
                self.close(abort=True)
                raise PipeTimeout(f"nccl {what} timed out after {timeout}s")
            time.sleep(0.0002)

    def close(self, abort: bool = False) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            (comm.abort if abort else comm.destroy)()


class NcclBackend(CommBackend):
    name = "nccl"
    device_type = "cuda"

    def __init__(self, device: torch.device):
        self.nccl, self.device = load_nccl(), device

    def handles(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def new_group(self, host: str) -> tuple[Any, Any]:
        return list(self.nccl.get_unique_id()), None

    def join(self, group_id: Any, rank: int, host: str, handle: Any, timeout: float
             ) -> Communicator:
        if not (isinstance(group_id, list) and group_id and all(type(b) is int for b in group_id)):
            raise PipeError("peer is not an nccl pipe (its hello has no NCCL unique id)")
        with torch.cuda.device(self.device):
            comm = self.nccl.NcclCommunicator(2, tuple(group_id), rank)
        return NcclCommunicator(self.nccl, comm, rank, self.device)

    def on_sender_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def ready_marker(self, t: torch.Tensor) -> Any:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(t.device))
        return ready

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)
