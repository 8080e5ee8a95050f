"""Tensor-parallel engines on the CPU (Gloo): rank 0 in the test process, rank 1 a worker.

Greedy fp32 outputs token-exact with HF for a GQA, an MQA (one KV head, replicated on both
ranks) and a biased-QKV (Qwen2) model; sampling, prompt logprobs and chunked prefill equal to
the TP1 engine; a TP size that cannot split the heads is a one-line error. Every engine ends
with a leak check and no worker process left.
"""
from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt
from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams

PROMPT_LENS = [1, 7, 16, 17, 40, 70]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SPECS: dict[str, dict[str, Any]] = {
    "llama-gqa": dict(arch="llama", num_heads=4, num_kv_heads=2),
    "mistral-mqa": dict(arch="mistral", num_heads=4, num_kv_heads=1),
    "qwen2-bias-tied": dict(arch="qwen2", num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
}


def tp_llm(model_dir: str, size: int = 2, **args: Any) -> LLM:
    return LLM(model=model_dir, tensor_parallel_size=size, num_kv_blocks=64,
               collective_timeout=20.0, **args)


def assert_closed(llm: LLM) -> None:
    llm.engine.check_no_leaks()
    workers = llm.engine.executor.workers
    llm.close()
    assert workers is not None and all(p.poll() is not None for p in workers.procs)


@pytest.mark.parametrize("spec", list(SPECS))
def test_tp2_greedy_matches_hf(tiny_model, spec: str) -> None:
    model_dir = tiny_model(**SPECS[spec])
    prompts = [random_prompt(n, seed=i) for i, n in enumerate(PROMPT_LENS)]
    # max_num_batched_tokens 32: the long prompts are prefilled in chunks beside decodes.
    llm = tp_llm(model_dir, max_num_batched_tokens=32, block_size=8)
    kv = llm.engine.runner.kv_spec
    want_heads = 1 if SPECS[spec]["num_kv_heads"] == 1 else SPECS[spec]["num_kv_heads"] // 2
    assert kv.layers[0].num_kv_heads == want_heads  # each rank caches its own heads only
    try:
        outs = llm.generate(prompts, GREEDY)
        for prompt, out in zip(prompts, outs):
            assert_greedy_matches(model_dir, prompt, out.outputs[0].token_ids,
                                  hf_greedy(model_dir, prompt, MAX_TOKENS))
    finally:
        assert_closed(llm)


def test_tp2_sampling_and_prompt_logprobs_equal_tp1(tiny_model) -> None:
    model_dir = tiny_model(**SPECS["llama-gqa"])
    prompts = [random_prompt(n, seed=7 + n) for n in (5, 30, 600)]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=8, logprobs=2,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1, ignore_eos=True,
                             repetition_penalty=1.3),
              # 600 prompt tokens: prompt logprobs in two logits chunks, big step message
              SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, ignore_eos=True)]
    with LLM(model=model_dir, num_kv_blocks=64) as ref:
        want = ref.generate(prompts, params)
    llm = tp_llm(model_dir)
    try:
        got = llm.generate(prompts, params)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert _close_logprobs(g.outputs[0].logprobs, w.outputs[0].logprobs)
            assert _close_logprobs(g.prompt_logprobs, w.prompt_logprobs)
        assert got[2].prompt_logprobs is not None and len(got[2].prompt_logprobs) == 600
    finally:
        assert_closed(llm)


def _close_logprobs(a: Any, b: Any, tol: float = 1e-4) -> bool:
    if a is None or b is None:
        return a is b
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is y
            continue
        assert set(x) == set(y)
        for k in x:
            xv = getattr(x[k], "logprob", x[k])
            yv = getattr(y[k], "logprob", y[k])
            assert abs(xv - yv) < tol, (k, xv, yv)
    return True


@pytest.mark.parametrize("args, field", [
    (dict(num_heads=6, num_kv_heads=2, hidden_size=96), "num_attention_heads=6"),
    (dict(num_heads=4, num_kv_heads=4, vocab_size=510), "vocab_size=510"),
])
def test_tp_size_that_cannot_split_the_model_is_a_one_line_error(tiny_model, args: dict,
                                                                   field: str) -> None:
    model_dir = tiny_model(arch="llama", **args)
    size = 4
    with pytest.raises(ValueError) as info:
        LLM(model=model_dir, tensor_parallel_size=size)
    msg = str(info.value)
    assert "\n" not in msg and f"tensor_parallel_size={size}" in msg and field in msg


def test_tensor_parallel_size_is_validated() -> None:
    from pd_cluster.config import EngineConfig
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="m", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="collective_timeout"):
        EngineConfig(model="m", collective_timeout=0)
