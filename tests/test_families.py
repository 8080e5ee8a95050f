"""Every served family, token-exact with HF fp32 (issue 18), at TP 1 and TP 2 (Gloo).

Each family's tiny checkpoint is made by transformers itself (pd_cluster.checkpoints.maker presets
``tiny-<family>``: the family's HF class, random weights, small windows). Checked per family:
the logits of one prefill against HF's (catches what greedy cannot see, e.g. final soft-capping),
then greedy generation through the engine with prompts shorter and longer than every window,
chunked prefill in chunks smaller than the window, and prefix-cache hits, with a leak check.
"""
from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from pd_cluster.attention import AttentionMetadata, create_backend
from pd_cluster.llm import LLM
from pd_cluster.checkpoints.maker import PRESETS, make_model
from pd_cluster.models.context import ForwardContext
from pd_cluster.models.loader import load_model
from pd_cluster.sampling_params import SamplingParams
from tests.conftest import assert_greedy_matches, hf_greedy, hf_model, random_prompt

FAMILIES = ["tiny-llama3", "tiny-qwen3", "tiny-qwen2-window", "tiny-mistral-window",
            "tiny-gemma2", "tiny-gemma3", "tiny-phi3", "tiny-phi3-longrope", "tiny-olmo2"]
MAX_TOKENS = 12
_MADE: dict[str, str] = {}


@pytest.fixture(scope="session")
def family_model(tmp_path_factory: pytest.TempPathFactory):
    """preset name -> its checkpoint dir (made once per session)."""
    def make(name: str) -> str:
        if name not in _MADE:
            _MADE[name] = str(make_model(tmp_path_factory.mktemp("families") / name,
                                         **PRESETS[name]))
        return _MADE[name]
    return make


def prefill_logits(model_dir: str, ids: list[int], block_size: int = 8) -> torch.Tensor:
    """Our model's logits at every position of one prompt, run as one prefill on a paged cache."""
    cfg = json.loads(open(f"{model_dir}/config.json").read())
    model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"))
    a, n = model.args, len(ids)
    nb = -(-n // block_size)
    caches = [torch.zeros(2, nb, block_size, a.num_kv_heads, a.head_dim)
              for _ in range(a.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(nb, dtype=torch.int32)[None], num_decodes=0, max_query_len=n,
        max_seq_len=n, block_size=block_size, query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
    ctx = ForwardContext(meta, caches, create_backend("torch", torch.device("cpu")),
                         rope_lens=torch.full((n,), n))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), ctx))


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_logits_match_hf(family_model, name: str) -> None:
    model_dir = family_model(name)
    ids = random_prompt(50, seed=11)  # longer than every window (16/24) and longrope's 32
    with torch.inference_mode():
        want = hf_model(model_dir)(torch.tensor([ids])).logits[0].float()
    got = prefill_logits(model_dir, ids)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def check_greedy(llm: LLM, model_dir: str, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].finish_reason == "length"
        assert_greedy_matches(model_dir, prompt, out.outputs[0].token_ids,
                              hf_greedy(model_dir, prompt, MAX_TOKENS))
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_hf_chunked_and_prefix_cached(family_model, name: str) -> None:
    model_dir = family_model(name)
    # Chunks of <= 12 tokens (< every window), blocks of 8: windows end mid-block.
    llm = LLM(model=model_dir, block_size=8, max_num_batched_tokens=12,
              enable_prefix_caching=True)
    # Longrope: no prompt whose generation crosses original_max_position_embeddings (32), where
    # HF's Phi-3 generate recomputes the whole cache with the long factors (see docs/models.md).
    lens = (3, 13, 45, 70) if name == "tiny-phi3-longrope" else (3, 13, 26, 45, 70)
    short_and_long = [random_prompt(n, seed=n) for n in lens]
    check_greedy(llm, model_dir, short_and_long)
    base = short_and_long[-1]
    shared = [base[:40] + random_prompt(9, seed=1), base[:56] + random_prompt(20, seed=2)]
    check_greedy(llm, model_dir, shared)
    hits = llm.engine.stats()["prefix_cache_hit_blocks"]
    # longrope: a block's KV depends on the whole sequence's length, so no prefix sharing.
    assert hits == 0 if name == "tiny-phi3-longrope" else hits >= 5 + 7
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("name", FAMILIES)
def test_tp2_greedy_matches_hf(family_model, name: str) -> None:
    """Each family at tensor_parallel_size=2 on Gloo (rank 1 a worker process): heads, q/k
    norms, windows, soft-caps and fused checkpoints split across ranks, still HF-exact."""
    model_dir = family_model(name)
    llm = LLM(model=model_dir, tensor_parallel_size=2, block_size=8, max_num_batched_tokens=12,
              num_kv_blocks=64, collective_timeout=20.0)
    try:
        # 13 + 12 tokens stays below longrope's original length (32), 45 starts above it
        check_greedy(llm, model_dir, [random_prompt(n, seed=n) for n in (3, 13, 45)])
    finally:
        workers = llm.engine.executor.workers
        llm.close()
    assert workers is not None and all(p.poll() is not None for p in workers.procs)


