"""Tensor parallelism on two GPUs (NCCL between the ranks): a TP2 engine greedy-exact with HF
in fp32, and a TP2 prefill engine feeding a TP1 decode engine (KV head slices over ZMQ with
pinned host staging) equal to one TP1 engine. Skipped without two GPUs; scripts/gpu_check.sh
runs them (and bench_offline --tensor-parallel-size 2, and a P TP2 -> D TP1 cluster)."""
from __future__ import annotations

import pytest

from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt
from tests.pd_helpers import colocated_tokens, engine, run_in_process, submit_pair
from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams


def _gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = [pytest.mark.two_gpu,
              pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs (one per rank)")]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
FP32 = dict(device="cuda", dtype="float32", num_kv_blocks=256)


def test_tp2_engine_on_two_gpus_matches_hf(tiny_model) -> None:
    model_dir = tiny_model(arch="llama", num_heads=4, num_kv_heads=2)
    prompts = [random_prompt(n, seed=n) for n in (3, 17, 90, 300)]
    with LLM(model=model_dir, tensor_parallel_size=2, **FP32) as llm:
        assert llm.engine.runner.device.type == "cuda"
        for prompt, out in zip(prompts, llm.generate(prompts, PARAMS)):
            assert_greedy_matches(model_dir, prompt, out.outputs[0].token_ids,
                                  hf_greedy(model_dir, prompt, PARAMS.max_tokens))
        llm.engine.check_no_leaks()


def test_tp2_prefill_to_tp1_decode_on_gpus(tiny_model) -> None:
    model_dir = tiny_model(arch="llama", num_heads=4, num_kv_heads=2)
    prompts = [random_prompt(n, seed=n) for n in (5, 33, 200)]
    want = colocated_tokens(model_dir, prompts, [PARAMS] * len(prompts), **FP32)
    p = engine(model_dir, "producer", tensor_parallel_size=2, **FP32)
    d = engine(model_dir, "consumer", **FP32)
    try:
        endpoint = d.kv_endpoint()
        for i, prompt in enumerate(prompts):
            submit_pair(p, d, f"r{i}", prompt, PARAMS, endpoint)
        done = run_in_process(p, d)
        assert [done[f"r{i}"] for i in range(len(prompts))] == want
        assert d.stats()["kv_bytes_received"] > 0 and d.stats()["kv_fallbacks"] == 0
        d.check_no_leaks()
    finally:
        p.close()
        d.close()
