"""kv_transfer.pipe: cuda_ipc (written without a GPU; unverified until scripts/gpu_check.sh
passes its "cuda ipc pipe" row). On CPU: the keyed device hash (a flipped bit in any block is
caught, keys differ per write), the CUDA handle's msgpack round trip and type checks, the
granted-writes seam that hands a device checker the blocks where they are, the config (the
pipe refuses a host-memory cache naming kv_transfer.pipe; auto never picks it). Marked cuda:
a P/D pair in two processes (CUDA IPC opens no handle in its own process) with CUDA caches:
exact KV, a corrupted block fails closed, a write past the grant is refused, no leaks."""
from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch

from connectors.config import KVTransferConfig
from connectors.granted_writes import check_written
from connectors.metadata import KVWrittenHeader
from connectors.pipes.base import HandshakeError, PipeConfig, create_pipe
from connectors.pipes.cuda_ipc_handles import _FIELDS, check_handle, local_index
from connectors.pipes.cuda_ipc_pipe import CudaIpcPipe
from connectors.pipes.device_hash import block_rows, device_tag, one_time_seed
from tests.cuda_ipc_pair import run_pair  # the GPU test's two processes


def _layer(blocks: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, blocks, 8, 2, 16, generator=g).to(torch.bfloat16)  # [parts, blocks,..]


# ---- the keyed device hash -------------------------------------------------------------------
def test_a_flipped_bit_in_any_block_changes_the_tag() -> None:
    layer, ids = _layer(), [4, 1, 2]
    seed = one_time_seed(b"k" * 32, b"n" * 16, b"head")
    tag = device_tag(block_rows(layer, ids), seed)
    assert len(tag) == 8
    raw = layer.view(torch.uint8).reshape(2, 6, -1)
    for part in range(2):
        for block in ids:
            for byte, bit in ((0, 0), (257, 7), (raw.shape[2] - 1, 3)):
                bad = raw.clone()
                bad[part, block, byte] ^= 1 << bit
                assert device_tag(block_rows(bad, ids), seed) != tag, (part, block, byte)
    # a block outside the write does not count; the same bytes in other chunks do not matter
    other = raw.clone()
    other[0, 0, 0] ^= 1
    assert device_tag(block_rows(other, ids), seed) == tag
    rows = block_rows(layer, ids)
    assert device_tag([rows[0][:1], rows[0][1:], rows[1]], seed) == tag


def test_keys_and_lengths_change_the_tag() -> None:
    rows = block_rows(_layer(), [0, 1])
    tags = {device_tag(rows, one_time_seed(b"k" * 32, nonce, head))
            for nonce in (b"a" * 16, b"b" * 16) for head in (b"h1", b"h2")}
    assert len(tags) == 4
    seed = one_time_seed(b"k" * 32, b"a" * 16, b"h1")
    zeros = torch.zeros(10, dtype=torch.uint8)
    assert device_tag([zeros], seed) != device_tag([zeros[:8]], seed)  # padding is not data
    assert one_time_seed(b"k" * 32, b"a" * 16, b"h1") != one_time_seed(b"j" * 32, b"a" * 16,
                                                                       b"h1")


def test_producer_and_consumer_tags_agree_over_a_scattered_write() -> None:
    """The producer tags its source rows, the consumer its own (other) block ids: equal
    after the copy, different once a copied byte changes (granted_writes' device seam)."""
    src, dst = _layer(seed=1), torch.zeros(2, 9, 8, 2, 16, dtype=torch.bfloat16)
    src_ids, dst_ids = [5, 0, 3], [7, 2, 8]
    for part, rows in enumerate(block_rows(src, src_ids)):
        dst.view(torch.uint8).reshape(2, 9, -1)[part].index_copy_(
            0, torch.tensor(dst_ids), rows)
    header = KVWrittenHeader(request_id="r", layer=0, first_block=1, num_blocks=3)
    seen: list[Any] = []

    def checker(peer: str, head: bytes, chunks: list, tag: bytes, nonce: bytes) -> Any:
        seen.append(chunks)
        want = device_tag(block_rows(src, src_ids), one_time_seed(b"k", nonce, head))
        return None if device_tag(chunks, one_time_seed(b"k", nonce, head)) == want else "bad"
    checker.on_device = True  # type: ignore[attr-defined]
    ids = [0] + dst_ids  # block 0 held from the prefix cache, never granted
    assert check_written(header, [dst], ids, 1, "p", checker) == 3 * 2 * dst[0, 0].nbytes
    assert all(isinstance(c, torch.Tensor) for c in seen[0])
    dst.view(torch.uint8).reshape(2, 9, -1)[1, 8, 100] ^= 4
    with pytest.raises(ValueError, match="fail their check"):
        check_written(header, [dst], ids, 1, "p", checker)


# ---- the handle's round trip ----------------------------------------------------------------
def _fake_handle() -> dict[str, Any]:
    values = (0, b"\x01" * 64, 1 << 20, 512, b"\x02" * 64, 8, b"\x03" * 64, True)
    return {**{name: v for (name, _), v in zip(_FIELDS, values)},
            "tensor_offset": 4096, "nbytes": 8192, "uuid": "GPU-1234"}


def test_a_handle_round_trips_through_msgpack() -> None:
    h = _fake_handle()
    back = msgpack.unpackb(msgpack.packb(h, use_bin_type=True), raw=False)
    assert check_handle(back) == h


@pytest.mark.parametrize("field,value,why", [
    ("handle", "text", "'handle'"), ("size", 1.5, "'size'"), ("event_sync", 1, "'event_sync'"),
    ("uuid", 3, "'uuid'"), ("offset", -1, "negative"), ("nbytes", 1 << 21, "past its storage")])