def test_longrope_prompts_sharing_a_prefix_across_the_original_length(family_model) -> None:
    """A short prompt's blocks (short factors) must not serve a longer prompt sharing its
    prefix (long factors for every token, as HF computes it)."""
    model_dir = family_model("tiny-phi3-longrope")
    llm = LLM(model=model_dir, block_size=8)  # prefix caching requested: the engine declines
    short = random_prompt(20, seed=1)
    check_greedy(llm, model_dir, [short])
    check_greedy(llm, model_dir, [short[:16] + random_prompt(30, seed=2)])


def test_spec_reads_what_sets_each_family_apart(family_model) -> None:
    """The family readers turned the configs into the intended layer descriptions (so the HF
    checks above exercise windows, soft-caps, q/k norms and RoPE variants)."""
    from pd_cluster.models.families import spec_from_config

    def spec(name: str) -> Any:
        return spec_from_config(json.loads(open(f"{family_model(name)}/config.json").read()))

    gemma3 = spec("tiny-gemma3")
    assert [la.attention.sliding_window for la in gemma3.layers] == [16, None]
    assert [la.attention.rope.rope_type for la in gemma3.layers] == ["default", "linear"]
    assert gemma3.layers[0].attention.qk_norm == "head" and gemma3.embed_scale
    assert gemma3.tie_word_embeddings and gemma3.norm == "gemma"
    gemma2 = spec("tiny-gemma2")
    assert gemma2.layers[0].attention.logit_softcap == 4.0 and gemma2.final_logit_softcap == 30.0
    assert [la.attention.sliding_window for la in gemma2.layers] == [16, None]
    assert all(la.attention.sliding_window == 24 for la in spec("tiny-mistral-window").layers)
    assert [la.attention.sliding_window for la in spec("tiny-qwen2-window").layers] == [None, 16]
    assert spec("tiny-llama3").layers[0].attention.rope.rope_type == "llama3"
    assert spec("tiny-qwen3").layers[0].attention.qk_norm == "head"
    assert spec("tiny-olmo2").layers[0].attention.qk_norm == "proj"
    assert spec("tiny-olmo2").norms.attn_in is None
    assert spec("tiny-phi3").layers[0].attention.rope.rotary_dim == 8  # half of head_dim 16
    assert spec("tiny-phi3-longrope").layers[0].attention.rope.rope_type == "longrope"


@pytest.mark.parametrize("field, value, match", [
    ("hidden_act", "gelu_new", "hidden_act 'gelu_new'"),
    ("quantization_config", {"quant_method": "awq"}, "quantization_config 'awq'"),
    ("layer_types", ["chunked_attention", "full_attention"], "layer_types entry 'chunked_attention'"),
    ("architectures", ["Gemma3ForConditionalGeneration"], "Gemma3ForConditionalGeneration"),
])
def test_unimplemented_config_values_are_one_line_errors(family_model, tmp_path, field: str,
                                                         value: Any, match: str) -> None:
    from tests.conftest import edit_config

    bad = edit_config(family_model("tiny-qwen3"), tmp_path / "bad", **{field: value})
    with pytest.raises(ValueError, match=match) as err:
        LLM(model=bad)
    assert "\n" not in str(err.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels)")
@pytest.mark.parametrize("name", FAMILIES)
def test_triton_kernels_match_hf_on_cuda(family_model, name: str) -> None:
    """The CUDA default path: every family's window / soft-cap / scale through the Triton
    decode and prefill kernels, fp32, against HF on the CPU."""
    model_dir = family_model(name)
    llm = LLM(model=model_dir, block_size=16, max_num_batched_tokens=12, device="cuda",
              dtype="float32", attention_backend="triton")
    lens = (3, 13, 45, 70) if name == "tiny-phi3-longrope" else (3, 13, 26, 45, 70)
    check_greedy(llm, model_dir, [random_prompt(n, seed=n) for n in lens])


def test_configs_as_hub_checkpoints_write_them() -> None:
    """Fields a config.json leaves out take transformers' class defaults, as HF reads them:
    Gemma 3 1B's file (transformers 4.50) has no tie_word_embeddings (True) and spells the
    local RoPE base rope_local_base_freq; Qwen3's head_dim defaults to 128, not hidden/heads."""
    from pd_cluster.models.families import spec_from_config

    gemma3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
              "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
              "intermediate_size": 6912, "max_position_embeddings": 32768,
              "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
              "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
              "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
              "sliding_window_pattern": 6, "eos_token_id": [1, 106], "vocab_size": 262144}
    spec = spec_from_config(gemma3)
    assert spec.tie_word_embeddings and spec.final_logit_softcap is None
    windows = [la.attention.sliding_window for la in spec.layers]
    assert windows == [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    assert {la.attention.rope.theta for la in spec.layers if la.attention.sliding_window} == {1e4}
    assert {la.attention.rope.theta for la in spec.layers if not la.attention.sliding_window} == {1e6}
    qwen3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
             "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
             "num_hidden_layers": 2, "vocab_size": 1000}
    assert spec_from_config(qwen3).layers[0].attention.head_dim == 128
