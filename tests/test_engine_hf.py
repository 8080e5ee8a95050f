"""Greedy outputs token-exact with Hugging Face ``generate`` (fp32).

HF runs each prompt alone; our engine runs all prompts together (continuous batching, paged KV,
chunked prefill, preemption, prefix caching), so any batching/paging bug shows up as a
divergence. A divergence is accepted only at a near-tie of HF's top-2 logits (conftest).
"""
from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import assert_greedy_matches, edit_config, hf_greedy, random_prompt
from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams

MAX_TOKENS = 20
# Around every block size tested (8/16/32): below, equal to and above a block, plus long ones.
PROMPT_LENS = [1, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 50, 64, 65, 300]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

MODEL_SPECS: dict[str, dict[str, Any]] = {
    "llama-gqa": dict(arch="llama", num_heads=4, num_kv_heads=2),
    "llama-mha-tied": dict(arch="llama", num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
    "llama-head_dim32": dict(arch="llama", num_heads=4, num_kv_heads=2, head_dim=32),
    "qwen2-gqa": dict(arch="qwen2", num_heads=4, num_kv_heads=2),
    "qwen2-mqa-tied": dict(arch="qwen2", num_heads=4, num_kv_heads=1, tie_word_embeddings=True),
    "mistral-mqa": dict(arch="mistral", num_heads=4, num_kv_heads=1),
    "mistral-mha-headdim8": dict(arch="mistral", num_heads=8, num_kv_heads=8),
}


def prompts_of(lens: list[int], seed: int = 0) -> list[list[int]]:
    return [random_prompt(n, seed=seed + i) for i, n in enumerate(lens)]


def generate_and_check(model_dir: str, prompts: list[list[int]], llm: LLM | None = None,
                       max_tokens: int = MAX_TOKENS, **engine_args: Any) -> LLM:
    """All prompts in one generate call; each compared with HF run alone."""
    if llm is None:
        llm = LLM(model=model_dir, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.finished
        comp = out.outputs[0]
        assert comp.finish_reason == "length"
        assert_greedy_matches(model_dir, prompt, comp.token_ids,
                              hf_greedy(model_dir, prompt, max_tokens))
    llm.engine.check_no_leaks()
    return llm


@pytest.mark.parametrize("spec", list(MODEL_SPECS))
def test_architectures_match_hf(tiny_model, spec: str) -> None:
    model_dir = tiny_model(**MODEL_SPECS[spec])
    llm = generate_and_check(model_dir, prompts_of(PROMPT_LENS), block_size=16)
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes_match_hf(tiny_model, block_size: int) -> None:
    model_dir = tiny_model(**MODEL_SPECS["llama-gqa"])
    llm = generate_and_check(model_dir, prompts_of(PROMPT_LENS), block_size=block_size)
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("spec, block_size", [("llama-gqa", 16), ("qwen2-mqa-tied", 8)])
def test_chunked_prefill_mixed_with_decodes(tiny_model, spec: str, block_size: int) -> None:
    model_dir = tiny_model(**MODEL_SPECS[spec])
    llm = LLM(model=model_dir, block_size=block_size, max_num_batched_tokens=16)
    sched = llm.engine.scheduler
    seen = {"mixed_steps": 0, "max_tokens": 0, "partial_prefills": 0}
    orig = sched.schedule

    def spy():
        out = orig()
        kinds = set()
        for item in out.scheduled:
            r = item.request
            if r.num_computed_tokens >= r.num_prompt_tokens:
                kinds.add("decode")
            else:
                kinds.add("prefill")
                if r.num_computed_tokens + item.num_new_tokens < r.num_prompt_tokens:
                    seen["partial_prefills"] += 1
        seen["mixed_steps"] += kinds == {"decode", "prefill"}
        seen["max_tokens"] = max(seen["max_tokens"], out.num_tokens)
        return out

    sched.schedule = spy
    generate_and_check(model_dir, prompts_of(PROMPT_LENS), llm=llm)
    assert seen["max_tokens"] <= 16
    assert seen["partial_prefills"] > 0, "no prompt was split across steps"
    assert seen["mixed_steps"] > 0, "prefill chunks never shared a step with decodes"
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("block_size, num_kv_blocks, max_batched",
                         [(8, 48, 2048), (16, 24, 32)])
def test_preemption_keeps_outputs_exact(tiny_model, block_size: int, num_kv_blocks: int,
                                        max_batched: int) -> None:
    model_dir = tiny_model(**MODEL_SPECS["llama-gqa"])
    llm = generate_and_check(model_dir, prompts_of(PROMPT_LENS), block_size=block_size,
                             num_kv_blocks=num_kv_blocks, max_num_batched_tokens=max_batched)
    assert llm.engine.stats()["num_preemptions"] > 0
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("max_batched", [2048, 24])
def test_prefix_cache_hits_keep_outputs_exact(tiny_model, max_batched: int) -> None:
    model_dir = tiny_model(**MODEL_SPECS["qwen2-gqa"])
    bs = 16
    base = random_prompt(48, seed=77)  # exactly 3 blocks: the last is always recomputed
    # Shared prefixes of 0.5 / 1 / 2 / 3 blocks with different tails and lengths.
    prompts = [base]
    for i, (keep, tail) in enumerate([(8, 9), (16, 1), (16, 20), (32, 5), (40, 30), (48, 3),
                                      (48, 16), (47, 40)]):
        prompts.append(base[:keep] + random_prompt(tail, seed=500 + i))
    llm = LLM(model=model_dir, block_size=bs, max_num_batched_tokens=max_batched)

    generate_and_check(model_dir, [base], llm=llm)  # warm the cache with the base prompt
    hits0 = llm.engine.stats()["prefix_cache_hit_blocks"]
    generate_and_check(model_dir, prompts, llm=llm)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_blocks"] > hits0

    # The same prompt again is served from cache (all but its last block) and stays exact.
    out = llm.generate([base], GREEDY)[0]
    assert out.num_cached_tokens == 32
    assert_greedy_matches(model_dir, base, out.outputs[0].token_ids,
                          hf_greedy(model_dir, base, MAX_TOKENS))

    # Multi-turn style: prompt = previous prompt + its output; blocks holding KV that was
    # written by decode steps are reused too.
    follow = base + out.outputs[0].token_ids + random_prompt(7, seed=999)
    before = llm.engine.stats()["prefix_cache_hit_blocks"]
    out2 = llm.generate([follow], GREEDY)[0]
    assert llm.engine.stats()["prefix_cache_hit_blocks"] - before == (48 + MAX_TOKENS - 1) // bs
    assert_greedy_matches(model_dir, follow, out2.outputs[0].token_ids,
                          hf_greedy(model_dir, follow, MAX_TOKENS))
    llm.engine.check_no_leaks()


def test_prefix_cache_within_one_call(tiny_model) -> None:
    """Identical prompts admitted in later steps hit blocks cached by earlier ones."""
    model_dir = tiny_model(**MODEL_SPECS["llama-gqa"])
    base = random_prompt(70, seed=3)
    prompts = [base + random_prompt(k, seed=40 + k) for k in (1, 2, 5, 9, 17)] + [base]
    llm = generate_and_check(model_dir, prompts, block_size=16, max_num_seqs=2,
                             max_num_batched_tokens=80)
    assert llm.engine.stats()["prefix_cache_hit_blocks"] > 0
    llm.engine.check_no_leaks()


def test_prefix_caching_disabled(tiny_model) -> None:
    model_dir = tiny_model(**MODEL_SPECS["llama-gqa"])
    base = random_prompt(40, seed=5)
    llm = LLM(model=model_dir, block_size=8, enable_prefix_caching=False)
    generate_and_check(model_dir, [base], llm=llm)
    generate_and_check(model_dir, [base, base[:20] + [7, 8, 9]], llm=llm)
    assert llm.engine.stats()["prefix_cache_hit_blocks"] == 0
    llm.engine.check_no_leaks()


# ---------------------------------------------------------------------------- rejected configs

def test_unsupported_architecture_is_rejected(tiny_model, tmp_path) -> None:
    src = tiny_model(**MODEL_SPECS["llama-gqa"])
    bad = edit_config(src, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=bad)


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_unimplemented_rope_type_is_rejected(tiny_model, tmp_path, key: str) -> None:
    src = tiny_model(**MODEL_SPECS["llama-gqa"])
    value = {"rope_type": "proportional", "factor": 2.0}  # an HF type not implemented here
    if key == "rope_parameters":
        value["rope_theta"] = 10000.0
    bad = edit_config(src, tmp_path / key, **{key: value})
    with pytest.raises(ValueError, match="rope_type 'proportional'"):
        LLM(model=bad)


requires_cuda = pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (Triton backend)")


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("spec", ["llama-gqa", "qwen2-mqa-tied", "mistral-mha-headdim8"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_backend_matches_hf_on_cuda(tiny_model, spec: str, block_size: int) -> None:
    """The engine's default CUDA path (Triton kernels) in fp32, against HF on the CPU."""
    model_dir = tiny_model(**MODEL_SPECS[spec])
    generate_and_check(model_dir, prompts_of(PROMPT_LENS), block_size=block_size,
                       device="cuda", dtype="float32", attention_backend="triton",
                       max_num_batched_tokens=64)
