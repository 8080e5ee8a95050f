"""GPU KV over ZMQ without a GPU: the send buffer pool's keys and reuse, and the staging
thread's ordering, waits and outcomes, with the CUDA event replaced by a stand-in."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from connectors.block_io import BufferPool
from connectors.host_staging import HostStaging
from connectors.pipes.base import PipeError, PipeTimeout


def test_buffers_are_reused_under_their_own_key_and_bounded() -> None:
    pool = BufferPool(max_bytes=4096)
    a = pool.acquire((2, 8), torch.float32, torch.device("cpu"))
    done: Future = Future()
    pool.release_when_done(a, done)
    assert pool.idle_bytes == 0  # held while the pipe uses it
    done.set_result(None)
    assert pool.idle_bytes == a.nbytes
    assert pool.acquire((2, 8), torch.float32, torch.device("cpu")) is a  # reused
    other = pool.acquire((2, 8), torch.float16, torch.device("cpu"))
    assert other is not a
    pool.release(torch.empty(2048))  # 8 KiB: over the bound, dropped rather than kept
    assert pool.idle_bytes == 0
    # A released buffer is found again only under the key it was made for (the old pool
    # stored host copies under the device buffer's key, so they were never reused).
    pool.release(a)
    assert pool.acquire((2, 8), torch.float32, torch.device("cpu"), pin=False) is a


class _Event:
    """Stands in for the copy's torch.cuda.Event."""
    def __init__(self, delay: float):
        self.at = time.monotonic() + delay

    def query(self) -> bool:
        return time.monotonic() >= self.at


def test_sends_keep_their_order_and_wait_for_the_copy() -> None:
    sent: list[tuple[str, float]] = []
    lock = threading.Lock()

    def send(peer: str, header: dict, payload) -> Future:
        with lock:
            sent.append((header["n"], time.monotonic()))
        f: Future = Future()
        f.set_result(None)
        return f

    pool = BufferPool(1 << 20)
    staging = HostStaging(send, pool, None, copy_timeout=5.0)
    gather_buf = torch.empty(16)
    start = time.monotonic()
    futs = [staging.send("d", {"n": "layer0"}, torch.empty(4), _Event(0.2), gather_buf),
            staging.send("d", {"n": "layer1"}, torch.empty(4), _Event(0.0)),
            staging.send("d", {"n": "fin"}, None)]  # a FIN never overtakes its layers
    for f in futs:
        assert f.result(timeout=5) is None
    assert [n for n, _ in sent] == ["layer0", "layer1", "fin"]
    assert sent[0][1] - start >= 0.19  # the send waited for its copy
    assert pool.acquire((16,), torch.float32, torch.device("cpu")) is gather_buf  # reusable
    staging.close()


def test_failures_reach_the_caller_and_copies_are_bounded() -> None:
    def failing(peer: str, header: dict, payload) -> Future:
        if header["n"] == "raise":
            raise PipeError("peer gone")
        f: Future = Future()
        f.set_exception(PipeError("send failed later"))
        return f

    staging = HostStaging(failing, BufferPool(1 << 20), None, copy_timeout=0.2)
    with pytest.raises(PipeError, match="peer gone"):
        staging.send("d", {"n": "raise"}, None).result(timeout=5)
    with pytest.raises(PipeError, match="send failed later"):
        staging.send("d", {"n": "x"}, None).result(timeout=5)
    with pytest.raises(PipeTimeout, match="device-to-host copy"):
        staging.send("d", {"n": "x"}, None, _Event(60)).result(timeout=5)
    staging.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_stage_copies_a_device_buffer_to_pinned_memory_on_a_side_stream() -> None:
    got: list[torch.Tensor] = []

    def send(peer: str, header: dict, payload) -> Future:
        got.append(payload.clone())  # what the pipe would read once the event completed
        f: Future = Future()
        f.set_result(None)
        return f

    pool = BufferPool(1 << 24)
    staging = HostStaging(send, pool, torch.device("cuda"), copy_timeout=10.0)
    for i in range(4):  # reuse of both buffers must never send a stale or torn copy
        device_buf = pool.acquire((2, 64, 16, 2, 32), torch.bfloat16, torch.device("cuda"))
        device_buf.copy_(torch.randn(device_buf.shape, device="cuda").to(torch.bfloat16) + i)
        want = device_buf.cpu()
        host, copied = staging.stage(device_buf)
        assert host.is_pinned() and host.device.type == "cpu"
        staging.send("d", {"n": i}, host, copied, device_buf).result(timeout=10)
        pool.release(host)
        assert torch.equal(got[-1], want)
    staging.close()
