"""CPU weight preparation for the linear layers (models/layers/cpu_gemm.py): every layout
computes the same linears as ``F.linear`` on the loaded weight (biases, row-parallel, the LM
head), a tied head keeps the embedding's lookup, the mode resolves from config or env, and
engines on the packed layout stay HF-exact in fp32: eager, compiled (the packed GEMM is an
opaque op in the graph) and at TP 2 (Gloo). The auto layouts (fp32 transposed) run under every
other engine test of the suite.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pd_cluster import host_facts
from pd_cluster.config import EngineArgs
from pd_cluster.llm import LLM
from pd_cluster.models.layers import cpu_gemm
from pd_cluster.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pd_cluster.models.layers.linear import QKVParallelLinear, RowParallelLinear
from pd_cluster.sampling_params import SamplingParams
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt

CPU = torch.device("cpu")
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


class _Block(nn.Module):
    """The kinds of linear a decoder holds, with biases, and a (tied or untied) head."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(96, 32)
        self.qkv = QKVParallelLinear(32, 8, 4, 2, bias=True)
        self.o = RowParallelLinear(32, 32, bias=True)
        self.head = ParallelLMHead(96, 32)
        if tied:
            self.head.tie_to(self.embed)
        for p in self.parameters():
            p.data.normal_(0, 0.2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(self.o(self.qkv(x)[:, :32]))


def _reference(block: _Block, ids: torch.Tensor) -> torch.Tensor:
    """The same block through F.linear on the loaded (unprepared) weights."""
    x = F.embedding(ids, block.embed.weight)
    h = F.linear(x, block.qkv.weight, block.qkv.bias)[:, :32]
    return F.linear(F.linear(h, block.o.weight, block.o.bias), block.head.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["transposed", "packed", "upcast"])
@pytest.mark.parametrize("tied", [False, True])
def test_every_layout_computes_the_loaded_linears(dtype: torch.dtype, layout: str,
                                                  tied: bool) -> None:
    if layout == "upcast" and dtype == torch.float32:
        assert cpu_gemm.layout_for(dtype, "upcast") in ("packed", "torch")  # nothing to upcast
        return
    if layout != "transposed" and cpu_gemm.layout_for(dtype, layout) != layout:
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    torch.manual_seed(0)
    block = _Block(tied).to(dtype)
    ids = torch.randint(0, 96, (7,))
    with torch.inference_mode():
        want = _reference(block, ids)
        assert cpu_gemm.prepare_model(block, dtype, CPU, layout) == layout
        got = block(ids)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(got, want, **tol)
    if layout == "transposed":
        assert block.qkv.weight.stride() == (1, block.qkv.weight.shape[0])
        assert block.head.packed is None
    else:
        want_packed = torch.float32 if layout == "upcast" else dtype
        assert block.qkv.packed.dtype == want_packed and got.dtype == dtype
        assert block.qkv.packed is not None and block.qkv.weight.is_meta  # one copy only
        # A tied head stays the embedding's dense tensor (the lookup needs its rows).
        assert (block.head.packed is None) == tied
    assert not block.embed.weight.is_meta
    assert (block.embed.weight.stride()[0] == 1) == (tied and layout == "transposed")


def test_upcast_is_the_bf16_gemm_with_fp32_sums() -> None:
    """upcast: bf16 inputs and weights, the products summed in fp32, the output rounded to
    bf16 once, as a bf16 GEMM with fp32 accumulation computes it."""
    if cpu_gemm.layout_for(torch.bfloat16, "upcast") != "upcast":
        pytest.skip("oneDNN cannot pack fp32 on this CPU")
    torch.manual_seed(0)
    layer = RowParallelLinear(256, 48, bias=True).to(torch.bfloat16)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(9, 256, dtype=torch.bfloat16)
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(torch.bfloat16)
    cpu_gemm.pack(layer, torch.float32)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    # fp32 sums in another order: at most one bf16 rounding step apart
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=8e-3)


def test_auto_upcasts_bf16_only_where_the_cpu_lacks_a_bf16_dot_product(monkeypatch) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    cases = {frozenset({"avx512f", "avx512_bf16"}): "packed",
             frozenset({"avx512f", "amx_bf16"}): "packed",
             frozenset({"avx512f", "avx512_vnni"}): "upcast",
             frozenset(): "packed"}  # flags unknown: as before
    for flags, want in cases.items():
        monkeypatch.setattr(host_facts, "cpu_flags", lambda flags=flags: flags)
        if want == "packed" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            want = "torch"
        assert cpu_gemm.layout_for(torch.bfloat16, "auto") == want, flags
        assert cpu_gemm.layout_for(torch.float16, "auto") == "torch"


