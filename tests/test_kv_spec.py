"""Per-layer KV cache specs (issue 20): shapes and bytes per spec, the cache engine sizing and
allocating mixed specs, block copies and the receiver generic over parts and widths, and the
handshake refusing a producer whose layers cache something else (naming both engines)."""
from __future__ import annotations

import msgpack
import pytest
import torch

from connectors.hello import hello_mismatch, make_hello
from connectors.kv_receiver import KVReceiver
from connectors.metadata import FinHeader, KVLayerHeader, RecvSpec
from connectors.pipes.base import HandshakeError
from kernels.block_copy import gather_kv_blocks, scatter_kv_blocks
from pd_cluster.engine.cache_engine import KVCacheSpec, allocate_kv_caches, determine_num_blocks
from pd_cluster.engine.kv_spec import (FullAttentionSpec, LatentAttentionSpec,
                                       SlidingWindowSpec, attention_spec)
from tests.pd_helpers import engine

BF16 = torch.bfloat16
MIXED = KVCacheSpec(16, (FullAttentionSpec(4, 64, BF16), SlidingWindowSpec(4, 64, BF16, 128),
                         LatentAttentionSpec(576, BF16)))


def test_each_spec_says_its_shape_bytes_and_description() -> None:
    full, latent = FullAttentionSpec(8, 128, BF16), LatentAttentionSpec(576, BF16)
    assert full.cache_shape(10, 16) == (2, 10, 16, 8, 128)
    assert full.page_bytes(16) == 2 * 16 * 8 * 128 * 2
    assert latent.cache_shape(10, 16) == (1, 10, 16, 1, 576)
    assert latent.page_bytes(16) == 16 * 576 * 2  # DeepSeek-V3: 1152 bytes per token in bf16
    assert attention_spec(8, 128, BF16, window=None) == full
    assert attention_spec(8, 128, BF16, window=64) == SlidingWindowSpec(8, 128, BF16, 64)
    for spec in MIXED.layers:  # the handshake's form survives msgpack unchanged
        assert msgpack.unpackb(msgpack.packb(spec.describe())) == spec.describe()
    assert [s["kind"] for s in MIXED.describe()] == ["full", "sliding", "latent"]


def test_cache_engine_sizes_and_allocates_mixed_specs() -> None:
    page = 2 * 16 * 4 * 64 * 2
    assert MIXED.block_bytes == page + page + 16 * 576 * 2
    budget = 10 * MIXED.block_bytes + MIXED.block_bytes // 2
    n = determine_num_blocks(MIXED, torch.device("cpu"), None, budget, 0.9)
    assert n == 10
    caches = allocate_kv_caches(MIXED, n, torch.device("cpu"))
    assert [tuple(c.shape) for c in caches] == [(2, 10, 16, 4, 64)] * 2 + [(1, 10, 16, 1, 576)]
    assert sum(c.nbytes for c in caches) == n * MIXED.block_bytes
    assert KVCacheSpec.uniform(3, 16, 4, 64, BF16).block_bytes == 3 * page


@pytest.mark.parametrize("parts, heads, width", [(1, 1, 40), (2, 2, 8)])
def test_block_copy_and_receiver_are_generic_over_parts(parts: int, heads: int,
                                                        width: int) -> None:
    src = torch.randn(parts, 12, 8, heads, width)
    buf = gather_kv_blocks(src, [7, 2, 3])
    assert buf.shape == (parts, 3, 8, heads, width)
    dst = torch.zeros_like(src)
    scatter_kv_blocks(buf, dst, [0, 1, 2])
    assert torch.equal(dst[:, :3], src[:, [7, 2, 3]])
    # A receiver over a latent layer (parts 1) and a K/V layer completes once both are in.
    rx = KVReceiver(2, 8, timeout=5.0, max_staging_bytes=1 << 20)
    rx.kv_caches = [torch.zeros(1, 12, 8, 1, 40), torch.zeros(parts, 12, 8, heads, width)]
    rx.register(RecvSpec("r", (4, 5, 6), 20))
    whole = [torch.randn(1, 3, 8, 1, 40), torch.randn(parts, 3, 8, heads, width)]
    for layer in range(2):  # (their integrity is the pipe's: tests/test_kv_integrity.py)
        header = KVLayerHeader("r", layer, 0)
        assert rx.on_message(header, whole[layer], "p") == []
    fin = FinHeader("r", first_token=9, num_prompt_tokens=20)
    assert rx.on_message(fin, None, "p") == [("p", "r", True)]
    assert rx.take_finished() == {"r": 9}
    for layer in range(2):
        assert torch.equal(rx.kv_caches[layer][:, 4:7], whole[layer])


def test_hello_compares_every_layer_spec_naming_the_producers_values() -> None:
    def info(specs: KVCacheSpec, tp: int) -> dict:
        return {"model_id": "m", "dtype": "torch.bfloat16", "block_size": 16, "num_layers": 3,
                "num_kv_heads": 4 // tp, "head_dim": 64, "kv_specs": specs.describe(),
                "total_kv_heads": 4, "tp_size": tp}

    ours = make_hello(info(MIXED, 1))
    # Another TP size caches fewer heads per rank: not a mismatch.
    half = KVCacheSpec(16, (FullAttentionSpec(2, 64, BF16), SlidingWindowSpec(2, 64, BF16, 128),
                            LatentAttentionSpec(576, BF16)))
    assert hello_mismatch(ours, msgpack.unpackb(msgpack.packb(make_hello(info(half, 2))))) is None
    other = KVCacheSpec(16, MIXED.layers[:2] + (LatentAttentionSpec(512, BF16),))
    why = hello_mismatch(ours, make_hello(info(other, 2)))
    assert why is not None and "prefill engine (TP2)" in why and "decode engine" in why
    # the producer's value, never the consumer's (the reason goes back to the peer)
    assert "layer 2 KV spec" in why and "512" in why and "576" not in why


def test_launch_between_latent_and_standard_engines_fails(tiny_model, tmp_path) -> None:
    from pd_cluster.checkpoints.maker import make_model
    mla = str(make_model(tmp_path / "mla", arch="deepseek_v3", hidden_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=4, config_overrides=dict(
                             kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                             v_head_dim=8, n_routed_experts=2, n_group=1, topk_group=1,
                             num_experts_per_tok=1, first_k_dense_replace=2)))
    d = engine(tiny_model(), "consumer", block_size=8)
    p = engine(mla, "producer", block_size=8)
    try:
        with pytest.raises(HandshakeError, match="prefill engine.*decode engine.*layer 0 KV spec"):
            p.runner.connector.connect_peer(d.kv_endpoint())
    finally:
        p.close(), d.close()
