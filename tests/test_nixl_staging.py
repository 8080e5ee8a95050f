"""The nixl pipe's staging for fragmented grants (connectors/pipes/nixl_staging.py): a write
into shuffled blocks goes contiguously into the consumer's staging range, and the consumer
copies it into the granted blocks while checking its MAC. Byte-exact through staging, mixed
with direct writes, falling back to direct writes when the slab is too small or full; a
corrupted staged byte or an offset outside the request's range fails the request closed; the
range comes back on completion, failure, cancel and timeout. The allocator and the copy+check
run without NIXL; the pairs need it (skipped, with the reason, where it is missing)."""
from __future__ import annotations

import random
import time
from typing import Any, Callable

import msgpack
import pytest
import torch

from connectors.config import KVTransferConfig
from connectors.metadata import FinishSpec, KVConnectorMetadata, RecvSpec, SendSpec
from connectors.pipes import written_check
from connectors.pipes.base import PipeError
from connectors.pipes.nixl_layout import block_chunks
from connectors.pipes.nixl_staging import RangeAllocator, copy_and_check, staging_bytes
from connectors.pipes.written_check import written_code

INFO = {"model_id": "t", "dtype": "torch.float32", "block_size": 4, "num_layers": 2,
        "num_kv_heads": 2, "head_dim": 8}
SRC_BLOCKS, DST_BLOCKS = 48, 96
BLOCK = 4 * 2 * 8 * 4  # bytes of one part of a block


def _nixl_missing() -> str | None:
    from connectors.pipes.nixl_pipe import load_nixl
    try:
        load_nixl()
    except PipeError as e:
        return str(e)
    return None


needs_nixl = pytest.mark.skipif(_nixl_missing() is not None, reason=str(_nixl_missing()))


# ---- without NIXL ----------------------------------------------------------------------------
def test_ranges_first_fit_merge_and_refuse() -> None:
    ranges = RangeAllocator(4 * 4096)
    assert ranges.grant("a", 1) == (0, 4096)  # aligned up
    assert ranges.grant("a", 1) is None  # one range per request
    assert ranges.grant("b", 8192) == (4096, 8192)
    assert ranges.grant("c", 8192) is None  # 4096 left
    assert ranges.grant("d", 0) is None
    ranges.release("a")
    ranges.release("a")  # idempotent
    assert ranges.grant("c", 4096) == (0, 4096)  # first fit
    ranges.release("b"), ranges.release("c")
    assert ranges.in_use == 0
    assert ranges.grant("e", 4 * 4096) == (0, 4 * 4096)  # the free pieces merged


def test_the_staging_knob() -> None:
    assert staging_bytes({}, "DRAM") == 512 << 20
    assert staging_bytes({}, "VRAM") == 0  # unverified on CUDA caches: off unless asked
    assert staging_bytes({"nixl_staging_mb": 0}, "DRAM") == 0
    assert staging_bytes({"nixl_staging_mb": 1.5}, "DRAM") == 3 << 19
    for bad in (-1, "big", True):
        with pytest.raises(ValueError, match="nixl_staging_mb"):
            staging_bytes({"nixl_staging_mb": bad}, "DRAM")


@pytest.mark.parametrize("fused", [True, False])
def test_copy_and_check_lands_exactly_and_a_flipped_bit_fails(monkeypatch, fused: bool) -> None:
    if not fused:
        monkeypatch.setattr(written_check.ghash_copy, "available", lambda: False)
    elif not written_check.ghash_copy.available(wait=True):
        pytest.skip("no GHASH kernel here")
    src = torch.randn(2, 10, 4, 2, 8)
    ids = [3, 4, 5, 9, 0]
    staged = torch.stack([src[p, ids] for p in range(2)]).reshape(2, 5, -1).view(torch.uint8)
    key, nonce, head = b"k" * 32, b"n" * 16, b"head"
    tag = written_code("mac", key, nonce, head, block_chunks(src, ids))
    dst = torch.zeros(2, 20, 4, 2, 8)
    rows = dst.reshape(2, 20, -1).view(torch.uint8)
    targets = [17, 2, 11, 5, 8]
    assert copy_and_check("mac", key, nonce, head, tag, staged, rows, targets) is None
    assert torch.equal(dst[:, targets], src[:, ids])
    staged[1, 2, 7] ^= 1
    assert copy_and_check("mac", key, nonce, head, tag, staged, rows, targets) == "mac mismatch"


# ---- a producer and a consumer connector over NIXL, in this process --------------------------
def _worker(role: str, **args: Any) -> Any:
    from connectors.pd_connector import PDConnectorWorker
    return PDConnectorWorker(KVTransferConfig.from_dict(dict(role=role, pipe="nixl", **args)),
                             INFO)


