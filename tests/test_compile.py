"""The compiled decoder (engine.compile, issue 28): HF-exact greedy fp32 with the step run
through one torch.compile graph (attention, MoE experts and the TP all-reduce outside it as
opaque ops), for the kinds of layer that set the families apart (windows, soft-caps, sinks, two
RoPEs, MoE routings, latent attention), at TP 1, TP 2 (Gloo) and through P/D; and one graph for
every batch size (no recompile when the batch size changes, one token included).

The rest of the suite runs eager (conftest sets PD_CLUSTER_COMPILE=0); ``PD_CLUSTER_COMPILE=1``
runs any test file compiled (the family sweeps: see README). Compiled code is cached on disk
(TORCHINDUCTOR_CACHE_DIR, one dir for this module), so engines of the same model after the
first (P and D, the TP test's rank 0 after TP1) load it instead of generating it.
"""
from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

from pd_cluster.engine.compiled_model import CompiledModel, compile_enabled
from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt
from tests.pd_helpers import colocated_tokens, pd_tokens
from tests.test_families import check_greedy, family_model  # noqa: F401 (fixture)
from tests.test_mla import mla_model  # noqa: F401 (fixture)
from tests.test_moe_families import moe_model  # noqa: F401 (fixture)

# A cold compile takes tens of seconds of CPU; on a shared 2-core machine, minutes.
pytestmark = pytest.mark.timeout(900)
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One compiled-code cache for this module's engines (and their worker processes)."""
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if old is None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    yield
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_compile_setting_and_its_default() -> None:
    assert compile_enabled(True) and not compile_enabled(False)
    assert not compile_enabled(None)  # conftest: the suite's default is eager
    os.environ["PD_CLUSTER_COMPILE"] = "1"
    try:
        assert compile_enabled(None)
    finally:
        os.environ["PD_CLUSTER_COMPILE"] = "0"


def test_one_graph_for_every_batch_size(tiny_model) -> None:
    model_dir = tiny_model(arch="llama", num_layers=2)
    llm = LLM(model=model_dir, compile=True, block_size=8, max_num_batched_tokens=24)
    assert isinstance(llm.engine.runner.forward_model, CompiledModel)
    prompts = [random_prompt(n, seed=n) for n in (5, 17, 30, 41)]
    check_greedy(llm, model_dir, prompts)  # prefill chunks, mixed steps, 4..1 decodes
    before = graphs_compiled()
    # Other batch sizes and token counts, a lone one-token decode included: no new graph.
    check_greedy(llm, model_dir, [random_prompt(n, seed=n + 1) for n in (3, 9, 60)])
    check_greedy(llm, model_dir, [random_prompt(7, seed=2)])
    assert graphs_compiled() == before


def _tp1_and_tp2(model_dir: str, prompts: list[list[int]]) -> None:
    check_greedy(LLM(model=model_dir, compile=True, block_size=8, max_num_batched_tokens=12),
                 model_dir, prompts)
    llm = LLM(model=model_dir, compile=True, tensor_parallel_size=2, block_size=8,
              max_num_batched_tokens=12, num_kv_blocks=64, collective_timeout=60.0)
    try:
        check_greedy(llm, model_dir, prompts)
    finally:
        llm.close()


@pytest.mark.slow
def test_latent_attention_and_moe_tp1_tp2_and_pd(mla_model) -> None:  # noqa: F811
    """DeepSeek-V3 shaped: latent attention (its decode absorbs W_UK/W_UV outside the graph),
    sigmoid group-limited routing and a shared expert in the graph, experts as an op."""
    model_dir = mla_model("qlora-yarn")
    prompts = [random_prompt(n, seed=n) for n in (3, 13, 45)]
    _tp1_and_tp2(model_dir, prompts)
    _check_pd(model_dir, prompts)


@pytest.mark.slow
def test_softcaps_and_windows_tp1_and_tp2(family_model) -> None:  # noqa: F811
    """Gemma 2: attention and final soft-caps, sliding and global layers, split over ranks."""
    _tp1_and_tp2(family_model("tiny-gemma2"), [random_prompt(n, seed=n) for n in (3, 13, 45)])


@pytest.mark.slow
def test_sinks_and_moe_biases(moe_model) -> None:  # noqa: F811
    """gpt-oss: attention sinks, router and expert biases, clamped SwiGLU, yarn RoPE."""
    model_dir = moe_model("gpt_oss")
    check_greedy(LLM(model=model_dir, compile=True, block_size=8, max_num_batched_tokens=12),
                 model_dir, [random_prompt(n, seed=n) for n in (3, 13, 45)])


@pytest.mark.slow
def test_pd_compiled_equals_colocated_and_hf(family_model) -> None:  # noqa: F811
    """Gemma 3 (two RoPEs, windows, tied embeddings), both engines compiled (the second loads
    the first's code): KV written by P's compiled step decodes on D's, equal to HF."""
    _check_pd(family_model("tiny-gemma3"), [random_prompt(n, seed=n) for n in (4, 16, 33)])


def _check_pd(model_dir: str, prompts: list[list[int]]) -> None:
    params = [GREEDY] * len(prompts)
    ours = pd_tokens(model_dir, prompts, params, chunk=12, compile=True)
    assert ours == colocated_tokens(model_dir, prompts, params, block_size=8, compile=True)
    for prompt, tokens in zip(prompts, ours):
        assert_greedy_matches(model_dir, prompt, tokens, hf_greedy(model_dir, prompt, MAX_TOKENS))
