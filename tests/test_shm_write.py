"""The shm pipe's copy and code without engines (fast): blocks land where the ids say, the code
of the copied pieces equals the consumer's over its blocks however the bytes are split, one
flipped bit or another key fails it; a producer maps only a private file of the announced size
in its own folder, and a consumer's file it can lock (its owner gone) is swept."""
from __future__ import annotations

import fcntl
import os
import threading
import time
from concurrent.futures import Future

import msgpack
import pytest
import torch

from connectors.pipes.base import PipeConfig
from connectors.pipes.nixl_layout import CacheLayout, block_chunks
from connectors.pipes.shm_arena import SharedCache, open_peer_cache, shm_folder, sweep_stale
from connectors.pipes import shm_pipe
from connectors.pipes.shm_pipe import _src_runs, copy_and_seal
from connectors.pipes.written_check import Sealer, written_code
from pd_cluster.private_files import UnsafePath

KEY, NONCE, HEAD = b"k" * 32, b"n" * 16, b"head"


def _cache(blocks: int = 9, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, blocks, 4, 2, 8), generator=g)  # [parts, blocks, size, heads, dim]


@pytest.mark.parametrize("mode,chunk", [("mac", 1 << 18), ("crc32", 1 << 18), ("mac", 512)])
def test_copied_blocks_and_their_code_match_the_consumers_view(mode: str, chunk: int,
                                                                 monkeypatch) -> None:
    """chunk 512: pieces of two 256-byte blocks, a source run split across pieces."""
    monkeypatch.setattr(shm_pipe, "_CHUNK", chunk)
    src, dst = _cache(seed=1), _cache(seed=2)
    src_ids, dst_ids = [0, 1, 2, 5, 6], [3, 4, 8, 0, 1]
    sealer = Sealer(mode, KEY, NONCE, HEAD)
    as_bytes = lambda t: t.reshape(2, t.shape[1], -1).view(torch.uint8)  # noqa: E731
    copy_and_seal(as_bytes(src), as_bytes(dst), src_ids, dst_ids, sealer)
    tag = sealer.tag()
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(src[:, s], dst[:, d])
    assert written_code(mode, KEY, NONCE, HEAD, block_chunks(dst, dst_ids)) == tag
    assert written_code(mode, KEY, NONCE, HEAD, block_chunks(src, src_ids)) == tag
    dst[1, 8].view(-1).view(torch.uint8)[5] ^= 1
    assert written_code(mode, KEY, NONCE, HEAD, block_chunks(dst, dst_ids)) != tag
    if mode == "mac":
        assert written_code(mode, b"x" * 32, NONCE, HEAD, block_chunks(src, src_ids)) != tag


def test_runs_join_blocks_adjacent_in_the_source() -> None:
    assert _src_runs([0, 1, 2, 5, 6, 4]) == [(0, 0, 3), (3, 5, 2), (5, 4, 1)]


def test_the_shared_cache_keeps_the_tensors_and_a_producer_maps_it_checked(tmp_path) -> None:
    caches = [_cache(seed=i) for i in range(3)]
    before = [c.clone() for c in caches]
    ident = [id(c) for c in caches]
    shared = SharedCache(str(tmp_path), caches)
    try:
        assert [id(c) for c in caches] == ident and all(map(torch.equal, caches, before))
        assert oct(os.stat(shared.path).st_mode & 0o777) == oct(0o600)
        layers = open_peer_cache(str(tmp_path), shared.name, shared.size, shared.layout)
        layers[2][1, 4].fill_(7)  # the producer's write is the consumer's tensor
        assert bool((caches[2][1, 4].view(-1).view(torch.uint8) == 7).all())
        assert CacheLayout.of(caches).mismatch(shared.layout) is None
        with pytest.raises(ValueError, match="not a cache file name"):
            open_peer_cache(str(tmp_path), "../" + shared.name, shared.size, shared.layout)
        with pytest.raises(ValueError, match="bytes, the consumer said"):
            open_peer_cache(str(tmp_path), shared.name, shared.size + 4096, shared.layout)
        os.chmod(shared.path, 0o604)
        with pytest.raises(UnsafePath, match="expected ours and 0600"):
            open_peer_cache(str(tmp_path), shared.name, shared.size, shared.layout)
        assert sweep_stale(shm_folder(str(tmp_path))) == 0  # we hold its lock
    finally:
        shared.close()
    assert not shared.path.exists()


