"""P/D for the new families: a producer prefills (in chunks smaller than the window), streams
each layer's KV to the consumer, which decodes; the tokens equal the colocated engine's, and
greedy ones equal HF's. Qwen3 (q/k norm) and Gemma 3 (sliding and global layers with their own
RoPE, soft-capping none, tied embeddings)."""
from __future__ import annotations

import pytest

from pd_cluster import SamplingParams
from pd_cluster.checkpoints.maker import PRESETS, make_model
from tests.conftest import assert_greedy_matches, hf_greedy
from tests.pd_helpers import colocated_tokens, pd_tokens
from tests.conftest import random_prompt

MAX_TOKENS = 10


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-gemma3"])
def test_pd_equals_colocated_and_hf(tmp_path_factory, name: str) -> None:
    model = str(make_model(tmp_path_factory.mktemp("pd") / name, **PRESETS[name]))
    prompts = [random_prompt(n, seed=n) for n in (4, 15, 16, 33, 70)]  # around window 16
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [greedy if i % 2 == 0 else SamplingParams(temperature=0.8, seed=i,
                                                       max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    ours = pd_tokens(model, prompts, params, chunk=12)
    assert ours == colocated_tokens(model, prompts, params, block_size=8)
    for prompt, tokens, sp in zip(prompts, ours, params):
        if sp is greedy:
            assert_greedy_matches(model, prompt, tokens, hf_greedy(model, prompt, MAX_TOKENS))
