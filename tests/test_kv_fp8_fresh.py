"""FP8 KV cache, prefill (pd_cluster/attention/fresh_prefill.py): a prefill chunk attends over
its own fresh K/V and over its context dequantised from the FP8 cache. So a prompt that fits
one chunk gets exactly the auto-KV engine's prompt logprobs and first token, and a later chunk
(or a prefix hit) reads its context from FP8 and equals attention over that dequantised context
plus the fresh chunk. Every CPU backend (the Triton one: test_kernels.py); leak checks after
each engine."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_build
from kernels.kv_quant import dequantize, write_fp8
from pd_cluster import LLM, SamplingParams
from pd_cluster.attention import AttentionOptions, create_backend
from pd_cluster.engine.kv_spec import FullAttentionSpec
from tests.pd_helpers import prompts_of_lengths
from tests.test_cpu_attention import make_batch

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BATCHES = {  # (q_lens, seq_lens); decodes first
    "prompts": ([20, 37, 3], [20, 37, 3]),
    "mixed": ([1, 1, 25, 9], [30, 50, 25, 9]),
    "context": ([1, 12, 30, 5, 16], [17, 40, 77, 5, 32]),  # chunks after cached context
}
VARIANTS = {"plain": {}, "window": {"sliding_window": 8},
            "all": {"sliding_window": 16, "logit_softcap": 30.0, "sinks": True}}


def _backend(name: str):
    if name == "cpu":
        if cpu_build.disabled_by_env():
            pytest.skip("PD_CLUSTER_CPU_KERNELS=0")
        assert cpu_build.load_cpu_kernels(), cpu_build.load_error()
    return create_backend(name, torch.device("cpu"))


def fp8_step(dtype: torch.dtype, q_lens: list[int], seq_lens: list[int], hq: int = 8,
             hkv: int = 2, d: int = 32, bs: int = 16):
    """A step's batch over an FP8 cache: each request's context written by earlier steps,
    then this step's K/V (``key``/``value``, the chunks' tokens in batch order) written as
    write_kv does. Returns (meta, fp8 cache, query, key, value, reference cache): the
    reference is a plain fp32 cache holding the dequantised FP8 values, except at the prefill
    chunks' own positions, where it holds their fresh K/V."""
    torch.manual_seed(5)
    blocks = sum(-(-s // bs) for s in seq_lens) + 3
    meta = make_batch(q_lens, seq_lens, bs, blocks)
    cache = torch.zeros(FullAttentionSpec(hkv, d, dtype).cache_shape(blocks, bs), dtype=dtype)
    backend = create_backend("torch", torch.device("cpu"))
    keys, values, fresh_slots = [], [], []
    for r, (q, s) in enumerate(zip(q_lens, seq_lens)):
        pos = torch.arange(s)
        slots = meta.block_tables[r].long()[pos // bs] * bs + pos % bs
        k, v = torch.randn(s, hkv, d), torch.randn(s, hkv, d)
        k[s - q:] *= 2  # the chunk is larger: its blocks' scales grow, re-quantising context
        if s > q:
            write_fp8(k[:s - q], v[:s - q], cache, slots[:s - q])  # earlier steps' writes
        keys.append(k[s - q:]), values.append(v[s - q:])
        if r >= meta.num_decodes:
            fresh_slots.append(slots[s - q:])
    key, value = torch.cat(keys), torch.cat(values)
    backend.write_kv(key, value, cache, meta)
    ref = dequantize(cache, torch.float32, d).contiguous()
    if fresh_slots:
        n_dec = meta.query_start_loc_cpu[meta.num_decodes]
        flat = ref.view(2, -1, hkv, d)
        slots = torch.cat(fresh_slots)
        flat[0, slots], flat[1, slots] = key[n_dec:], value[n_dec:]
    return meta, cache, torch.randn(sum(q_lens), hq, d), key, value, ref


def _opts(variant: str, heads: int) -> AttentionOptions:
    kw = dict(VARIANTS[variant])
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(heads)
    return AttentionOptions(scale=32 ** -0.5, **kw)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", list(FP8.values()), ids=list(FP8))
def test_prefill_attends_fresh_kv_and_fp8_context(dtype: torch.dtype, backend: str, batch: str,
                                                  variant: str) -> None:
    b = _backend(backend)
    meta, cache, query, key, value, ref = fp8_step(dtype, *BATCHES[batch])
    opts = _opts(variant, query.shape[1])
    got = b.forward_fresh(query, key, value, cache, meta, opts)
    torch.testing.assert_close(got, b.forward(query, ref, meta, opts), atol=2e-5, rtol=1e-5)
    if meta.num_reqs > meta.num_decodes:  # not what reading the chunk back from FP8 gives
        n_dec = meta.query_start_loc_cpu[meta.num_decodes]
        assert not torch.allclose(got[n_dec:], b.forward(query, cache, meta, opts)[n_dec:],
                                  atol=1e-3)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_whole_prompts_are_exactly_auto(backend: str) -> None:
    """Prompts in one chunk: the same bytes as the backend over an auto (fp32) cache."""
    b = _backend(backend)
    q_lens = BATCHES["prompts"][0]
    meta, cache, query, key, value, _ = fp8_step(torch.float8_e4m3fn, q_lens, q_lens)
    auto = torch.zeros(FullAttentionSpec(2, 32, torch.float32).cache_shape(
        cache.shape[1], 16))
    b.write_kv(key, value, auto, meta)
    for variant in VARIANTS:
        opts = _opts(variant, query.shape[1])
        assert torch.equal(b.forward_fresh(query, key, value, cache, meta, opts),
                           b.forward(query, auto, meta, opts))


def test_auto_cache_is_plain_forward() -> None:
    """An auto cache takes the backend's forward unchanged (the same call, the same bytes)."""
    b = _backend("torch")
    q_lens, seq_lens = BATCHES["context"]
    meta, _, query, key, value, ref = fp8_step(torch.float8_e4m3fn, q_lens, seq_lens)
    opts = _opts("plain", query.shape[1])
    assert torch.equal(b.forward_fresh(query, key, value, ref, meta, opts),
                       b.forward(query, ref, meta, opts))


# ---------------------------------------------------------------- through an engine

PROMPTS = prompts_of_lengths([40, 23, 57])
LOGPROBS = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, logprobs=0)


def _run(model: str, kv: str, backend: str, prompts: list[list[int]],
         params: SamplingParams = LOGPROBS, **args):
    llm = LLM(model=model, kv_cache_dtype=kv, attention_backend=backend, block_size=8,
              num_kv_blocks=64, **args)
    try:
        outs = llm.generate(prompts, [params] * len(prompts))
        llm.engine.check_no_leaks()
    finally:
        llm.close()
    return outs


def _prompt_lps(outs, prompts) -> list[list[float]]:
    return [[lp[t] for t, lp in zip(p[1:], o.prompt_logprobs[1:])] for p, o in zip(prompts, outs)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_single_chunk_prompt_logprobs_equal_auto(tiny_model, kv: str, backend: str) -> None:
    _backend(backend)
    model = tiny_model()
    auto = _run(model, "auto", backend, PROMPTS)
    fp8 = _run(model, kv, backend, PROMPTS)
    assert _prompt_lps(fp8, PROMPTS) == _prompt_lps(auto, PROMPTS)
    for a, f in zip(auto, fp8):
        assert f.outputs[0].token_ids == a.outputs[0].token_ids
        assert f.outputs[0].logprobs == a.outputs[0].logprobs


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_later_chunks_read_fp8_context(tiny_model, backend: str) -> None:
    """Chunked prefill (16 tokens a step): the first chunk's positions equal auto's, later
    chunks read their context from the FP8 cache and differ."""
    _backend(backend)
    model = tiny_model()
    prompt = PROMPTS[:1]
    auto = _prompt_lps(_run(model, "auto", backend, prompt, max_num_batched_tokens=16), prompt)
    fp8 = _prompt_lps(_run(model, "fp8_e4m3", backend, prompt, max_num_batched_tokens=16),
                      prompt)
    assert fp8[0][:15] == auto[0][:15]  # logprobs of tokens 1..15: computed in chunk 1
    assert fp8[0][15:] != auto[0][15:]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prefix_hit_equals_the_same_split_chunked(tiny_model, backend: str) -> None:
    """A prefix-cache hit on 32 tokens reads them from FP8 as a chunked prefill split at 32
    does: the same greedy tokens."""
    _backend(backend)
    model = tiny_model()
    prompt = PROMPTS[2][:45]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    chunked = _run(model, "fp8_e4m3", backend, [prompt], greedy, max_num_batched_tokens=32,
                   enable_prefix_caching=False)[0].outputs[0].token_ids
    llm = LLM(model=model, kv_cache_dtype="fp8_e4m3", attention_backend=backend, block_size=8,
              num_kv_blocks=64, enable_prefix_caching=True)
    try:
        llm.generate([prompt[:33]], [greedy])  # caches its first 32 tokens' 4 blocks
        hit = llm.generate([prompt], [greedy])[0]
        assert hit.num_cached_tokens == 32
        llm.engine.check_no_leaks()
    finally:
        llm.close()
    assert hit.outputs[0].token_ids == chunked
