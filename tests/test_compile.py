"""The compiled decoder (engine.compile, issue 28): HF-exact greedy fp32 with the step run
through one torch.compile graph (attention, MoE experts and the TP all-reduce outside it as
opaque ops), one graph for every batch size (no recompile when the batch size changes, one
token included).

The rest of the suite runs eager (conftest sets PD_CLUSTER_COMPILE=0); ``PD_CLUSTER_COMPILE=1``
runs any test file compiled (the family sweeps: see README). Compiled code is cached on disk
(TORCHINDUCTOR_CACHE_DIR, one dir for this module).
"""
from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

from pd_cluster.engine.compiled_model import CompiledModel, compile_enabled
from pd_cluster.llm import LLM
from tests.conftest import random_prompt
from tests.test_families import check_greedy


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
