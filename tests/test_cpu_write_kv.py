"""The CPU backend's cache write (kernels/cpu/write_kv.cpp) against the torch path: every
dtype, keys and values as strided views of one projection, padding slots skipped, a slot
outside the cache refused; and the backend's routing (the op for the cache's own dtype, the
torch path otherwise)."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_build
from pd_cluster.attention import AttentionMetadata, create_backend
from pd_cluster.attention.torch_backend import write_kv_torch

pytestmark = pytest.mark.skipif(cpu_build.disabled_by_env(), reason="PD_CLUSTER_CPU_KERNELS=0")


@pytest.fixture(autouse=True)
def _kernel_built() -> None:
    assert cpu_build.load_cpu_kernels(), f"CPU kernel failed to build: {cpu_build.load_error()}"


def _slots(tokens: int, num_slots: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    slots[1::5] = -1  # padding tokens: never written
    return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("views", [False, True])
def test_matches_torch_path(dtype: torch.dtype, views: bool) -> None:
    torch.manual_seed(0)
    cache = torch.randn(2, 9, 16, 4, 64).to(dtype)
    expected = cache.clone()
    tokens = 37
    qkv = torch.randn(tokens, 16, 64).to(dtype)  # q heads, then k, then v
    key, value = qkv[:, 8:12], qkv[:, 12:16]
    if not views:
        key, value = key.contiguous(), value.contiguous()
    slots = _slots(tokens, 9 * 16, seed=1)
    torch.ops.pd_cluster_cpu.write_kv(cache, key, value, slots)
    write_kv_torch(key, value, expected, slots)
    assert torch.equal(cache, expected)


def test_slot_outside_cache_is_refused_before_any_write() -> None:
    cache = torch.zeros(2, 4, 16, 2, 32)
    key = torch.ones(3, 2, 32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.pd_cluster_cpu.write_kv(cache, key, key, torch.tensor([0, 1, 64]))
    assert not cache.any()


def test_mismatched_dtype_is_refused() -> None:
    cache = torch.zeros(2, 4, 16, 2, 32, dtype=torch.bfloat16)
    key = torch.ones(3, 2, 32)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.pd_cluster_cpu.write_kv(cache, key, key, torch.tensor([0, 1, 2]))


def _meta(slots: torch.Tensor) -> AttentionMetadata:
    n = slots.shape[0]
    return AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.zeros(1, 4, dtype=torch.int32), num_decodes=0, max_query_len=n,
        max_seq_len=n, block_size=16, query_start_loc_cpu=[0, n], seq_lens_cpu=[n])


def test_backend_writes_through_the_op_and_other_dtypes_through_torch() -> None:
    backend = create_backend("cpu", torch.device("cpu"))
    torch.manual_seed(0)
    key, value = torch.randn(10, 2, 32).bfloat16(), torch.randn(10, 2, 32).bfloat16()
    slots = _slots(10, 4 * 16, seed=2)
    cache = torch.zeros(2, 4, 16, 2, 32, dtype=torch.bfloat16)
    expected = cache.clone()
    backend.write_kv(key, value, cache, _meta(slots))
    write_kv_torch(key, value, expected, slots)
    assert torch.equal(cache, expected)
    # A cache of another dtype than the step's K/V: converted by the torch path.
    cache32, expected32 = torch.zeros(2, 4, 16, 2, 32), torch.zeros(2, 4, 16, 2, 32)
    backend.write_kv(key, value, cache32, _meta(slots))
    write_kv_torch(key, value, expected32, slots)
    assert torch.equal(cache32, expected32)
