"""Triton kernels vs their torch references.

Without CUDA the kernels run in the Triton CPU interpreter (fp32/fp16, small shapes); the
``cuda`` class repeats the comparisons in bf16 on a real GPU.
"""
import os

import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    # Must precede the first `import triton`: @triton.jit reads it to build interpreted kernels.
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

# triton is a declared test dependency: a broken install fails here, loudly.
import triton  # noqa: E402,F401

import kernels.block_copy as bc  # noqa: E402
import kernels.paged_decode_attention as pda  # noqa: E402
import kernels.paged_prefill_attention as ppa  # noqa: E402
import kernels.reshape_and_cache as rac  # noqa: E402

# If another test module imported the kernels earlier without the interpreter, rebuild them.
for _m in (bc, pda, ppa, rac):
    if not _HAS_CUDA and not _m._INTERPRETED:
        importlib.reload(_m)

from pd_cluster.attention.metadata import AttentionMetadata  # noqa: E402
from pd_cluster.attention.options import AttentionOptions  # noqa: E402

DEV = "cuda" if _HAS_CUDA else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# (num_q_heads, num_kv_heads, head_dim, block_size): GQA ratios 1, 2, 4 and MQA.
CONFIGS = [(4, 4, 64, 16), (4, 2, 80, 8), (8, 2, 64, 32), (4, 1, 80, 16)]
CFG_IDS = ["mha-d64-bs16", "gqa2-d80-bs8", "gqa4-d64-bs32", "mqa-d80-bs16"]


def _cache(num_blocks, bs, hkv, d, dtype, device):
    return torch.randn(2, num_blocks, bs, hkv, d, dtype=dtype, device=device)


def _tables(batch, num_blocks, max_blocks, device):
    """Distinct, shuffled physical blocks per sequence."""
    perm = torch.randperm(num_blocks)[: batch * max_blocks].view(batch, max_blocks)
    return perm.to(device=device, dtype=torch.int32)


