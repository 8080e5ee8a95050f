"""The fused-MoE Triton kernel against its torch reference (``fused_experts_ref``), and the
model's own torch path (``grouped_experts``, which the kernel replaces on CUDA) against both.

Without CUDA the kernel runs in the Triton CPU interpreter (fp32, small shapes); the ``cuda``
class repeats the comparison in bf16 and fp32 on a real GPU, through the whole MoE block.
"""
import os

import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    # Must precede the first `import triton`: @triton.jit reads it to build interpreted kernels.
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402

# triton is a declared test dependency: a broken install fails here, loudly.
import triton  # noqa: E402,F401

import kernels.fused_moe as fm  # noqa: E402
from pd_cluster.models.layers.moe_experts import (ExpertsSpec, gated_activation,  # noqa: E402
                                                  grouped_experts)

if not _HAS_CUDA and not fm._INTERPRETED:  # imported earlier without the interpreter
    fm = importlib.reload(fm)

DEV = "cuda" if _HAS_CUDA else "cpu"
# (tokens, hidden, intermediate per rank, experts, top_k): ragged sizes, unused experts, one
# token, more tiles than tokens, and an expert hit by more than a tile's worth of pairs.
SHAPES = [(1, 32, 16, 4, 2), (5, 24, 40, 8, 3), (37, 48, 16, 3, 2)]


def _case(shape: tuple, dtype: torch.dtype, bias: bool, seed: int = 0) -> tuple:
    t, h, i, e, k = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if t > 8:  # pile most tokens onto expert 0: a run longer than one tile
        ids[: t - 4, 0] = 0
    weights = torch.rand(t, k, generator=g)
    b13 = torch.randn(e, 2 * i, generator=g) * 0.1 if bias else None
    b2 = torch.randn(e, h, generator=g) * 0.1 if bias else None
    to = dict(device=DEV)
    return tuple(None if v is None else (v.to(**to, dtype=dtype) if v.is_floating_point()
                                         else v.to(**to))
                 for v in (x, w13, w2, weights, ids, b13, b2))


@pytest.mark.parametrize("shape", SHAPES, ids=[f"t{s[0]}-h{s[1]}-i{s[2]}-e{s[3]}-k{s[4]}"
                                               for s in SHAPES])
@pytest.mark.parametrize("act_name, bias", [("silu", False), ("swiglu_clamped", True)])
def test_kernel_matches_torch_path(shape: tuple, act_name: str, bias: bool) -> None:
    x, w13, w2, weights, ids, b13, b2 = _case(shape, torch.float32, bias)
    act = gated_activation(ExpertsSpec(shape[3], shape[1], shape[2], act_name,
                                       swiglu_limit=1.0))
    want = fm.fused_experts_ref(x, w13, w2, weights, ids, act, b13, b2)
    got = fm.fused_experts(x, w13, w2, weights, ids, act, b13, b2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    model_path = grouped_experts(x, w13, w2, weights, ids, act, b13, b2)
    torch.testing.assert_close(model_path, want, rtol=1e-5, atol=1e-5)


def test_align_by_expert_tiles_hold_one_expert() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 0]])
    pairs, block_expert = fm.align_by_expert(ids, 4, block_m=2)
    flat = ids.reshape(-1)
    real = pairs[pairs < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))  # every pair exactly once
    for tile, e in enumerate(block_expert.tolist()):
        rows = pairs[tile * 2:(tile + 1) * 2]
        rows = rows[rows < flat.numel()]
        if e < 0:
            assert rows.numel() == 0
        else:
            assert (flat[rows] == e).all()
    assert block_expert.tolist()[:5] == [0, 0, 1, 2, 2]


@pytest.mark.cuda
@pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA GPU (the compiled kernel)")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_kernel_matches_torch_path_on_gpu(dtype: torch.dtype, tol: float) -> None:
    x, w13, w2, weights, ids, b13, b2 = _case((300, 256, 128, 16, 4), dtype, True)
    act = gated_activation(ExpertsSpec(16, 256, 128, "swiglu_clamped"))
    want = fm.fused_experts_ref(x, w13, w2, weights, ids, act, b13, b2)
    got = fm.fused_experts(x, w13, w2, weights, ids, act, b13, b2)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    model_path = grouped_experts(x, w13, w2, weights, ids, act, b13, b2)
    torch.testing.assert_close(model_path.float(), got.float(), rtol=tol, atol=tol)
