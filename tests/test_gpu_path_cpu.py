"""The GPU path's logic, run on the CPU: profile batch shape, KV budget arithmetic from a faked
memory report, the connector's device reserve, and test device pinning."""
from __future__ import annotations

import pytest
import torch

from connectors.config import MiB, KVTransferConfig
from pd_cluster.config import EngineConfig
from pd_cluster.engine.cache_engine import DeviceMemory, KVCacheSpec, determine_num_blocks
from pd_cluster.engine.model_runner import profile_batch
from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams

GiB = 1 << 30


@pytest.mark.parametrize("tokens, max_len, seqs, want", [
    (4096, 2048, 64, ([2048, 2048], 64)),   # configs/two-gpu.yaml on the built-in model
    (100, 2048, 256, ([100], 100)),
    (5000, 2048, 8, ([2048, 2048, 904], 8)),
])
def test_profile_batch_never_exceeds_the_model_positions(tokens, max_len, seqs, want) -> None:
    assert profile_batch(tokens, max_len, seqs) == want


def test_profile_forward_with_a_budget_above_max_model_len(tiny_model) -> None:
    """The CUDA profile run indexed the rotary table past the model's positions when
    max_num_batched_tokens > max_model_len; the same forward now runs (here on the CPU)."""
    model_dir = tiny_model(max_position_embeddings=64)
    llm = LLM(model=model_dir, max_num_batched_tokens=200, max_num_seqs=4, num_kv_blocks=64)
    assert llm.engine.max_model_len == 64
    llm.engine.runner.profile_forward()
    out = llm.generate([[5] * 60], SamplingParams(max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3
    llm.engine.check_no_leaks()


def test_two_engines_sharing_a_gpu_get_equal_budgets() -> None:
    """Each engine's budget counts its own weights, not the process's allocations: the second
    engine on a GPU is not charged for the first one's cache."""
    spec = KVCacheSpec.uniform(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128,
                       dtype=torch.bfloat16)
    total, weights, peak, reserve = 80 * GiB, 16 * GiB, 2 * GiB, 1 * GiB
    first = DeviceMemory(total, free=total - weights, own_bytes=weights,
                         peak_activation_bytes=peak, reserved_bytes=reserve)
    n1 = determine_num_blocks(spec, torch.device("cuda"), None, 0, 0.45, first)
    assert n1 * spec.block_bytes <= 0.45 * total - weights - peak - reserve
    assert n1 * spec.block_bytes > 0.45 * total - weights - peak - reserve - spec.block_bytes
    used = 2 * weights + n1 * spec.block_bytes  # both engines' weights, the first one's cache
    second = DeviceMemory(total, free=total - used, own_bytes=weights,
                          peak_activation_bytes=peak, reserved_bytes=reserve)
    assert determine_num_blocks(spec, torch.device("cuda"), None, 0, 0.45, second) == n1


def test_budget_is_capped_by_free_memory_and_errors_name_the_figures() -> None:
    spec = KVCacheSpec.uniform(2, 16, 2, 64, torch.float16)
    tight = DeviceMemory(total=10 * GiB, free=1 * GiB, own_bytes=0)
    assert determine_num_blocks(spec, torch.device("cuda"), None, 0, 0.9, tight) == \
        GiB // spec.block_bytes
    full = DeviceMemory(total=10 * GiB, free=GiB, own_bytes=9 * GiB, peak_activation_bytes=GiB)
    with pytest.raises(ValueError, match="no memory left.*weights 9.00 GiB.*peak activations"):
        determine_num_blocks(spec, torch.device("cuda"), None, 0, 0.9, full)


def test_nccl_buffers_and_staging_are_reserved_before_sizing() -> None:
    assert KVTransferConfig(role="consumer", pipe="zmq").device_reserve_bytes() == 0  # host
    zmq_producer = KVTransferConfig(role="producer", pipe="zmq", max_inflight_bytes=64 * MiB)
    assert zmq_producer.device_reserve_bytes() == 64 * MiB  # its pooled gather buffers
    producer = KVTransferConfig(role="producer", pipe="nccl", max_inflight_bytes=64 * MiB)
    assert producer.device_reserve_bytes() == 64 * MiB + 4 * 32 * MiB
    consumer = KVTransferConfig(role="consumer", pipe="nccl", max_staging_bytes=128 * MiB,
                                options={"extra": {"max_peers": 2}})
    assert consumer.device_reserve_bytes() == 128 * MiB + 2 * 32 * MiB


def test_tests_run_on_cpu_unless_marked_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = EngineConfig(model="m")
    assert config.torch_device == torch.device("cpu") and config.torch_dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_engines_in_one_process_on_a_gpu_get_equal_caches(tiny_model) -> None:
    """The CUDA half of the budget tests above: a real memory report and profile run,
    with configs/two-gpu.yaml's batch budget (above the model's positions)."""
    model_dir = tiny_model(max_position_embeddings=512)
    args = dict(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.15,
                max_num_batched_tokens=1024, max_num_seqs=64)
    first = LLM(model=model_dir, **args)
    second = LLM(model=model_dir, **args)
    n1, n2 = first.engine.block_manager.num_blocks, second.engine.block_manager.num_blocks
    assert n1 > 0 and abs(n1 - n2) <= 0.01 * n1, (n1, n2)
    for llm in (first, second):
        out = llm.generate([[5] * 300], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
        llm.engine.check_no_leaks()