def _close(a, b, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


# Per-layer attention options (window, soft-cap, sinks) the kernels take, as kwargs.
def _variant(name, hq, device):
    sinks = torch.linspace(-1.0, 3.0, hq, device=device)
    return {"plain": {}, "window": {"sliding_window": 50}, "softcap": {"softcap": 0.8},
            "sinks": {"sinks": sinks},
            "all": {"sliding_window": 33, "softcap": 1.5, "sinks": sinks}}[name]


def check_decode(cfg, dtype, device, num_splits, variant="plain"):
    hq, hkv, d, bs = cfg
    seq_lens = [1, 45, 440, 130]  # not multiples of any block size; 440 spans 7 splits of 64
    max_blocks = -(-max(seq_lens) // bs)
    cache = _cache(len(seq_lens) * max_blocks + 3, bs, hkv, d, dtype, device)
    tables = _tables(len(seq_lens), cache.shape[1], max_blocks, device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens), hq, d, dtype=dtype, device=device)
    kw = _variant(variant, hq, device)
    out = pda.paged_decode_attention(q, cache, tables, sl, d ** -0.5, num_splits=num_splits, **kw)
    _close(out, pda.paged_decode_attention_ref(q, cache, tables, sl, d ** -0.5, **kw), dtype)


def check_prefill(cfg, dtype, device, variant="plain"):
    hq, hkv, d, bs = cfg
    # (seq_len, q_len): a decode-like row first (skipped via start_req), a chunk after a
    # cached prefix, a full prefill, a one-token chunk with prefix.
    reqs = [(9, 1), (83, 30), (37, 37), (20, 1)]
    max_blocks = -(-max(s for s, _ in reqs) // bs)
    cache = _cache(len(reqs) * max_blocks + 2, bs, hkv, d, dtype, device)
    tables = _tables(len(reqs), cache.shape[1], max_blocks, device)
    sl = torch.tensor([s for s, _ in reqs], dtype=torch.int32, device=device)
    locs = [0]
    for _, ql in reqs:
        locs.append(locs[-1] + ql)
    qsl = torch.tensor(locs, dtype=torch.int32, device=device)
    q = torch.randn(locs[-1], hq, d, dtype=dtype, device=device)
    kw = _variant(variant, hq, device)
    out = ppa.paged_prefill_attention(q, cache, tables, sl, qsl, d ** -0.5, 37, start_req=1, **kw)
    ref = ppa.paged_prefill_attention_ref(q, cache, tables, sl, qsl, d ** -0.5, start_req=1, **kw)
    _close(out, ref, dtype)
    assert not out[:1].any()  # rows of requests before start_req are left alone


def check_reshape_and_cache(dtype, device, hkv=2, d=80, bs=8):
    cache = _cache(12, bs, hkv, d, dtype, device)
    t = 21
    slots = torch.randperm(12 * bs)[:t]
    slots[[0, 5, 20]] = -1  # padding tokens are skipped
    slots = slots.to(device)
    key = torch.randn(t, hkv, d, dtype=dtype, device=device)
    value = torch.randn(t, hkv, d, dtype=dtype, device=device)
    got, want = cache.clone(), cache.clone()
    rac.reshape_and_cache(key, value, got, slots)
    rac.reshape_and_cache_ref(key, value, want, slots)
    assert torch.equal(got, want)
    assert not torch.equal(got, cache)


def check_block_copy(dtype, device, hkv=2, d=64, bs=16):
    src = _cache(10, bs, hkv, d, dtype, device)
    ids = torch.randperm(10)[:4].tolist()
    buf = bc.gather_kv_blocks(src, ids)
    assert torch.equal(buf, bc.gather_kv_blocks_torch(src, ids, out=torch.empty_like(buf)))
    assert buf.shape == (2, 4, bs, hkv, d)
    dst_ids = torch.randperm(7)[:4].to(device)  # a different, smaller cache
    got = torch.zeros(2, 7, bs, hkv, d, dtype=dtype, device=device)
    want = got.clone()
    bc.scatter_kv_blocks(buf, got, dst_ids)
    bc.scatter_kv_blocks_torch(buf, want, dst_ids)
    assert torch.equal(got, want)
    assert torch.equal(got[:, dst_ids.long()], src[:, ids])


def check_backend(dtype, device, cfg=(8, 2, 64, 16), variant="plain"):
    from pd_cluster.attention.torch_backend import TorchAttentionBackend
    from pd_cluster.attention.triton_backend import TritonAttentionBackend

    hq, hkv, d, bs = cfg
    reqs = [(17, 1), (70, 1), (90, 25), (33, 33)]  # (seq_len, q_len): 2 decodes, 2 prefills
    max_blocks = -(-max(s for s, _ in reqs) // bs)
    cache = _cache(len(reqs) * max_blocks + 1, bs, hkv, d, dtype, device)
    tables = _tables(len(reqs), cache.shape[1], max_blocks, device)
    locs, slots = [0], []
    for i, (s, ql) in enumerate(reqs):
        locs.append(locs[-1] + ql)
        pos = torch.arange(s - ql, s)
        slots.append(tables[i].cpu().long()[pos // bs] * bs + pos % bs)
    slots.append(torch.tensor([-1, -1]))  # two padding tokens
    n = locs[-1] + 2
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device), block_tables=tables,
        query_start_loc=torch.tensor(locs, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([s for s, _ in reqs], dtype=torch.int32, device=device),
        num_decodes=2, max_query_len=33, max_seq_len=90, block_size=bs,
        query_start_loc_cpu=locs, seq_lens_cpu=[s for s, _ in reqs])
    q = torch.randn(n, hq, d, dtype=dtype, device=device)
    k = torch.randn(n, hkv, d, dtype=dtype, device=device)
    v = torch.randn(n, hkv, d, dtype=dtype, device=device)
    c_tr, c_to = cache.clone(), cache.clone()
    tr, to = TritonAttentionBackend(num_splits=2), TorchAttentionBackend()
    tr.write_kv(k, v, c_tr, meta)
    to.write_kv(k, v, c_to, meta)
    assert torch.equal(c_tr, c_to)
    kw = _variant(variant, hq, device)
    opts = AttentionOptions(d ** -0.5, sliding_window=kw.get("sliding_window"),
                            logit_softcap=kw.get("softcap"), sinks=kw.get("sinks"))
    got, want = tr.forward(q, c_tr, meta, opts), to.forward(q, c_to, meta, opts)
    _close(got[: locs[-1]], want[: locs[-1]], dtype)
    assert not got[locs[-1]:].any()


DTYPES = [torch.float32, torch.float16]


# 7 splits only in fp32, to keep the interpreter run short.
@pytest.mark.parametrize("num_splits,dtype", [(1, torch.float32), (3, torch.float32),
                                              (7, torch.float32), (1, torch.float16),
                                              (3, torch.float16)],
                         ids=["1split-fp32", "3split-fp32", "7split-fp32", "1split-fp16",
                              "3split-fp16"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=CFG_IDS)
def test_decode_attention(cfg, dtype, num_splits):
    check_decode(cfg, dtype, DEV, num_splits)


@pytest.mark.parametrize("cfg", [(2, 1, 128, 128), (4, 2, 96, 8), (2, 2, 256, 32)],
                         ids=["d128-bs128", "d96-bs8", "d256-bs32"])
def test_decode_attention_other_shapes(cfg):
    check_decode(cfg, torch.float32, DEV, None)


def test_choose_num_splits():
    cpu = torch.device("cpu")
    assert pda.choose_num_splits(4, 8, 32768, cpu) == 1  # no parallelism to gain on CPU
    assert 1 <= pda.choose_num_splits(1, 1, 10, cpu) <= pda.MAX_SPLITS


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=CFG_IDS)
def test_prefill_attention(cfg, dtype):
    check_prefill(cfg, dtype, DEV)


VARIANTS = ["window", "softcap", "sinks", "all"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_variants(variant, num_splits):
    """Window, soft-cap and sinks in the split-K decode kernel (sinks in both the direct
    and the reduce path; a window that empties whole splits)."""
    check_decode((4, 2, 64, 16), torch.float32, DEV, num_splits, variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_attention_variants(variant):
    check_prefill((4, 2, 64, 8), torch.float32, DEV, variant)


@pytest.mark.parametrize("variant", ["all"])
def test_triton_backend_matches_torch_backend_variants(variant):
    check_backend(torch.float32, DEV, variant=variant)
    check_decode((4, 1, 80, 16), torch.float16, DEV, 3, variant)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_reshape_and_cache(dtype):
    check_reshape_and_cache(dtype, DEV)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_block_copy(dtype):
    check_block_copy(dtype, DEV)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_triton_backend_matches_torch_backend(dtype):
    check_backend(dtype, DEV)


def test_import_kernels_does_not_init_cuda():
    code = ("import torch, kernels, pd_cluster.attention.triton_backend\n"
            "assert not torch.cuda.is_initialized()\n"
            "print('ok')\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA GPU (bf16 kernels on real hardware)")
class TestKernelsCudaBf16:
    dtype = torch.bfloat16

    @pytest.mark.parametrize("cfg", CONFIGS, ids=CFG_IDS)
    @pytest.mark.parametrize("num_splits", [None, 1, 3, 7])
    def test_decode(self, cfg, num_splits):
        check_decode(cfg, self.dtype, "cuda", num_splits)

    @pytest.mark.parametrize("cfg", CONFIGS, ids=CFG_IDS)
    def test_prefill(self, cfg):
        check_prefill(cfg, self.dtype, "cuda")

    def test_reshape_and_cache(self):
        check_reshape_and_cache(self.dtype, "cuda")

    def test_block_copy(self):
        check_block_copy(self.dtype, "cuda")

    def test_backend(self):
        check_backend(self.dtype, "cuda")

    @pytest.mark.parametrize("variant", ["window", "softcap", "sinks", "all"])
    def test_variants(self, variant):
        check_decode((8, 2, 128, 16), self.dtype, "cuda", None, variant)
        check_prefill((8, 2, 128, 16), self.dtype, "cuda", variant)
        check_backend(self.dtype, "cuda", variant=variant)

    def test_int64_offsets(self):
        """A cache past 2^31 elements per K/V half: int32 offsets would wrap."""
        bs, hkv, d = 16, 8, 128
        num_blocks = 2 ** 31 // (bs * hkv * d) + 64
        need = 2 * num_blocks * bs * hkv * d * 2
        if torch.cuda.mem_get_info()[0] < need * 1.3:
            pytest.skip("not enough free GPU memory for a > 2^31-element cache")
        cache = torch.empty(2, num_blocks, bs, hkv, d, dtype=self.dtype, device="cuda")
        tables = torch.arange(num_blocks - 40, num_blocks, dtype=torch.int32,
                              device="cuda").flip(0).view(2, 20)
        cache[:, tables.long().flatten()] = torch.randn(2, 40, bs, hkv, d, dtype=self.dtype,
                                                        device="cuda")
        sl = torch.tensor([300, 77], dtype=torch.int32, device="cuda")
        q = torch.randn(2, 32, d, dtype=self.dtype, device="cuda")
        for ns in (1, 4):
            out = pda.paged_decode_attention(q, cache, tables, sl, d ** -0.5, num_splits=ns)
            _close(out, pda.paged_decode_attention_ref(q, cache, tables, sl, d ** -0.5),
                   self.dtype)
        buf = bc.gather_kv_blocks(cache, tables[0])
        assert torch.equal(buf, cache[:, tables[0].long()])


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_triton_backend_fp8_cache(kv_dtype):
    """An FP8 cache (kernels/kv_quant.py): the decode and prefill kernels convert each block
    and apply its per-head scales; they match attention over the dequantised values."""
    from kernels.kv_quant import dequantize
    from pd_cluster.attention.torch_backend import TorchAttentionBackend
    from pd_cluster.attention.triton_backend import TritonAttentionBackend
    from pd_cluster.engine.kv_spec import FullAttentionSpec

    hq, hkv, d, bs = 4, 2, 64, 16
    reqs = [(45, 1), (130, 1), (83, 30), (37, 37)]  # (seq_len, q_len): two decodes first
    max_blocks = -(-max(s for s, _ in reqs) // bs)
    num_blocks = len(reqs) * max_blocks + 2
    cache = torch.zeros(FullAttentionSpec(hkv, d, kv_dtype).cache_shape(num_blocks, bs),
                        dtype=kv_dtype, device=DEV)
    tables = _tables(len(reqs), num_blocks, max_blocks, DEV)
    locs = [0]
    for i, (s, ql) in enumerate(reqs):
        locs.append(locs[-1] + ql)
        pos = torch.arange(s)
        slots = (tables[i].cpu().long()[pos // bs] * bs + pos % bs).to(DEV)
        kv = torch.randn(2, s, hkv, d, device=DEV)
        TorchAttentionBackend().write_kv(kv[0], kv[1], cache, _write_meta(slots))
    meta = AttentionMetadata(
        slot_mapping=torch.full((locs[-1],), -1, device=DEV), block_tables=tables,
        query_start_loc=torch.tensor(locs, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor([s for s, _ in reqs], dtype=torch.int32, device=DEV),
        num_decodes=2, max_query_len=37, max_seq_len=130, block_size=bs,
        query_start_loc_cpu=locs, seq_lens_cpu=[s for s, _ in reqs])
    q = torch.randn(locs[-1], hq, d, device=DEV)
    opts = AttentionOptions(d ** -0.5, sliding_window=50)
    got = TritonAttentionBackend(num_splits=2).forward(q, cache, meta, opts)
    want = TorchAttentionBackend().forward(q, dequantize(cache, torch.float32, d), meta, opts)
    _close(got, want, torch.float32)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_triton_backend_fp8_prefill_attends_fresh_kv(kv_dtype):
    """Prefill chunks over an FP8 cache (attention/fresh_prefill.py) through the Triton
    kernels: fresh K/V for the chunk, the dequantised cache for its context and for decodes."""
    from pd_cluster.attention.torch_backend import TorchAttentionBackend
    from pd_cluster.attention.triton_backend import TritonAttentionBackend
    from tests.test_kv_fp8_fresh import fp8_step

    meta, cache, query, key, value, ref = fp8_step(
        kv_dtype, [1, 1, 12, 30, 16], [17, 40, 40, 77, 16], hq=4, hkv=2, d=64)
    args = [t.to(DEV) for t in (query, key, value, cache, ref)]
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).to(DEV))
    q, k, v, cache, ref = args
    opts = AttentionOptions(64 ** -0.5, sliding_window=20)
    got = TritonAttentionBackend(num_splits=2).forward_fresh(q, k, v, cache, meta, opts)
    _close(got, TorchAttentionBackend().forward(q, ref, meta, opts), torch.float32)


def _write_meta(slots):
    """Just enough metadata for a write_kv of ``slots``."""
    n = slots.shape[0]
    return AttentionMetadata(
        slot_mapping=slots, block_tables=torch.zeros(1, 1, dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), num_decodes=0, max_query_len=n,
        max_seq_len=n, block_size=16, query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
