"""Prompt logprobs (what echo + logprobs shows, lm-eval's loglikelihood) equal HF's
log-softmax in fp32, however the prompt is chunked, cached or batched."""
from __future__ import annotations

import pytest
import torch

from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams
from tests.conftest import random_prompt


def hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p scores prompt token p + 1."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check(model_dir: str, prompt: list[int], got: list[dict[int, float] | None], k: int) -> None:
    want = hf_prompt_logprobs(model_dir, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for p, entry in enumerate(got[1:]):
        token = prompt[p + 1]
        assert entry is not None and abs(entry[token] - want[p, token].item()) < 1e-4
        top = set(want[p].topk(k).indices.tolist())
        assert len(entry) in (k, k + 1) and top <= set(entry) | _near_ties(want[p], k)
        for t, lp in entry.items():
            assert abs(lp - want[p, t].item()) < 1e-4


def _near_ties(row: torch.Tensor, k: int) -> set[int]:
    """Tokens tied with the k-th best within 1e-4 (either may be listed)."""
    if k == 0:
        return set()
    kth = row.topk(k).values[-1]
    return set(torch.nonzero((row - kth).abs() < 1e-4).flatten().tolist())


@pytest.mark.parametrize("max_batched", [16, 512])
def test_prompt_logprobs_match_hf(tiny_model, max_batched: int) -> None:
    model_dir = tiny_model()
    llm = LLM(model=model_dir, max_num_batched_tokens=max_batched, block_size=8,
              num_kv_blocks=256)
    prompts = [random_prompt(n, seed=n) for n in (1, 2, 9, 40)]
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    # Twice: the second round would hit the prefix cache, which these requests must bypass.
    for _ in range(2):
        outs = llm.generate(prompts, params)
        for prompt, out in zip(prompts, outs):
            check(model_dir, prompt, out.prompt_logprobs, 2)
            assert out.num_cached_tokens == 0
    plain = llm.generate(prompts[3], SamplingParams(temperature=0, max_tokens=3))[0]
    assert plain.prompt_logprobs is None
    llm.engine.check_no_leaks()


def test_prompt_logprobs_survive_preemption(tiny_model) -> None:
    """A preempted request recomputes its prompt from 0; its logprobs are reported once."""
    model_dir = tiny_model()
    llm = LLM(model=model_dir, max_num_batched_tokens=16, block_size=8, num_kv_blocks=8)
    prompts = [random_prompt(20, seed=s) for s in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, prompt_logprobs=0,
                                                ignore_eos=True))
    assert llm.engine.stats()["num_preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        check(model_dir, prompt, out.prompt_logprobs, 0)
    llm.engine.check_no_leaks()


def test_prompt_logprobs_is_validated() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=True)