def test_auto_packs_fp32_where_mkl_runs_its_generic_path(monkeypatch) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    for vendor, want in (("GenuineIntel", "transposed"), ("", "transposed"),
                         ("AuthenticAMD", "packed")):
        monkeypatch.setattr(host_facts, "cpu_vendor", lambda vendor=vendor: vendor)
        assert cpu_gemm.layout_for(torch.float32, "auto") == want, vendor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_registered_packed_op_equals_the_aten_one(dtype: torch.dtype) -> None:
    """What a compiled step calls (kernels/cpu/onednn_linear.cpp) is oneDNN's own GEMM, bit for
    bit, with and without a bias; a wrong output size is an error, not a silent reshape."""
    from kernels.cpu_build import load_cpu_kernels
    if cpu_gemm.layout_for(dtype, "packed") != "packed" or not load_cpu_kernels():
        pytest.skip("no packed GEMM or no CPU kernels here")
    torch.manual_seed(0)
    w, b, x = torch.randn(48, 64, dtype=dtype), torch.randn(48, dtype=dtype), torch.randn(
        5, 64, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    for bias in (b, None):
        want = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        assert torch.equal(torch.ops.pd_cluster_cpu.onednn_linear(x, packed, bias, 48), want)
    with pytest.raises(RuntimeError, match="the packed weight has 48 outputs, the layer 47"):
        torch.ops.pd_cluster_cpu.onednn_linear(x, packed, None, 47)
    layer = RowParallelLinear(64, 48)
    cpu_gemm.pack(layer)
    assert layer.packed_cpp  # the compiled step's choice


def test_mode_from_config_or_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_gemm.CPU_GEMM_ENV, raising=False)
    assert cpu_gemm.resolve_mode(None) == "auto"
    monkeypatch.setenv(cpu_gemm.CPU_GEMM_ENV, "torch")
    assert cpu_gemm.resolve_mode(None) == "torch" and cpu_gemm.resolve_mode("packed") == "packed"
    monkeypatch.setenv(cpu_gemm.CPU_GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="cpu_gemm"):
        cpu_gemm.resolve_mode(None)
    with pytest.raises(ValueError, match="cpu_gemm"):
        EngineArgs(cpu_gemm="fast")
    assert cpu_gemm.layout_for(torch.float32, "auto") in ("transposed", "packed")  # the CPU
    assert cpu_gemm.layout_for(torch.float16, "auto") == "torch"
    assert cpu_gemm.layout_for(torch.bfloat16, "auto") in ("packed", "upcast", "torch")
    block = _Block(tied=False)
    assert cpu_gemm.prepare_model(block, torch.float32, torch.device("cuda"), "packed") == "torch"
    assert block.qkv.packed is None and block.qkv.weight.is_contiguous()  # CUDA: as loaded


def _check_hf_exact(model_dir: str, **engine_args: object) -> None:
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 40)]
    with LLM(model=model_dir, num_kv_blocks=64, block_size=8, **engine_args) as llm:
        layer = llm.engine.runner.model.model.layers[0]
        assert layer.self_attn.qkv_proj.packed is not None
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
            assert_greedy_matches(model_dir, prompt, out.outputs[0].token_ids,
                                  hf_greedy(model_dir, prompt, MAX_TOKENS))
        llm.engine.check_no_leaks()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("engine_args", [{}, {"compile": True}, {"tensor_parallel_size": 2}],
                         ids=["eager", "compiled", "tp2"])
def test_packed_engine_is_hf_exact(tiny_model, engine_args: dict) -> None:
    model_dir = tiny_model(arch="qwen2", num_heads=4, num_kv_heads=2)  # biased QKV
    _check_hf_exact(model_dir, cpu_gemm="packed", collective_timeout=20.0, **engine_args)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_a_bf16_engine_on_upcast_weights_serves_from_fp32_packed_linears(tiny_model) -> None:
    """The upcast layout in an engine (eager and compiled: the conversions around the packed
    GEMM are traced): fp32 packed weights, the same first greedy token from both steps,
    nothing leaked."""
    model_dir = tiny_model(arch="qwen2", num_heads=4, num_kv_heads=2)  # biased QKV
    prompts = [random_prompt(n, seed=n) for n in (1, 9, 40)]
    firsts = []
    for compile_ in (False, True):
        with LLM(model=model_dir, dtype="bfloat16", num_kv_blocks=64, block_size=8,
                 cpu_gemm="upcast", compile=compile_) as llm:
            runner = llm.engine.runner
            qkv = runner.model.model.layers[0].self_attn.qkv_proj
            assert qkv.packed.dtype == torch.float32 and qkv.weight.is_meta
            outs = llm.generate(prompts, GREEDY)
            assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
            firsts.append([o.outputs[0].token_ids[0] for o in outs])
            llm.engine.check_no_leaks()
    assert firsts[0] == firsts[1]