class Pair:
    def __init__(self, staging_mb: float = 1.0, timeout: float = 30.0) -> None:
        self.cons = _worker("consumer", kv_transfer_timeout=timeout,
                            extra={"nixl_staging_mb": staging_mb})
        self.prod = _worker("producer")
        self.prod.register_kv_caches([torch.randn(2, SRC_BLOCKS, 4, 2, 8) for _ in range(2)])
        self.cons.register_kv_caches([torch.zeros(2, DST_BLOCKS, 4, 2, 8) for _ in range(2)])
        self.peer = self.cons.endpoint()
        self.prod.connect_peer(self.peer)

    def register(self, rid: str, dst: list[int]) -> None:
        self.cons.bind_connector_metadata(KVConnectorMetadata(
            recvs=[RecvSpec(rid, tuple(dst), len(dst) * 4)]))

    def offer(self, rid: str, src: list[int], first: int = 0) -> None:
        self.prod.bind_connector_metadata(KVConnectorMetadata(
            sends=[SendSpec(rid, self.peer, tuple(src), first)]))
        _until(lambda: self.prod._held_tokens(rid) is not None, "the consumer's HOLD")

    def write(self, rid: str, src: list[int], first: int = 0) -> None:
        self.prod.bind_connector_metadata(KVConnectorMetadata(
            sends=[SendSpec(rid, self.peer, tuple(src), first)]))
        for layer, cache in enumerate(self.prod.kv_caches):
            self.prod.save_kv_layer(layer, cache, None)
        self.prod.wait_for_save()

    def finish(self, rid: str, n_tokens: int) -> int | None:
        """The FIN, then the consumer's verdict (first token, None: recomputed)."""
        self.prod.bind_connector_metadata(KVConnectorMetadata(
            finishes=[FinishSpec(rid, self.peer, 7, n_tokens)]))
        return self.verdict(rid)

    def verdict(self, rid: str) -> int | None:
        done: dict = {}

        def ended() -> bool:
            self.prod.get_finished()
            done.update(self.cons.get_finished()[1])
            return rid in done
        _until(ended, f"the end of {rid}'s receive")
        return done[rid]

    def transfer(self, rid: str, src: list[int], dst: list[int]) -> int | None:
        self.register(rid, dst)
        self.offer(rid, src)
        self.write(rid, src)
        return self.finish(rid, len(src) * 4)

    def exact(self, src: list[int], dst: list[int]) -> bool:
        return all(torch.equal(c[:, dst], p[:, src])
                   for c, p in zip(self.cons.kv_caches, self.prod.kv_caches))

    def in_use(self) -> int:
        return self.cons.pipe.stats()["nixl_staging_in_use"]

    def close(self) -> None:
        self.prod.close(), self.cons.close()


def _until(pred: Callable[[], Any], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.002)


@pytest.fixture
def pair(request) -> Any:
    made: list[Pair] = []

    def make(**args: Any) -> Pair:
        made.append(Pair(**args))
        return made[-1]
    yield make
    for p in made:
        assert p.in_use() == 0 and p.cons.holds()["kv_staging_bytes"] == 0  # no range leaked
        p.close()


def _shuffled(n: int, seed: int, avoid: tuple[int, ...] = ()) -> list[int]:
    free = [b for b in range(DST_BLOCKS) if b not in avoid]
    return random.Random(seed).sample(free, n)


@needs_nixl
def test_a_shuffled_grant_lands_exactly_through_staging(pair) -> None:
    p = pair()
    src, dst = list(range(32)), _shuffled(32, 1)
    assert p.transfer("s", src, dst) == 7
    assert p.exact(src, dst)
    stats = p.prod.pipe.stats()
    assert stats["nixl_staged_writes"] == stats["nixl_writes"] == 2  # each layer staged
    assert stats["nixl_descriptors"] == 4  # our K run and V run per layer, not 64
    assert p.cons.receiver.bytes_received == 2 * 2 * 32 * BLOCK


