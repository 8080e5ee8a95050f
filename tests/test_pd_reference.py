"""P/D against references outside the engine: HF transformers for greedy output, and a seeded
sampler written here from the engine's documented contract (not the engine's Sampler).

Every other P/D test compares P/D with the colocated engine, which shares the sampler, stop
handling and model code with P/D: a bug in those passes all of them. These do not.
"""
from __future__ import annotations

import pytest
import torch

from pd_cluster import SamplingParams
from tests.conftest import assert_greedy_matches, hf_greedy, hf_model
from tests.pd_helpers import pd_tokens, prompts_of_lengths

MAX_TOKENS = 12
# Prompt lengths around the block size (8) and P's chunk (24 tokens per step): P prefills in
# chunks and ships every layer's blocks, D decodes the rest.
LENGTHS = [1, 7, 8, 9, 23, 40]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pd_greedy_equals_hf(tiny_model, arch: str) -> None:
    model = tiny_model(arch=arch)
    prompts = prompts_of_lengths(LENGTHS)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = pd_tokens(model, prompts, [greedy] * len(prompts), chunk=24)
    for prompt, ours in zip(prompts, got):
        assert_greedy_matches(model, prompt, ours, hf_greedy(model, prompt, MAX_TOKENS))


# ---- a reference sampler (the contract in pd_cluster/engine/sampler.py and request.py) -------
# Token i of a seeded request is drawn with torch.multinomial from a generator seeded with
# (seed * 0x9E3779B97F4A7C15 + i) mod 2**63, over softmax(logits / temperature) after top-k
# (the k largest) and top-p (the smallest prefix, in descending order, whose mass reaches
# top_p; ties in vocabulary order), the draw made over the descending order when a filter is
# on, and over the vocabulary order when not.
def _reference_token(logits: torch.Tensor, sp: SamplingParams, i: int) -> int:
    gen = torch.Generator().manual_seed((sp.seed * 0x9E3779B97F4A7C15 + i) % (1 << 63))
    scaled = logits.double() / sp.temperature
    vocab = scaled.numel()
    if sp.top_p >= 1.0 and not 0 < sp.top_k < vocab:
        return int(torch.multinomial(torch.softmax(scaled, -1).float(), 1, generator=gen))
    values, order = torch.sort(scaled, descending=True, stable=True)
    k = sp.top_k if 0 < sp.top_k < vocab else vocab
    probs = torch.softmax(values[:k], -1)
    keep = 1
    while keep < k and float(probs[:keep].sum()) < sp.top_p:
        keep += 1
    kept = torch.zeros(vocab, dtype=torch.float32)
    kept[:keep] = torch.softmax(values[:keep], -1).float()
    return int(order[int(torch.multinomial(kept, 1, generator=gen))])


def _reference_sample(model: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    """HF's fp32 logits at each step, sampled by the reference sampler above."""
    out: list[int] = []
    hf = hf_model(model)
    with torch.inference_mode():
        for i in range(sp.max_tokens):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
            out.append(_reference_token(logits, sp, i))
    return out


def test_pd_seeded_sampling_equals_a_reference_sampler(tiny_model) -> None:
    model = tiny_model()
    prompts = prompts_of_lengths([5, 17, 30, 12])
    params = [SamplingParams(temperature=0.5, seed=11, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=2.0, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=12345, max_tokens=12, ignore_eos=True,
                             top_p=0.9),
              SamplingParams(temperature=0.7, seed=3, max_tokens=12, ignore_eos=True, top_k=20)]
    for prompt, sp, ours in zip(prompts, params, pd_tokens(model, prompts, params, chunk=24)):
        assert ours == _reference_sample(model, prompt, sp), sp