def test_a_bad_handle_is_refused(field: str, value: Any, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_handle({**_fake_handle(), field: value})


def test_the_consumers_gpu_is_found_by_uuid() -> None:
    """Under Ray each engine numbers the GPUs it sees: the handle's UUID finds ours."""
    assert local_index("GPU-b", ["GPU-a", "GPU-b"]) == 1
    with pytest.raises(ValueError, match="not visible"):
        local_index("GPU-c", ["GPU-a"])


# ---- config -----------------------------------------------------------------------------------
def test_a_host_cache_is_refused_naming_the_key() -> None:
    assert KVTransferConfig.model_validate({"pipe": "cuda_ipc"}).pipe == "cuda_ipc"
    pipe = create_pipe("cuda_ipc", PipeConfig())
    try:
        assert isinstance(pipe, CudaIpcPipe)
        with pytest.raises(ValueError, match="kv_transfer.pipe: cuda_ipc needs .* CUDA"):
            pipe.register_kv_caches([_layer()])
    finally:
        pipe.close()


def test_auto_never_picks_cuda_ipc() -> None:
    """auto links over shm or zmq only: it is not the cuda_ipc pipe and never asks for it."""
    from connectors.pipes.auto_pipe import AutoPipe
    from connectors.pipes.cuda_ipc_pipe import CUDA_KEY
    assert not issubclass(AutoPipe, CudaIpcPipe)
    auto = create_pipe("auto", PipeConfig())
    try:
        assert auto.link("tcp://x:1")[0] in ("shm", "zmq")
        assert KVTransferConfig.model_validate({}).pipe == "auto"
    finally:
        auto.close()
    import inspect

    import connectors.pipes.auto_pipe as auto_mod
    assert CUDA_KEY not in inspect.getsource(auto_mod)


# ---- the handshake on CPU, CUDA faked ----------------------------------------------------------
@pytest.fixture
def faked_cuda(monkeypatch) -> dict[str, Any]:
    """Host tensors pass for CUDA ones: the handles are fake dicts that travel the real ZMQ
    handshake; opening one yields a host view of the consumer's own layer."""
    import connectors.pipes.cuda_ipc_pipe as mod
    seen: dict[str, Any] = {"opened": []}
    monkeypatch.setattr(mod, "require_cuda", lambda caches: None)
    monkeypatch.setattr(mod, "export_layers", lambda caches: [
        {**_fake_handle(), "nbytes": c.numel() * c.element_size(),
         "size": c.numel() * c.element_size() + 4096} for c in caches])

    def open_layer(h: dict, parts: int, blocks: int, block_bytes: int) -> torch.Tensor:
        seen["opened"].append(check_handle(h))
        return torch.zeros(parts, blocks, block_bytes, dtype=torch.uint8)
    monkeypatch.setattr(mod, "open_layer", open_layer)
    return seen


def _pipes() -> tuple[CudaIpcPipe, CudaIpcPipe]:
    cfg = PipeConfig(linger=0.2, send_timeout=5.0, handshake_timeout=5.0)
    return create_pipe("cuda_ipc", cfg), create_pipe("cuda_ipc", cfg)  # type: ignore[return-value]


def test_handles_cross_the_handshake_and_keys_agree(faked_cuda) -> None:
    """The consumer's handles reach the producer over the real handshake (msgpack), one per
    layer, checked; a tag the producer computes under its notification key checks out at the
    consumer under its own (the same key, derived on each side), and a changed byte fails."""
    cons, prod = _pipes()
    try:
        cons.register_kv_caches([_layer(), _layer(seed=2)])
        prod.register_kv_caches([_layer(), _layer(seed=3)])
        addr = cons.listen()
        prod.connect(addr, {"model": "m"})
        assert len(faked_cuda["opened"]) == 2
        assert faked_cuda["opened"][0]["uuid"] == "GPU-1234"
        prod.send_tensor(addr, {"hello": 1}, None).result(timeout=10)
        msg = cons.recv_tensor(timeout=10)
        assert msg is not None
        rows, head, nonce = block_rows(_layer(seed=5), [2, 3]), b"head", b"n" * 16
        tag = device_tag(rows, one_time_seed(prod._remotes[addr].key, nonce, head))
        assert getattr(cons.check_written, "on_device", False)  # granted_writes: device rows
        assert cons.check_written(msg[0], head, rows, tag, nonce) is None
        rows[1][0, 7] ^= 1
        assert cons.check_written(msg[0], head, rows, tag, nonce) == "device hash mismatch"
    finally:
        prod.close(), cons.close()


def test_a_producer_on_another_host_gets_no_handles(faked_cuda) -> None:
    cons, prod = _pipes()
    try:
        cons.register_kv_caches([_layer()])
        prod.register_kv_caches([_layer()])
        prod._host = "elsewhere"
        with pytest.raises(HandshakeError, match="another host"):
            prod.connect(cons.listen(), {"model": "m"})
        assert faked_cuda["opened"] == [] and not prod._remotes
    finally:
        prod.close(), cons.close()


# ---- on a GPU: a P/D pair in two processes ----------------------------------------------------
@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_pair_over_cuda_ipc(tiny_model) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs 1 CUDA GPU")
    results = run_pair(tiny_model())
    for name, res in results.items():
        assert res["tokens"] == res["want"], name
    assert results["exact"]["fallbacks"] == 0
    assert results["exact"]["bytes_written"] == results["exact"]["bytes_received"] > 0
    assert results["flip"]["fallbacks"] == 1 and results["flip"]["digest_failures"] == 1
    assert results["stray"]["fallbacks"] == 1
    assert results["stray"]["past_refused"]
    assert all(res["leaks"] == "none" for res in results.values())
