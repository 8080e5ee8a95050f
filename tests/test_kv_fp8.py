"""FP8 KV cache blocks (kernels/kv_quant.py): the quantising write (static and per-block
scales, a block's scale growing as it fills) stores exactly what the rule says, and every
backend's attention over an FP8 cache equals the reference attention over the dequantised
stored values (the torch backend, the C++ kernel; the Triton kernels in test_kernels.py)."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_build
from kernels.kv_quant import dequantize, fp8_max, pow2_scale, split, write_fp8
from pd_cluster.attention import AttentionOptions, create_backend
from pd_cluster.attention.torch_backend import TorchAttentionBackend
from pd_cluster.engine.kv_spec import FullAttentionSpec
from tests.test_cpu_attention import make_batch

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
IDS = ["e4m3", "e5m2"]


def _fp8_cache(dtype: torch.dtype, blocks: int, bs: int, hkv: int, d: int) -> torch.Tensor:
    return torch.zeros(FullAttentionSpec(hkv, d, dtype).cache_shape(blocks, bs), dtype=dtype)


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_dynamic_scales_store_the_rule(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    bs, hkv, d = 8, 2, 16
    cache = _fp8_cache(dtype, 4, bs, hkv, d)
    data, scales = split(cache, d)
    top = fp8_max(dtype)
    k, v = torch.randn(5, hkv, d), torch.randn(5, hkv, d)
    write_fp8(k, v, cache, torch.tensor([8, 9, 10, 11, 12]))  # block 1, slots 0..4: fresh
    s1 = pow2_scale(k.abs().amax(dim=(0, 2)), top)
    assert torch.equal(scales[0, 1], s1)
    assert torch.equal(data[0, 1, :5], (k / s1[None, :, None]).clamp(-top, top).to(dtype))
    before = data[0, 1, :5].clone()
    big = 10 * torch.randn(1, hkv, d)  # a larger token: the block's scale grows
    write_fp8(big, big, cache, torch.tensor([13]))
    s2 = torch.maximum(s1, pow2_scale(big.abs().amax(dim=(0, 2)), top))
    assert torch.equal(scales[0, 1], s2)
    requant = (before.float() * (s1 / s2)[None, :, None]).clamp(-top, top).to(dtype)
    assert torch.equal(data[0, 1, :5], requant)
    assert torch.equal(data[0, 1, 5], (big[0] / s2[:, None]).clamp(-top, top).to(dtype))
    # A recycled block (its first slot written again) starts from a fresh scale.
    small = 0.01 * torch.randn(1, hkv, d)
    write_fp8(small, small, cache, torch.tensor([8]))
    assert torch.equal(scales[0, 1], pow2_scale(small.abs().amax(dim=(0, 2)), top))


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_growing_scale_does_not_drift(dtype: torch.dtype) -> None:
    """A block written token by token, each token larger than the last (its scale grows at
    every write), stores exactly what the block written at once stores: the re-quantisation
    of earlier tokens is exact (power-of-two scales), not a second rounding each time."""
    torch.manual_seed(3)
    bs, hkv, d = 8, 2, 16
    sign = torch.randn(bs, hkv, d).sign()
    # Magnitudes in [1, 2) times a growing factor: never near FP8's subnormals.
    x = sign * (1 + torch.rand(bs, hkv, d)) * (1.7 ** torch.arange(bs))[:, None, None]
    at_once, by_token = (_fp8_cache(dtype, 2, bs, hkv, d) for _ in range(2))
    write_fp8(x, -x, at_once, torch.arange(bs) + bs)
    for i in range(bs):
        write_fp8(x[i:i + 1], -x[i:i + 1], by_token, torch.tensor([bs + i]))
    assert torch.equal(split(by_token, d)[1][:, 1], split(at_once, d)[1][:, 1])
    assert torch.equal(by_token[:, 1].view(torch.uint8), at_once[:, 1].view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_static_scales_and_round_trip(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    cache = _fp8_cache(dtype, 3, 8, 2, 16)
    k, v = torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    slots = torch.tensor(list(range(20)) + [-1])  # a padding slot is skipped
    write_fp8(torch.cat([k, k[:1]]), torch.cat([v, v[:1]]), cache, slots, (0.02, 0.03))
    data, scales = split(cache, 16)
    top = fp8_max(dtype)
    assert torch.equal(scales[0, :3], torch.full((3, 2), 0.02))
    assert torch.equal(scales[1, :3], torch.full((3, 2), 0.03))
    assert torch.equal(data[1].flatten(0, 1)[:20], (v / 0.03).clamp(-top, top).to(dtype))
    deq = dequantize(cache, torch.float32, 16)[0].flatten(0, 1)[:20]
    rel = 2.0 ** -3 if dtype == torch.float8_e4m3fn else 2.0 ** -2  # half an ulp, with margin
    assert ((deq - k).abs() <= rel * k.abs() + 0.02 * 2.0 ** -6 * 4).all()


def _fp8_batch(dtype: torch.dtype, q_lens: list[int], seq_lens: list[int], hq: int = 8,
               hkv: int = 2, d: int = 32, bs: int = 16):
    """A batch whose whole context was written into an FP8 cache in two writes (so some
    blocks' scales grew); the query is the batch's new tokens."""
    torch.manual_seed(2)
    blocks = sum(-(-s // bs) for s in seq_lens) + 3
    meta = make_batch(q_lens, seq_lens, bs, blocks)
    cache = _fp8_cache(dtype, blocks, bs, hkv, d)
    for r, s in enumerate(seq_lens):
        table = meta.block_tables[r].long()
        pos = torch.arange(s)
        slots = table[pos // bs] * bs + pos % bs
        k, v = torch.randn(s, hkv, d), torch.randn(s, hkv, d)
        k[s // 2:] *= 3  # the second write is larger: scales grow, earlier tokens re-quantise
        half = s // 2
        write_fp8(k[:half], v[:half], cache, slots[:half])
        write_fp8(k[half:], v[half:], cache, slots[half:])
    query = torch.randn(sum(q_lens), hq, d)
    return meta, cache, query


BATCHES = {"decode": ([1, 1, 1], [5, 40, 100]), "mixed": ([1, 1, 12, 30], [17, 64, 12, 77])}
VARIANTS = {"plain": {}, "window": {"sliding_window": 8},
            "all": {"sliding_window": 16, "logit_softcap": 30.0, "sinks": True}}


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
@pytest.mark.parametrize("batch", list(BATCHES), ids=list(BATCHES))
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_backend_reads_exactly_the_stored_values(dtype: torch.dtype, backend: str, batch: str,
                                                 variant: str) -> None:
    if backend == "cpu":
        if cpu_build.disabled_by_env():
            pytest.skip("PD_CLUSTER_CPU_KERNELS=0")
        assert cpu_build.load_cpu_kernels(), cpu_build.load_error()
    meta, cache, query = _fp8_batch(dtype, *BATCHES[batch])
    kw = dict(VARIANTS[variant])
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(query.shape[1])
    opts = AttentionOptions(scale=query.shape[-1] ** -0.5, **kw)
    # The reference: fp32 attention over a plain cache holding the dequantised values.
    plain = dequantize(cache, torch.float32, query.shape[-1])
    want = TorchAttentionBackend().forward(query, plain, meta, opts)
    got = create_backend(backend, torch.device("cpu")).forward(query, cache, meta, opts)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_fp8_blocks_are_half_of_bf16(head_dim: int) -> None:
    """An FP8 block costs at most 0.51x a bf16 block at block size 16, small head dims too
    (one fp32 scale per block and head; a whole scale row per block cost 17/32 = 0.531x)."""
    bf16 = FullAttentionSpec(4, head_dim, torch.bfloat16)
    fp8 = FullAttentionSpec(4, head_dim, torch.float8_e4m3fn)
    assert fp8.cache_shape(10, 16) == (2, 10, 1, 4, 16 * head_dim + 4)
    assert fp8.page_bytes(16) == 2 * 4 * (16 * head_dim + 4)
    assert fp8.page_bytes(16) / bf16.page_bytes(16) <= 0.51


def test_a_head_slice_carries_its_scales() -> None:
    """Heads sit on dim 3 with their scales: a slice of heads (another TP size's share, as the
    connector cuts it) copied into a cache of fewer heads dequantises to those heads' values."""
    torch.manual_seed(4)
    bs, d = 8, 16
    full = _fp8_cache(torch.float8_e4m3fn, 3, bs, 4, d)
    k, v = torch.randn(20, 4, d), 5 * torch.randn(20, 4, d)
    write_fp8(k, v, full, torch.arange(20))
    half = _fp8_cache(torch.float8_e4m3fn, 3, bs, 2, d)
    half.view(torch.uint8).copy_(full[:, :, :, 2:4].view(torch.uint8))
    assert torch.equal(dequantize(half, torch.float32, d),
                       dequantize(full, torch.float32, d)[:, :, :, 2:4])
    _, scales = split(half, d)
    assert torch.equal(scales, split(full, d)[1][:, :, 2:4]) and bool((scales > 0).all())


def test_config_names_the_field() -> None:
    from pd_cluster.config import EngineArgs
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype: fp8_e5m2 does not run in CUDA graphs"):
        EngineArgs(kv_cache_dtype="fp8_e5m2", cuda_graphs=True)
    assert EngineArgs(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
