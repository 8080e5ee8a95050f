"""The nixl pipe's bounds, without NIXL (they run everywhere): block ids become addresses only
inside the registered cache, a producer's writes stay inside the consumer's grant and stop
at its cutoff, both ends cover the same header bytes, a chunk ending mid-block leaves that
block to the next write, and a write's code catches one flipped bit."""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from connectors.granted_writes import Grants, granted_targets, written_head
from connectors.metadata import KVWrittenHeader, decode_header, encode_header
from connectors.pd_scheduler import PDConnectorScheduler
from connectors.pipes.nixl_layout import CacheLayout, block_chunks
from connectors.pipes.written_check import written_code
from connectors.transfer_params import SendKV


def _caches(parts: int = 2, blocks: int = 6) -> list[torch.Tensor]:
    return [torch.randn(parts, blocks, 4, 2, 8) for _ in range(3)]


def test_descriptors_cover_whole_blocks_inside_the_cache_only() -> None:
    caches = _caches()
    layout = CacheLayout.decode(CacheLayout.of(caches).encode())  # as a peer receives it
    descs = layout.descs(1, [4, 0])
    block = caches[1][0, 0].nbytes
    base = caches[1].data_ptr()
    assert descs[:, 0].tolist() == [base + 4 * block, base, base + 10 * block, base + 6 * block]
    assert set(descs[:, 1].tolist()) == {block}
    for layer, ids in ((1, [6]), (1, [-1]), (3, [0]), (1, [])):
        with pytest.raises(ValueError):
            layout.descs(layer, ids)
    with pytest.raises(ValueError, match="not a contiguous"):
        CacheLayout.of([caches[0][:, ::2]])
    assert layout.mismatch(CacheLayout.of(_caches(parts=1))) is not None
    with pytest.raises(ValueError, match="malformed"):
        CacheLayout.decode(b"\x00junk")


def test_writes_stay_inside_the_grant_until_its_cutoff(monkeypatch) -> None:
    grant = (2, (40, 41, 17))  # table entries 2, 3, 4 (0 and 1 are the consumer's own)
    assert granted_targets(grant, 3, 2) == (41, 17)
    for first, count in ((1, 1), (4, 2), (2, 0)):
        with pytest.raises(ValueError, match="outside the grant"):
            granted_targets(grant, first, count)
    now = [100.0]
    monkeypatch.setattr("connectors.granted_writes.time.monotonic", lambda: now[0])
    grants = Grants(cutoff=5.0)
    grants.record("d0", "r", *grant)
    assert grants.get("d0", "r") == grant and grants.get("d1", "r") is None
    now[0] = 106.0
    assert grants.get("d0", "r") is None  # past the cutoff: no write starts
    grants.record("d0", "r", *grant)
    grants.drop("r")
    assert grants.get("d0", "r") is None


def test_both_ends_cover_the_same_bytes_and_one_bit_fails_the_code() -> None:
    sent = KVWrittenHeader("r", 1, 2, 3)
    received = decode_header({**encode_header(sent), "tag": b"t", "nonce": b"n"})
    assert written_head(received) == written_head(sent)
    kv = _caches()[0]
    chunks = block_chunks(kv, [3, 4, 1])
    assert [c.nbytes for c in chunks] == [2 * kv[0, 0].nbytes, kv[0, 0].nbytes] * 2
    key, nonce = b"k" * 32, b"n" * 16
    for mode in ("mac", "crc32"):
        tag = written_code(mode, key, nonce, written_head(sent), chunks)
        assert tag == written_code(mode, key, nonce, written_head(received),
                                  block_chunks(kv, [3, 4, 1]))
        kv[1, 1].view(-1).view(torch.uint8)[5] ^= 1
        assert tag != written_code(mode, key, nonce, written_head(sent),
                                  block_chunks(kv, [3, 4, 1]))
        kv[1, 1].view(-1).view(torch.uint8)[5] ^= 1
    assert written_code("mac", key, b"m" * 16, written_head(sent), chunks) != \
        written_code("mac", key, nonce, written_head(sent), chunks)  # a one-time key per write


def test_one_mac_for_every_pipe_that_writes_in_place_is_gmac_under_a_one_time_key() -> None:
    """nixl and shm share written_check.written_code: AES-GMAC (the fastest keyed MAC
    measured here) under HMAC-SHA256(notification key, label, head length, nonce, head),
    however the bytes are split; the nixl pipe used Poly1305 before."""
    import hashlib
    import hmac
    import struct

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from connectors.pipes.nixl_pipe import NixlPipe
    from connectors.pipes.shm_pipe import ShmPipe
    assert NixlPipe.check_written is ShmPipe.check_written
    key, nonce, head, data = b"k" * 32, b"n" * 16, b"head", bytes(range(256)) * 9
    once = hmac.new(key, b"pd-cluster written v2\0" + struct.pack("<Q", len(head)) + nonce
                    + head, hashlib.sha256).digest()
    want = AESGCM(once).encrypt(bytes(12), b"", data)  # no plaintext: the tag alone
    assert written_code("mac", key, nonce, head, [data]) == want
    assert written_code("mac", key, nonce, head, [data[:100], data[100:]]) == want