def test_a_file_whose_owner_is_gone_is_swept(tmp_path) -> None:
    folder = shm_folder(str(tmp_path))
    stale, other = folder / f"kv-1-{'a' * 32}", folder / "unrelated"
    stale.write_bytes(b"x"), other.write_bytes(b"y")
    live = folder / f"kv-2-{'b' * 32}"
    live.write_bytes(b"z")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a live consumer
    try:
        assert sweep_stale(folder) == 1
        assert not stale.exists() and other.exists() and live.exists()
    finally:
        os.close(fd)


def _peer_cache(pipe: shm_pipe.ShmPipe) -> torch.Tensor:
    """A consumer's cache mapped as if after the handshake (peer "peer"), for write tests."""
    dst = _cache(seed=2)
    pipe._remotes["peer"] = shm_pipe._Remote(
        [dst.reshape(2, dst.shape[1], -1).view(torch.uint8)], CacheLayout.of([dst]), KEY)
    return dst


def test_a_queued_copy_waits_for_the_notification_before_it(monkeypatch) -> None:
    """copy_and_seal holds the GIL: with a second write queued, the pipe thread lets the
    first write's notification leave before it copies again (else every notification
    waited for the last copy, and the consumer checked nothing alongside the copies). With
    integrity none (nothing to check) it does not wait."""
    events: list[str] = []
    both_queued = threading.Event()
    real = shm_pipe.copy_and_seal

    def copy(*args) -> None:
        assert both_queued.wait(30)  # the second write is queued before the first copy ends
        events.append("copy")
        real(*args)
    monkeypatch.setattr(shm_pipe, "copy_and_seal", copy)
    monkeypatch.setattr(shm_pipe, "_HANDOFF_WAIT", 30.0)  # the order, not the bound
    pipe = shm_pipe.ShmPipe(PipeConfig(security="none", integrity="crc32"))
    sent = [Future(), Future()]
    notified = [threading.Event(), threading.Event()]

    def notify(peer: str, header: dict) -> Future:
        events.append(f"notify {header['n']}")
        notified[header["n"]].set()
        return sent[header["n"]]
    pipe._notify = notify
    try:
        src, dst = _cache(seed=1), _peer_cache(pipe)
        writes = [pipe.write_blocks("peer", 0, src, [i], [i + 3], msgpack.packb({"n": i}))
                  for i in range(2)]
        both_queued.set()
        assert notified[0].wait(30)
        time.sleep(0.1)  # a pipe thread that did not wait would copy again meanwhile
        events.append("sent 0")
        sent[0].set_result(None)
        assert notified[1].wait(30)
        sent[1].set_result(None)
        for w in writes:
            w.result(timeout=30)
        assert events == ["copy", "notify 0", "sent 0", "copy", "notify 1"]
        assert torch.equal(dst[:, 3:5], src[:, 0:2])
    finally:
        pipe.close()


def test_with_the_ghash_kernel_the_next_copy_does_not_wait(monkeypatch) -> None:
    """The kernel copies without the GIL, so a notification leaves while the next copy runs:
    the pipe thread does not wait for it (1k-token transfers' copies ended 3 ms sooner of 13,
    traced)."""
    from kernels import ghash_copy
    if not ghash_copy.available(wait=True):
        pytest.skip("no GHASH kernel here (PD_CLUSTER_CPU_KERNELS=0 or no carry-less multiply)")
    events: list[str] = []
    monkeypatch.setattr(shm_pipe, "_HANDOFF_WAIT", 30.0)  # would hold the test if it waited
    pipe = shm_pipe.ShmPipe(PipeConfig(security="token", integrity="mac"))
    sent = [Future(), Future()]

    def notify(peer: str, header: dict) -> Future:
        events.append(f"notify {header['n']}")
        return sent[header["n"]]
    pipe._notify = notify
    try:
        src, dst = _cache(seed=1), _peer_cache(pipe)
        pipe._pool.submit(time.sleep, 0.2)  # both writes queue behind this
        writes = [pipe.write_blocks("peer", 0, src, [i], [i + 3], msgpack.packb({"n": i}))
                  for i in range(2)]
        deadline = time.monotonic() + 30
        while len(events) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events == ["notify 0", "notify 1"]  # the second copied, the first unsent
        for f in sent:
            f.set_result(None)
        for w in writes:
            w.result(timeout=30)
        assert torch.equal(dst[:, 3:5], src[:, 0:2])
    finally:
        pipe.close()
