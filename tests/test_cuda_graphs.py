"""CUDA graphs for decode (engine.cuda_graphs, issue 28): the batch-size ladder (CPU), and on a
GPU the replayed decode steps HF-exact and equal to launching op by op, compiled and eager."""
from __future__ import annotations

import pytest
import torch

from pd_cluster.engine.cuda_graphs import batch_ladder
from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt

MAX_TOKENS = 12


def test_ladder_covers_every_batch_size_up_to_the_limit() -> None:
    assert batch_ladder(1) == [1]
    assert batch_ladder(6) == [1, 2, 4, 6]
    ladder = batch_ladder(200)
    assert ladder[:5] == [1, 2, 4, 8, 16] and ladder[-1] == 200
    assert all(b - a <= 16 for a, b in zip(ladder, ladder[1:]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile", [False, True])
def test_decode_replays_graphs_hf_exact(tiny_model, compile: bool) -> None:
    model_dir = tiny_model(arch="qwen2", num_layers=2)
    prompts = [random_prompt(n, seed=n) for n in (3, 13, 26, 45, 70)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = {}
    for graphs in (True, False):
        llm = LLM(model=model_dir, device="cuda", dtype="float32", attention_backend="triton",
                  compile=compile, cuda_graphs=graphs, max_num_seqs=8, block_size=16)
        runner = llm.engine.runner
        assert (runner.decode_graphs is not None) == graphs
        runs[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if graphs:  # every step after the prefills decoded from a graph (5, 4, ... rows)
            assert runner.decode_graphs.replays >= MAX_TOKENS - 2
        llm.engine.check_no_leaks()
        llm.close()
    assert runs[True] == runs[False]
    for prompt, tokens in zip(prompts, runs[True]):
        assert_greedy_matches(model_dir, prompt, tokens, hf_greedy(model_dir, prompt, MAX_TOKENS))