def test_whole_blocks_leave_a_partial_block_to_the_next_chunk() -> None:
    def plan(sched: PDConnectorScheduler, computed: int, new: int) -> tuple:
        req = SimpleNamespace(request_id="r", kv_transfer_params=SendKV(to="d"),
                              num_computed_tokens=computed, num_prompt_tokens=20,
                              block_ids=[7, 8, 9])
        meta = sched.build_connector_meta(SimpleNamespace(scheduled=[
            SimpleNamespace(request=req, num_new_tokens=new)]))
        return tuple((s.first_block, s.block_ids) for s in meta.sends)
    whole, partial = PDConnectorScheduler(8, whole_blocks=True), PDConnectorScheduler(8)
    assert plan(whole, 0, 12) == ((0, (7,)),)  # block 1 is half computed: it waits
    assert plan(whole, 12, 8) == ((1, (8, 9)),)  # the prompt's end: the last block goes
    assert plan(partial, 0, 12) == ((0, (7, 8)),)
    assert plan(partial, 12, 8) == ((1, (8, 9)),)  # block 1 again


def test_the_consumer_checks_written_blocks_outside_its_lock() -> None:
    """A written layer's MAC (milliseconds a layer for a long prompt) is checked without the
    receiver's lock, so the engine thread's take_finished and register never wait on it; a
    request that ended during its check is not marked, and a failed check still fails the
    request closed."""
    from connectors.kv_receiver import KVReceiver
    from connectors.metadata import FinHeader, RecvSpec
    rx = KVReceiver(1, 4, timeout=5.0, max_staging_bytes=1024)
    rx.kv_caches = [torch.zeros(2, 8, 4, 1, 8)]
    locked: list[bool] = []

    def checker(peer: str, head: bytes, chunks: list, tag: bytes, nonce: bytes) -> str | None:
        locked.append(rx._lock.locked())
        if tag == b"cancel":
            rx.cancel("c")  # the request ends here while its blocks are checked
        return None if tag in (b"good", b"cancel") else "mac mismatch"
    rx.check_written = checker
    for rid in ("r", "s", "c"):
        assert rx.register(RecvSpec(rid, (3, 5), 8)) == []
    assert rx.on_message(KVWrittenHeader("r", 0, 0, 2, tag=b"good"), None, "p") == []
    assert locked == [False]  # (before the cancel below, which would wait on a held lock)
    assert rx.on_message(FinHeader("r", 9, 8), None, "p") == [("p", "r", True)]
    assert rx.on_message(KVWrittenHeader("s", 0, 0, 2, tag=b"bad"), None, "p") == \
        [("p", "s", False)]
    assert rx.on_message(KVWrittenHeader("c", 0, 0, 2, tag=b"cancel"), None, "p") == []
    assert locked == [False, False, False]
    assert rx.take_finished() == {"r": 9, "s": None} and rx.num_failed_closed == 1
    assert rx.bytes_received == 2 * 2 * rx.kv_caches[0][0, 0].nbytes  # "r" only


@pytest.mark.parametrize("end", ["cancel", "timeout"])
def test_a_receive_that_ends_waits_for_its_staged_copy(end: str) -> None:
    """A staged write (nixl staging) is copied into the request's blocks by the receiver
    thread outside the lock; when the request ends meanwhile (cancelled, or given up after
    the timeout), the engine thread is told so only after that copy finished: the scheduler
    frees and reuses the blocks once told, and a late copy would write into another
    request's KV."""
    import threading
    from connectors.kv_receiver import KVReceiver
    from connectors.metadata import RecvSpec
    rx = KVReceiver(1, 4, timeout=0.3 if end == "timeout" else 30.0, max_staging_bytes=1024)
    rx.kv_caches = [torch.zeros(2, 8, 4, 1, 8)]
    rx.check_written = lambda *a: None
    copying, release, order = threading.Event(), threading.Event(), []

    def copy_staged(*args: Any) -> int:
        copying.set()
        release.wait(10)
        order.append("copied")
        return 0
    rx.copy_staged = copy_staged
    rx.register(RecvSpec("r", (3, 5), 8))
    recv = threading.Thread(target=rx.on_message, args=(
        KVWrittenHeader("r", 0, 0, 2, tag=b"t", nonce=b"n", staged_at=0), None, "p"))
    recv.start()
    assert copying.wait(10)

    def ends() -> None:
        if end == "cancel":
            rx.cancel("r")
        else:
            time.sleep(0.4)  # past the deadline
            assert rx.take_finished() == {"r": None}
        order.append("ended")
    engine = threading.Thread(target=ends)
    engine.start()
    engine.join(0.6)
    assert engine.is_alive() and order == []  # waits for the copy
    release.set()
    engine.join(10)
    recv.join(10)
    assert order == ["copied", "ended"]
    assert rx.take_finished() == {} and rx.num_receiving() == 0
