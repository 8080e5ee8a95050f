"""DeepSeek-V3's multi-head latent attention through the engine (issue 20).

Tiny checkpoints made by transformers' DeepseekV3ForCausalLM (model_maker arch deepseek_v3):
q LoRA, interleaved RoPE with yarn and its mscale, a dense first layer then MoE layers; a
second variant with one q_proj, rotate-half RoPE and the default RoPE. Checked: greedy-exact
with HF fp32 under chunked prefill and prefix caching; the decode path (W_UK/W_UV absorbed,
latents only) equals the decompressed path; P/D equal to colocated with exactly the latents'
bytes shipped (TP2 producer -> TP1 consumer: from one producer rank); TP2 HF-exact; leaks.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.cpu_build import disabled_by_env, load_cpu_kernels, load_error
from pd_cluster.attention import AttentionMetadata, create_backend
from pd_cluster.engine.kv_spec import LatentAttentionSpec
from pd_cluster.llm import LLM
from pd_cluster.checkpoints.maker import make_model
from pd_cluster.sampling_params import SamplingParams
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt
from tests.pd_helpers import colocated_tokens, drain, engine, run_in_process, submit_pair
from tests.test_moe_families import check_greedy  # HF-exact greedy generation, then no leaks


def require_cpu_kernels() -> None:
    """Skip only when the kernel is turned off on purpose; a failed build fails the test."""
    if disabled_by_env():
        pytest.skip("PD_CLUSTER_CPU_KERNELS=0")
    assert load_cpu_kernels(), f"CPU kernel failed to build: {load_error()}"


MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LATENT, ROPE, LAYERS = 32, 8, 2
_SIZES = dict(arch="deepseek_v3", hidden_size=64, num_layers=LAYERS, num_heads=4,
              num_kv_heads=4, intermediate_size=128, max_position_embeddings=512)
_MLA = dict(kv_lora_rank=LATENT, qk_rope_head_dim=ROPE, qk_nope_head_dim=16, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1)
VARIANTS: dict[str, dict[str, Any]] = {
    # q LoRA, interleaved rope, yarn with mscale_all_dim (softmax scale and cos/sin factors)
    "qlora-yarn": dict(q_lora_rank=24, rope_interleave=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 0.8}),
    "qproj-halfrot": dict(q_lora_rank=None, rope_interleave=False),
}
_MADE: dict[str, str] = {}


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory):
    def make(name: str) -> str:
        if name not in _MADE:
            out = tmp_path_factory.mktemp("mla") / name
            _MADE[name] = str(make_model(out, **_SIZES,
                                         config_overrides={**_MLA, **VARIANTS[name]}))
        return _MADE[name]
    return make


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_matches_hf_chunked_and_prefix_cached(mla_model, name: str) -> None:
    model_dir = mla_model(name)
    llm = LLM(model=model_dir, block_size=8, max_num_batched_tokens=12,
              enable_prefix_caching=True)
    spec = llm.engine.runner.kv_spec
    assert spec.layers == (LatentAttentionSpec(LATENT + ROPE, torch.float32),) * LAYERS
    assert llm.engine.runner.kv_caches[0].shape[0::3] == (1, 1)  # one part, one "head"
    prompts = [random_prompt(n, seed=n) for n in (3, 13, 40)]
    check_greedy(llm, model_dir, prompts)
    check_greedy(llm, model_dir, [prompts[-1][:32] + random_prompt(9, seed=1)])
    assert llm.engine.stats()["prefix_cache_hit_blocks"] >= 4


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_decode_path_equals_decompressed_path(mla_model, backend: str) -> None:
    """Absorbed decode over the cached latents (each backend's: dense copies, or the CPU
    kernel reading the blocks in place) == decompressed attention of the same query."""
    if backend == "cpu":
        require_cpu_kernels()
    llm = LLM(model=mla_model("qlora-yarn"), num_kv_blocks=16)
    attn = llm.engine.runner.model.model.layers[1].self_attn
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(1, 16, 4, 1, LATENT + ROPE, generator=gen)
    lengths = [3, 9, 14]  # context lengths of three decode requests
    tables = torch.tensor([[0, 0, 0, 0], [5, 1, 7, 0], [2, 9, 4, 11]], dtype=torch.int32)
    heads = attn.num_heads
    q_nope = torch.randn(3, heads, 16, generator=gen)
    q_rope = torch.randn(3, heads, ROPE, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.full((3,), -1), query_start_loc=torch.arange(4, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32), block_tables=tables, num_decodes=3,
        max_query_len=1, max_seq_len=14, block_size=4, query_start_loc_cpu=[0, 1, 2, 3],
        seq_lens_cpu=lengths)
    with torch.inference_mode():
        absorbed = attn.attend_absorbed(q_nope, q_rope, cache, meta,
                                        create_backend(backend, torch.device("cpu")))
        for i, n in enumerate(lengths):
            blocks = tables[i, : -(-n // 4)].long()
            ctx_kv = cache[0, blocks].reshape(-1, LATENT + ROPE)[:n]
            full = attn.prefill_decompressed(q_nope[i:i + 1], q_rope[i:i + 1], ctx_kv)
            torch.testing.assert_close(absorbed[i], full[0], rtol=1e-5, atol=1e-5)


def test_absorbed_prefill_in_place_equals_decompressed(mla_model) -> None:
    """The CPU kernel's absorbed attention over a mixed batch (a decode, a chunk after a cached
    prefix, a prompt from its start) == decompressed attention of each request."""
    require_cpu_kernels()
    llm = LLM(model=mla_model("qlora-yarn"), num_kv_blocks=16)
    attn = llm.engine.runner.model.model.layers[1].self_attn
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(1, 16, 4, 1, LATENT + ROPE, generator=gen)
    q_lens, lengths = [1, 5, 6], [9, 14, 6]
    tables = torch.tensor([[3, 8, 6, 0], [5, 1, 7, 10], [2, 9, 0, 0]], dtype=torch.int32)
    starts = [0, 1, 6, 12]
    q_nope = torch.randn(12, attn.num_heads, 16, generator=gen)
    q_rope = torch.randn(12, attn.num_heads, ROPE, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.full((12,), -1), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32), block_tables=tables, num_decodes=1,
        max_query_len=6, max_seq_len=14, block_size=4, query_start_loc_cpu=starts,
        seq_lens_cpu=lengths)
    with torch.inference_mode():
        absorbed = attn.attend_absorbed(q_nope, q_rope, cache, meta,
                                        create_backend("cpu", torch.device("cpu")), 3)
        for i, n in enumerate(lengths):
            blocks = tables[i, : -(-n // 4)].long()
            ctx_kv = cache[0, blocks].reshape(-1, LATENT + ROPE)[:n]
            a, b = starts[i], starts[i + 1]
            full = attn.prefill_decompressed(q_nope[a:b], q_rope[a:b], ctx_kv)
            torch.testing.assert_close(absorbed[a:b], full, rtol=1e-5, atol=1e-5)
    llm.engine.check_no_leaks()


def test_pd_equals_colocated_with_latent_bytes_from_one_tp_rank(mla_model) -> None:
    """P (TP2) prefills and ships each layer's latents; D (TP1) decodes. Every rank
    holds the same latents, so one producer rank sends them: the bytes are exactly the
    prompt blocks' latents, once."""
    model_dir = mla_model("qlora-yarn")
    prompts = [random_prompt(n, seed=100 + n) for n in (5, 17, 30)]
    want = colocated_tokens(model_dir, prompts, [GREEDY] * len(prompts), block_size=8)
    d = engine(model_dir, "consumer", block_size=8, num_kv_blocks=64)
    # One prefill step per prompt (a chunk ending mid-block ships that block again).
    p = engine(model_dir, "producer", block_size=8, num_kv_blocks=64,
               tensor_parallel_size=2, collective_timeout=20.0)
    try:
        for i, prompt in enumerate(prompts):
            submit_pair(p, d, f"r{i}", prompt, GREEDY, d.kv_endpoint())
        got = run_in_process(p, d)
        blocks = sum(-(-len(x) // 8) for x in prompts)
        latent_bytes = blocks * 8 * LAYERS * (LATENT + ROPE) * 4  # fp32
        assert d.stats()["kv_fallbacks"] == 0
        assert d.stats()["kv_bytes_received"] == latent_bytes
        assert p.stats()["kv_bytes_sent"] == latent_bytes
        drain(p, d)
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == want[i]
        assert_greedy_matches(model_dir, prompt, got[f"r{i}"],
                              hf_greedy(model_dir, prompt, MAX_TOKENS))


def test_tp2_greedy_matches_hf(mla_model) -> None:
    """Heads split over two ranks (q_b/kv_b by head, o_proj by input); latents replicated."""
    model_dir = mla_model("qproj-halfrot")
    llm = LLM(model=model_dir, tensor_parallel_size=2, num_kv_blocks=64, block_size=8,
              max_num_batched_tokens=16, collective_timeout=20.0)
    try:
        attn = llm.engine.runner.model.model.layers[0].self_attn
        assert attn.num_heads == 2 and attn.kv_b_proj.weight.shape[0] == 2 * (16 + 16)
        check_greedy(llm, model_dir, [random_prompt(n, seed=n) for n in (4, 30)])
    finally:
        workers = llm.engine.executor.workers
        llm.close()
    assert workers is not None and all(proc.poll() is not None for proc in workers.procs)


def test_model_maker_preset_is_deepseek_shaped(tmp_path: Path) -> None:
    from pd_cluster.checkpoints.maker import PRESETS
    from pd_cluster.models.families import spec_from_config
    import json

    out = make_model(tmp_path / "ds", **{**PRESETS["tiny-deepseek-v3"], "num_layers": 2})
    spec = spec_from_config(json.loads((out / "config.json").read_text()))
    assert spec.architecture == "DeepseekV3ForCausalLM"
    assert [la.mlp.kind for la in spec.layers] == ["gated", "moe"]
    assert spec.layers[0].attention.latent.cache_dim == 80


def test_tp_size_must_divide_the_experts_intermediate_size() -> None:
    from pd_cluster.engine.executor import check_tensor_parallel

    cfg = dict(num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
               intermediate_size=128, moe_intermediate_size=30)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide "
                                         "moe_intermediate_size=30"):
        check_tensor_parallel(cfg, 4)
    check_tensor_parallel(cfg, 2)


def test_multi_token_prediction_layers_are_skipped_on_load(mla_model, tmp_path: Path) -> None:
    """Real DeepSeek-V3 checkpoints carry layer ``num_hidden_layers`` (the MTP module, which
    HF skips too); a tensor of any other unknown layer is still refused."""
    from safetensors.torch import load_file, save_file

    src = Path(mla_model("qproj-halfrot"))
    tensors = load_file(src / "model.safetensors")
    for extra, ok in (("model.layers.2.eh_proj.weight", True),
                      ("model.layers.3.eh_proj.weight", False)):
        dst = tmp_path / extra
        dst.mkdir()
        for f in src.iterdir():
            if f.name != "model.safetensors":
                (dst / f.name).symlink_to(f)
        save_file({**tensors, extra: torch.zeros(4, 4)}, dst / "model.safetensors")
        if ok:
            LLM(model=str(dst), num_kv_blocks=8)
        else:
            with pytest.raises(ValueError, match="unexpected.*model.layers.3.eh_proj"):
                LLM(model=str(dst), num_kv_blocks=8)
