"""The compiled decoder (engine.compile, issue 28): HF-exact greedy fp32 with the step run
through one torch.compile graph (attention, MoE experts and the TP all-reduce outside it as
opaque ops), for the kinds of layer that set the families apart (windows, soft-caps, sinks, two
RoPEs, MoE routings, latent attention), at TP 1, TP 2 (Gloo) and through P/D; and one graph for
every batch size (no recompile when the batch size changes, one token included).

The rest of the suite runs eager (conftest sets PD_CLUSTER_COMPILE=0); ``PD_CLUSTER_COMPILE=1``
runs any test file compiled (the family sweeps: see README). Compiled models are cached on disk
(under TORCHINDUCTOR_CACHE_DIR, one dir for this module), so engines of the same model after
the first (P and D, the TP test's rank 0 after TP1) load them instead of compiling again.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pd_cluster.engine.compile_cache import artifact_dir
from pd_cluster.engine.compiled_model import CompiledModel, compile_enabled
from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt
from tests.pd_helpers import colocated_tokens, pd_tokens
from tests.test_families import check_greedy, family_model  # noqa: F401 (fixture)
from tests.test_mla import mla_model  # noqa: F401 (fixture)
from tests.test_moe_families import moe_model  # noqa: F401 (fixture)

# A cold compile takes tens of seconds of CPU; on a shared 2-core machine, minutes. This
# module's engines (and their worker processes) compile into a fresh compiled-code cache.
pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("fresh_inductor_cache")]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def compiled(llm: LLM) -> CompiledModel:
    model = llm.engine.runner.forward_model
    assert isinstance(model, CompiledModel)
    return model


def test_compile_setting_and_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert compile_enabled(True) and not compile_enabled(False)
    assert not compile_enabled(None)  # conftest: the suite's default is eager
    monkeypatch.setenv("PD_CLUSTER_COMPILE", "1")
    assert compile_enabled(None)
    monkeypatch.delenv("PD_CLUSTER_COMPILE")
    assert compile_enabled(None, "cpu")  # a user's default on CPUs: on
    assert not compile_enabled(None, "cuda")  # not measured on GPUs yet
    assert compile_enabled(True, "cuda")


def test_one_graph_for_every_batch_size_and_a_restart_loads_it(
        tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = tiny_model(arch="llama", num_layers=2)
    llm = LLM(model=model_dir, compile=True, block_size=8, max_num_batched_tokens=24)
    prompts = [random_prompt(n, seed=n) for n in (5, 17, 30, 41)]
    check_greedy(llm, model_dir, prompts)  # prefill chunks, mixed steps, 4..1 decodes
    # Other batch sizes and token counts, a lone one-token decode included: all compiled.
    check_greedy(llm, model_dir, [random_prompt(n, seed=n + 1) for n in (3, 9, 60)])
    check_greedy(llm, model_dir, [random_prompt(7, seed=2)])
    assert compiled(llm).compiled_steps > 10 and compiled(llm).eager_steps == 0
    assert compiled(llm).path.is_file()
    # The next engine of this model (a restart) loads the artifact: it never compiles.
    monkeypatch.setattr(CompiledModel, "_compile", lambda *a: pytest.fail("compiled again"))
    again = LLM(model=model_dir, compile=True, block_size=8, max_num_batched_tokens=24)
    check_greedy(again, model_dir, prompts[:2])
    assert compiled(again).path == compiled(llm).path and compiled(again).eager_steps == 0


def test_packed_weights_compile_and_load(tiny_model) -> None:
    """cpu_gemm.py's oneDNN-packed weights (an opaque tensor, the dense one left on the meta
    device) in a saved graph: HF-exact, every step compiled, and a restart loads it."""
    model_dir = tiny_model(arch="llama", num_layers=2)
    for _ in range(2):  # compiles, then loads
        llm = LLM(model=model_dir, compile=True, cpu_gemm="packed", block_size=8)
        check_greedy(llm, model_dir, [random_prompt(n, seed=n) for n in (4, 21)])
        assert compiled(llm).compiled_steps and not compiled(llm).eager_steps


def test_a_stale_artifact_is_compiled_again(tiny_model, caplog: pytest.LogCaptureFixture
                                            ) -> None:
    model_dir = tiny_model(arch="qwen2", num_layers=1)
    first = compiled(LLM(model=model_dir, compile=True, block_size=8))
    first.path.write_bytes(b"not an artifact")  # a torn write, another torch's pickle
    llm = LLM(model=model_dir, compile=True, block_size=8)
    assert "not usable" in caplog.text
    check_greedy(llm, model_dir, [random_prompt(9, seed=1)])
    assert compiled(llm).compiled_steps and not compiled(llm).eager_steps
    assert compiled(llm).path.read_bytes() != b"not an artifact"


def test_compiled_code_lives_in_the_project_cache(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Unless the user chose a dir: inductor's own default (set by importing it) is a temp dir."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from pd_cluster.engine.compile_cache import inductor_cache_dir
    monkeypatch.setenv("PD_CLUSTER_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert inductor_cache_dir() == tmp_path / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")  # children too
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert inductor_cache_dir() == tmp_path / "mine"


def test_the_key_covers_dtype_rank_and_shapes(tiny_model) -> None:
    import json
    from pathlib import Path

    from pd_cluster.engine.compile_cache import artifact_key
    from pd_cluster.models.layers.cpu_gemm import transpose_in_place
    from pd_cluster.models.loader import load_model
    model_dir = tiny_model(arch="llama", num_layers=1)
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    cpu = torch.device("cpu")

    def key(dtype: torch.dtype, rank: int = 0, size: int = 1, **config: int) -> str:
        m = load_model(model_dir, {**hf, **config}, dtype, cpu)
        return artifact_key(m.model, m.spec, rank, size, cpu)

    base = key(torch.float32)
    assert base == key(torch.float32)
    assert len({base, key(torch.bfloat16), key(torch.float32, 1, 2),
                key(torch.float32, rms_norm_eps=1e-3)}) == 4
    # A weight layout (cpu_gemm's transposed storage: same shape, other strides) is a new key.
    m = load_model(model_dir, hf, torch.float32, cpu)
    transpose_in_place(m.model.layers[0].mlp.down_proj.weight)
    assert artifact_key(m.model, m.spec, 0, 1, cpu) != base


def _tp1_and_tp2(model_dir: str, prompts: list[list[int]]) -> None:
    tp1 = LLM(model=model_dir, compile=True, block_size=8, max_num_batched_tokens=12)
    check_greedy(tp1, model_dir, prompts)
    assert compiled(tp1).compiled_steps and not compiled(tp1).eager_steps
    cached = artifacts()
    llm = LLM(model=model_dir, compile=True, tensor_parallel_size=2, block_size=8,
              max_num_batched_tokens=12, num_kv_blocks=64, collective_timeout=60.0)
    try:
        check_greedy(llm, model_dir, prompts)
    finally:
        llm.close()
    assert len(artifacts() - cached) == 2  # each rank compiled its slice (and kept it)


def artifacts() -> set[Path]:
    return set(artifact_dir().glob("*.aot"))


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


# The families the tests above leave out, each compiled as shipped (TP 1; their layer kinds run
# at TP 2 and through P/D above): the suite runs test_families.py eagerly.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen3", "tiny-qwen2-window",
                                  "tiny-mistral-window", "tiny-phi3", "tiny-phi3-longrope",
                                  "tiny-olmo2"])
def test_each_family_compiled_is_hf_exact(family_model, name: str) -> None:  # noqa: F811
    model_dir = family_model(name)
    llm = LLM(model=model_dir, compile=True, block_size=8, max_num_batched_tokens=12)
    check_greedy(llm, model_dir, [random_prompt(n, seed=n) for n in (3, 13, 45)])
    assert compiled(llm).compiled_steps and not compiled(llm).eager_steps


def _check_pd(model_dir: str, prompts: list[list[int]]) -> None:
    params = [GREEDY] * len(prompts)
    ours = pd_tokens(model_dir, prompts, params, chunk=12, compile=True)
    assert ours == colocated_tokens(model_dir, prompts, params, block_size=8, compile=True)
    for prompt, tokens in zip(prompts, ours):
        assert_greedy_matches(model_dir, prompt, tokens, hf_greedy(model_dir, prompt, MAX_TOKENS))
