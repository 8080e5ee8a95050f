"""The C++ kernels on several threads, as engines run them (conftest pins the suite to one):
the paged attention splits its work items over ATen's pool (at::parallel_for), oneDNN its
GEMM. At 1 and 4 threads each case matches the torch reference, and the attention's output is
the same bits at both (each item is computed whole by one thread: a race or a shared buffer
would show here)."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_build
from pd_cluster.attention import AttentionOptions, create_backend
from pd_cluster.attention.torch_backend import TorchAttentionBackend
from tests.test_cpu_attention import make_batch

pytestmark = pytest.mark.skipif(cpu_build.disabled_by_env(), reason="PD_CLUSTER_CPU_KERNELS=0")


@pytest.fixture(autouse=True)
def _kernel_built() -> None:
    assert cpu_build.load_cpu_kernels(), f"CPU kernel failed to build: {cpu_build.load_error()}"


@pytest.fixture(params=[1, 4], ids=["1-thread", "4-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        assert torch.get_num_threads() == request.param
        yield request.param
    finally:
        torch.set_num_threads(before)


# (q_lens, seq_lens, heads q/kv, head dim, options): a decode batch, prefill from scratch and
# after a prefix (more than one tile), a sliding window, GQA on the AVX-512 shapes.
CASES = {
    "decode-batch": ([1] * 12, [1, 17, 40, 100, 33, 700, 5, 64, 9, 300, 2, 150], 8, 2, 32, {}),
    "prefill": ([70, 45, 3], [70, 90, 50], 4, 2, 64, {}),
    "window": ([1, 1, 40, 9], [600, 17, 40, 300], 8, 4, 64, {"sliding_window": 20}),
    "gqa": ([1, 1, 1, 40, 9], [1300, 600, 17, 40, 700], 8, 2, 128, {}),
    "gqa-bf16": ([1, 1, 3, 30], [900, 64, 50, 30], 8, 2, 64, {"dtype": torch.bfloat16}),
}


def _run(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    q_lens, seq_lens, hq, hkv, d, opt = CASES[case]
    opt = dict(opt)
    dtype = opt.pop("dtype", torch.float32)
    torch.manual_seed(0)
    bs = 16
    num_blocks = sum(-(-s // bs) for s in seq_lens) + 3
    meta = make_batch(q_lens, seq_lens, bs, num_blocks)
    cache = torch.randn(2, num_blocks, bs, hkv, d).to(dtype)
    query = torch.randn(sum(q_lens), hq, d).to(dtype)
    opts = AttentionOptions(scale=d ** -0.5, **opt)
    got = create_backend("cpu", torch.device("cpu")).forward(query, cache, meta, opts)
    ref = TorchAttentionBackend().forward(query, cache, meta, opts)
    return got, ref


@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_reference(case: str, threads: int) -> None:
    got, ref = _run(case)
    atol = 2e-2 if got.dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=1e-3)


@pytest.mark.parametrize("case", list(CASES))
def test_attention_same_bits_at_1_and_4_threads(case: str) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _run(case)
        torch.set_num_threads(4)
        four, _ = _run(case)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, four)


def test_onednn_linear_op(threads: int) -> None:
    """The C++-registered packed GEMM (compiled steps' linears) against F.linear, at sizes
    oneDNN splits over threads."""
    torch.manual_seed(0)
    x, w, b = torch.randn(64, 256), torch.randn(512, 256) * 0.1, torch.randn(512)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    got = torch.ops.pd_cluster_cpu.onednn_linear(x, packed, b, 512)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="packed weight has 512 outputs, the layer 100"):
        torch.ops.pd_cluster_cpu.onednn_linear(x, packed, b, 100)
