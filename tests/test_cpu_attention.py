"""The CPU paged attention kernel against the dense torch reference, per variant: GQA/MQA/MHA,
sliding window, soft-cap, sinks, latent-shaped K/V (values a view of the keys), decode batches,
chunked prefill over a cached prefix, and mixed prefill + decode batches."""
from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_build
from pd_cluster.attention import AttentionMetadata, AttentionOptions, create_backend
from pd_cluster.attention.cpu_backend import paged_attention
from pd_cluster.attention.torch_backend import TorchAttentionBackend
from pd_cluster.host_facts import cpu_features

# Skipped only when turned off on purpose: a kernel that fails to build is a failure here (the
# product would quietly fall back to the slower torch path), never a skip that hides it.
pytestmark = pytest.mark.skipif(cpu_build.disabled_by_env(), reason="PD_CLUSTER_CPU_KERNELS=0")


@pytest.fixture(autouse=True)
def _kernel_built() -> None:
    assert cpu_build.load_cpu_kernels(), f"CPU kernel failed to build: {cpu_build.load_error()}"


def make_batch(q_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int,
               seed: int = 0) -> AttentionMetadata:
    """Requests with scattered (shuffled) blocks; decodes (q_len 1) must come first."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    width = max(len(t) for t in tables)
    tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    slots = []
    for t, q, s in zip(tables, q_lens, seq_lens):
        slots += [t[p // block_size] * block_size + p % block_size for p in range(s - q, s)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables_t,
        num_decodes=sum(1 for q in q_lens if q == 1), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_size=block_size, query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens))


def check(q_lens, seq_lens, hq=8, hkv=2, d=32, block_size=16, dtype=torch.float32,
          atol=2e-5, **opt_kwargs) -> None:
    torch.manual_seed(0)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    meta = make_batch(q_lens, seq_lens, block_size, num_blocks)
    cache = torch.randn(2, num_blocks, block_size, hkv, d).to(dtype)
    query = torch.randn(sum(q_lens), hq, d).to(dtype)
    if "sinks" in opt_kwargs:
        opt_kwargs["sinks"] = torch.randn(hq)
    opts = AttentionOptions(scale=d ** -0.5, **opt_kwargs)
    ref = TorchAttentionBackend().forward(query, cache, meta, opts)
    got = create_backend("cpu", torch.device("cpu")).forward(query, cache, meta, opts)
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=1e-3 if atol > 1e-4 else 1e-5)


DECODE = ([1] * 5, [1, 17, 40, 100, 33])
PREFILL_PREFIX = ([7, 40, 3], [7, 100, 50])  # first from scratch, then chunks after a prefix
MIXED = ([1, 1, 1, 12, 30], [5, 64, 200, 12, 77])


@pytest.mark.parametrize("batch", [DECODE, PREFILL_PREFIX, MIXED], ids=["decode", "prefix", "mixed"])
@pytest.mark.parametrize("variant", [
    {}, {"sliding_window": 8}, {"sliding_window": 1}, {"logit_softcap": 5.0}, {"sinks": True},
    {"sliding_window": 16, "sinks": True, "logit_softcap": 30.0}],
    ids=["plain", "window", "window1", "softcap", "sinks", "all"])
def test_matches_reference(batch, variant) -> None:
    check(*batch, **variant)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 1), (8, 4)], ids=["mha", "mqa", "gqa"])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_heads_and_block_sizes(hq, hkv, block_size) -> None:
    check(*MIXED, hq=hq, hkv=hkv, block_size=block_size)


def test_long_prefill_tiles() -> None:
    """A prompt longer than one query tile, from scratch and after a prefix."""
    check([1, 70, 45], [300, 70, 90], hq=4, hkv=2, d=64, sliding_window=20)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype) -> None:
    check(*MIXED, dtype=dtype, atol=2e-2)


def test_latent_values_are_a_view_of_keys() -> None:
    """Latent attention's decode: one cached vector per token, keys = all of it, values = its
    first ``rank`` entries, read from the same memory; K dim != V dim."""
    torch.manual_seed(0)
    rank, rope, heads, bs = 24, 8, 4, 16
    meta = make_batch(*MIXED, bs, 40)
    cache = torch.randn(1, 40, bs, 1, rank + rope)
    query = torch.randn(sum(MIXED[0]), heads, rank + rope)
    opts = AttentionOptions(scale=0.3)
    got = paged_attention(query, cache[0], cache[0][..., :rank], meta, opts)
    # Dense reference over the same vectors: a K/V cache with the values zero-padded.
    dense = torch.zeros(2, 40, bs, 1, rank + rope)
    dense[0], dense[1, ..., :rank] = cache[0], cache[0, ..., :rank]
    ref = TorchAttentionBackend().forward(query, dense, meta, opts)[..., :rank]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_padding_rows_are_zero() -> None:
    meta = make_batch([1, 4], [9, 4], 4, 8)
    cache = torch.randn(2, 8, 4, 2, 8)
    query = torch.randn(7, 4, 8)  # 5 real tokens, 2 padding
    out = create_backend("cpu", torch.device("cpu")).forward(query, cache, meta,
                                                              AttentionOptions(scale=0.5))
    assert out[5:].abs().sum() == 0 and out[:5].abs().sum() > 0


def test_compiled_isa_follows_the_switch() -> None:
    """PD_CLUSTER_CPU_ISA decides which paths the library has (test_cpu_attention_isa.py runs
    this module under each value): native = this CPU's, avx512 = without BF16, portable =
    none of AVX-512."""
    got = torch.ops.pd_cluster_cpu.compiled_isa()
    isa = cpu_build.isa()
    if isa == "portable":
        assert got == "portable"
    elif isa == "avx512":
        assert got == "avx512f"
    else:
        features = cpu_features().split()
        want = " ".join(f for f, flag in (("avx512f", "avx512f"), ("avx512bf16", "avx512_bf16"))
                        if flag in features) or "portable"
        assert got == want


def test_failed_build_falls_back_loudly(tmp_path, monkeypatch, caplog) -> None:
    """A kernel that does not compile: a warning naming the error, then torch attention (auto),
    or an error naming the cause when 'cpu' was asked for by name."""
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++;\n")
    monkeypatch.setattr(cpu_build, "_SOURCES", [bad])
    monkeypatch.setenv("PD_CLUSTER_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_build, "_state", {})
    with caplog.at_level(logging.WARNING):
        assert not cpu_build.load_cpu_kernels()
        backend = create_backend("auto", torch.device("cpu"))
    assert backend.name == "torch"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # one, not one per layer
    text = warnings[0].getMessage()
    assert "CPU kernels unavailable" in text and "torch attention instead" in text
    assert "this is not C++" in text or "Error building extension" in text
    assert cpu_build.load_error()
    stats = cpu_build.kernel_stats()
    assert stats["cpu_kernels"].startswith("failed: ") and stats["cpu_kernels_loaded"] == 0
    with pytest.raises(RuntimeError, match=r"C\+\+ kernel is unavailable"):
        create_backend("cpu", torch.device("cpu"))


def test_build_key_depends_on_sources(tmp_path, monkeypatch) -> None:
    key = cpu_build.build_key()
    other = tmp_path / "other.cpp"
    other.write_text("// a different kernel\n")
    monkeypatch.setattr(cpu_build, "_SOURCES", [other])
    assert cpu_build.build_key() != key


def test_stale_torch_lock_does_not_hang(tmp_path) -> None:
    """A build killed mid-way leaves torch's lock file behind; the next load removes it (our
    own flock proves no one else is building) instead of waiting on it forever. In a child
    process: one process loads the kernel library once."""
    name = f"pd_cluster_cpu_{cpu_build.build_key()}"
    shutil.copytree(cpu_build.cache_dir() / name, tmp_path / name)  # built: no recompile
    (tmp_path / name / "lock").write_text("")
    code = ("from kernels import cpu_build; "
            "assert cpu_build.load_cpu_kernels(), cpu_build.load_error()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300,
                   cwd=Path(cpu_build.__file__).parent.parent,
                   env={**os.environ, "PD_CLUSTER_KERNEL_CACHE": str(tmp_path)})
    assert not (tmp_path / name / "lock").exists()


# The AVX-512 path (head dims that are multiples of 16, on CPUs that have it) takes decode rows
# (up to 8 per KV head) by per-key dot products and larger tiles by transposed keys, both over
# chunks of up to 512 / 256 keys; other head dims take the portable path. Each shape below is
# checked against the torch reference whichever path this CPU gives it.
LONG = ([1, 1, 1, 40, 9], [1300, 600, 17, 40, 700])  # decodes past one chunk, prefill after one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("hq,hkv,d", [(8, 4, 64), (4, 4, 128), (8, 2, 128), (7, 1, 64),
                                      (16, 1, 64), (2, 1, 256), (4, 2, 40)],
                         ids=["gqa2-d64", "mha-d128", "gqa4-d128", "mqa7-d64", "mqa16-tiles",
                              "d256", "d40-portable"])
def test_fast_path_shapes(dtype, hq, hkv, d) -> None:
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    check(*LONG, hq=hq, hkv=hkv, d=d, dtype=dtype, atol=atol)


@pytest.mark.parametrize("block_size", [1, 5, 16, 48])
def test_fast_path_block_sizes_and_variants(block_size) -> None:
    check(*LONG, hq=8, hkv=4, d=64, block_size=block_size, sliding_window=300,
          logit_softcap=30.0, sinks=True)


@pytest.mark.parametrize("heads", [4, 16], ids=["decode-rows", "tiles"])
def test_latent_mla_dims(heads) -> None:
    """MLA's shapes: keys of rank 512 + rope 64 per token, values the first 512; 4 heads take
    the per-key dot products for decode, 16 the transposed tiles."""
    torch.manual_seed(0)
    rank, rope, bs = 512, 64, 16
    q_lens, seq_lens = [1, 1, 20], [300, 40, 60]
    meta = make_batch(q_lens, seq_lens, bs, 40)
    cache = torch.randn(1, 40, bs, 1, rank + rope) * 0.1
    query = torch.randn(sum(q_lens), heads, rank + rope) * 0.1
    opts = AttentionOptions(scale=(rank + rope) ** -0.5)
    got = paged_attention(query, cache[0], cache[0][..., :rank], meta, opts)
    dense = torch.zeros(2, 40, bs, 1, rank + rope)
    dense[0], dense[1, ..., :rank] = cache[0], cache[0, ..., :rank]
    ref = TorchAttentionBackend().forward(query, dense, meta, opts)[..., :rank]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", [{}, {"sliding_window": 3, "sinks": True}],
                         ids=["plain", "window-sinks"])
def test_short_chunks_take_decode_rows(variant) -> None:
    """A few new tokens after a prefix (speculative or tiny chunks): up to 8 rows per KV head
    go through the per-key dot products, the causal mask applied within the chunk."""
    check([1, 3, 2, 4], [9, 50, 600, 30], hq=8, hkv=4, d=64, **variant)
    check([1, 3, 2, 4], [9, 50, 600, 30], hq=8, hkv=4, d=64, dtype=torch.bfloat16, atol=2e-2,
          **variant)


def test_the_same_bits_whatever_the_thread_count() -> None:
    """Threads take work items by cost, not in order: each item writes rows of its own, so a
    causal prompt, a chunk after context and decodes come out bit for bit the same at 1, 2 and
    3 threads."""
    q_lens, seq_lens = [1, 1, 300, 70], [900, 40, 300, 500]
    num_blocks = sum(-(-s // 16) for s in seq_lens) + 3
    meta = make_batch(q_lens, seq_lens, 16, num_blocks)
    torch.manual_seed(0)
    cache = torch.randn(2, num_blocks, 16, 2, 64).to(torch.bfloat16)
    query = torch.randn(sum(q_lens), 8, 64).to(torch.bfloat16)
    opts = AttentionOptions(scale=0.125)
    backend = create_backend("cpu", torch.device("cpu"))
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(backend.forward(query, cache, meta, opts))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
