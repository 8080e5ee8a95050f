"""Long fp32/bf16/fp16 prefill chunks can go through ATen's flash kernel (attention/cpu_prefill.py),
the rest through the paged kernel: every request's rows match the torch reference whichever path
takes them, from a prompt's start and after cached context, in any order in the batch. The
flash path is taken on AMX CPUs only; these tests take it on every CPU."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_build
from pd_cluster import host_facts
from pd_cluster.attention import cpu_prefill
from pd_cluster.attention.options import AttentionOptions
from tests.test_cpu_attention import check, make_batch

pytestmark = pytest.mark.skipif(cpu_build.disabled_by_env(), reason="PD_CLUSTER_CPU_KERNELS=0")

N = cpu_prefill.MIN_QUERY_TOKENS


@pytest.fixture(autouse=True)
def flash_everywhere(monkeypatch):
    monkeypatch.setattr(cpu_prefill, "flash_pays", lambda dtype: True)
# decodes, then: long from scratch, short after a prefix, long after a prefix, long (one block)
MIXED_LONG = ([1, 1, N + 37, 5, N, 2 * N + 3], [40, 700, N + 37, 90, N + 500, 2 * N + 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("hq,hkv,d,block_size", [(8, 4, 64, 16), (4, 4, 128, 5), (7, 1, 64, 32),
                                                 (4, 2, 40, 16)],
                         ids=["gqa", "mha-bs5", "mqa7-bs32", "d40"])
def test_long_chunks_match_reference(dtype, hq, hkv, d, block_size) -> None:
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    check(*MIXED_LONG, hq=hq, hkv=hkv, d=d, block_size=block_size, dtype=dtype, atol=atol)


def test_only_long_chunks_and_only_one_request() -> None:
    check([N], [N], hq=8, hkv=4, d=64, dtype=torch.bfloat16, atol=2e-2)
    check([N + 1, 3 * N], [N + 300, 3 * N], hq=8, hkv=4, d=64, dtype=torch.bfloat16, atol=2e-2)


@pytest.mark.parametrize("variant", [{"sliding_window": 50}, {"logit_softcap": 30.0},
                                     {"sinks": True}], ids=["window", "softcap", "sinks"])
def test_variants_stay_on_the_paged_kernel(variant) -> None:
    check(*MIXED_LONG, hq=8, hkv=4, d=64, dtype=torch.bfloat16, atol=2e-2, **variant)


def test_which_path_takes_what() -> None:
    meta = make_batch(*MIXED_LONG, 16, 200)
    assert [cpu_prefill.is_long(meta, i) for i in range(6)] == [False, False, True, False,
                                                                 True, True]
    q = torch.zeros(3, 8, 64, dtype=torch.bfloat16)
    kc = torch.zeros(4, 16, 4, 64, dtype=torch.bfloat16)
    assert cpu_prefill.applies(q, kc, kc, AttentionOptions(scale=0.1))
    assert cpu_prefill.applies(q.float(), kc.float(), kc.float(), AttentionOptions(scale=0.1))
    assert not cpu_prefill.applies(q.float(), kc, kc, AttentionOptions(scale=0.1))  # mixed
    assert not cpu_prefill.applies(q, kc, kc, AttentionOptions(scale=0.1, sliding_window=8))
    assert not cpu_prefill.applies(q, kc, kc[..., :32], AttentionOptions(scale=0.1))


def test_the_flash_path_is_taken_for_half_precision_on_amx_cpus_only(monkeypatch) -> None:
    monkeypatch.undo()  # the real rule, not the fixture's
    for flags, half, fp32 in ((frozenset({"avx512f", "amx_tile", "amx_bf16"}), True, False),
                              (frozenset({"avx512f", "avx512_bf16"}), False, False),
                              (frozenset(), False, False)):
        monkeypatch.setattr(host_facts, "cpu_flags", lambda flags=flags: flags)
        assert cpu_prefill.flash_pays(torch.bfloat16) is half, flags
        assert cpu_prefill.flash_pays(torch.float16) is half, flags
        assert cpu_prefill.flash_pays(torch.float32) is fp32, flags