@needs_nixl
def test_staged_and_direct_writes_mix_in_one_request(pair) -> None:
    """Step one's blocks go into consecutive blocks (direct: staging saves nothing), step
    two's into shuffled ones (staged); then a request whose range is half what it needs:
    its first layer stages, the second goes directly."""
    p = pair()
    dst = list(range(60, 68)) + _shuffled(24, 2, avoid=tuple(range(60, 68)))
    src = list(range(32))
    p.register("m", dst)
    p.offer("m", src[:8])
    p.write("m", src[:8])
    p.write("m", src[8:], first=8)
    assert p.finish("m", 32 * 4) == 7
    assert p.exact(src, dst)
    stats = p.prod.pipe.stats()
    assert (stats["nixl_writes"], stats["nixl_staged_writes"]) == (4, 2)

    ranges = p.prod.staging_ranges
    real = ranges.record
    ranges.record = lambda ep, rid, st: real(ep, rid, (st[0], st[1] // 2) if st else st)
    dst = _shuffled(32, 3)
    assert p.transfer("h", src, dst) == 7
    assert p.exact(src, dst)
    stats = p.prod.pipe.stats()
    assert (stats["nixl_writes"], stats["nixl_staged_writes"]) == (6, 3)


@needs_nixl
@pytest.mark.parametrize("full", [False, True])
def test_no_room_in_the_slab_falls_back_to_direct_writes(pair, full: bool) -> None:
    """A request larger than the slab, or a slab another request fills: direct writes."""
    p = pair(staging_mb=0.0625 if full else 0.01)  # 64 KiB, or 8 KiB (the request: 32 KiB)
    if full:
        assert p.cons.pipe.grant_staging("other", 36 << 10) is not None
    src, dst = list(range(32)), _shuffled(32, 4)
    assert p.transfer("d", src, dst) == 7
    assert p.exact(src, dst)
    assert p.prod.pipe.stats()["nixl_staged_writes"] == 0
    p.cons.pipe.release_staging("other")


@needs_nixl
def test_a_corrupted_staged_byte_fails_the_request_closed(pair) -> None:
    p = pair()
    worker, flipped = p.cons.pipe._worker, []
    real = worker._on_notif

    def deliver(agent: str, msg: bytes) -> None:
        at = msgpack.unpackb(msgpack.unpackb(msg, raw=False)[0], raw=False).get("staged_at", -1)
        if at >= 0 and not flipped:  # the first staged write: a bit of its bytes flips
            p.cons.pipe._slab.buf[at + 5] ^= 1
            flipped.append(at)
        real(agent, msg)
    worker._on_notif = deliver
    assert p.transfer("c", list(range(32)), _shuffled(32, 5)) is None  # recomputed
    assert flipped
    assert p.cons.stats()["kv_digest_failures"] == 1


@needs_nixl
def test_an_offset_outside_the_requests_range_is_refused(pair) -> None:
    """A producer that writes past its request's range (here: the range after it, inside the
    slab, so NIXL takes it): the consumer refuses the write, the request fails closed."""
    p = pair()
    ranges = p.prod.staging_ranges
    real = ranges.record
    ranges.record = lambda ep, rid, st: real(ep, rid, (st[0] + st[1], st[1]) if st else st)
    assert p.transfer("o", list(range(32)), _shuffled(32, 6)) is None
    assert p.prod.pipe.stats()["nixl_staged_writes"] == 2  # it went, into the wrong place
    assert p.cons.stats()["kv_digest_failures"] == 1


@needs_nixl
def test_the_range_comes_back_on_cancel_and_on_timeout(pair) -> None:
    p = pair(timeout=1.0)
    p.register("x", _shuffled(32, 7))
    p.offer("x", list(range(32)))
    assert p.in_use() >= 2 * 2 * 32 * BLOCK  # granted with the HOLD
    p.cons.bind_connector_metadata(KVConnectorMetadata(cancels=["x"]))
    assert p.in_use() == 0
    p.register("c", list(range(40, 72)))  # contiguous: staging could never pay, none granted
    p.offer("c", list(range(32)))
    assert p.in_use() == 0
    p.cons.bind_connector_metadata(KVConnectorMetadata(cancels=["c"]))
    p.register("t", _shuffled(32, 8))
    p.offer("t", list(range(32)))
    assert p.in_use() > 0
    assert p.verdict("t") is None  # nothing written: timed out
    assert p.in_use() == 0


@needs_nixl
def test_engines_through_staging_are_exact(tiny_model, monkeypatch) -> None:
    """A real P/D pair (chunked prefill, two prompts) with every write staged: the outputs
    equal the colocated engine's, no block and no range left."""
    from connectors.pipes.nixl_pipe import NixlPipe
    from tests.conftest import random_prompt
    from tests.pd_helpers import colocated_tokens
    from tests.test_nixl_pipe import GREEDY, _pair, _run
    monkeypatch.setattr(NixlPipe, "stage_min_saved", 0)  # stage even where it saves nothing
    model = tiny_model()
    prompts = [random_prompt(n, seed=n) for n in (45, 70)]
    want = colocated_tokens(model, prompts, [GREEDY] * 2, block_size=8)
    with _pair(model) as (p, d):
        assert _run(p, d, prompts, "st") == want
        assert d.stats()["kv_fallbacks"] == 0
        assert p.runner.connector.pipe.stats()["nixl_staged_writes"] > 0
        assert d.runner.connector.pipe.stats()["nixl_staging_in_use"] == 0
