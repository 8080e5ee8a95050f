"""MoE families through the engine, token-exact with HF fp32 (issue 20).

Tiny checkpoints are made here by transformers' own classes (random weights at scales that
give decisive routing and clear top-1 logits), saved as HF saves them (Mixtral's per-expert
``block_sparse_moe.experts.N.w1/w2/w3``, Qwen3-MoE's per-expert gate/up/down, gpt-oss's fused
interleaved experts), with the model maker's tokenizer. Checked: greedy generation with
prompts shorter and longer than every window, chunked prefill (chunks smaller than the
window), prefix-cache hits, leaks; P/D equal to HF for Mixtral; refusals as one-line errors.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from pd_cluster.llm import LLM
from pd_cluster.checkpoints.maker import build_tokenizer, save_checkpoint
from pd_cluster.sampling_params import SamplingParams
from tests.conftest import assert_greedy_matches, edit_config, hf_greedy, random_prompt
from tests.pd_helpers import colocated_tokens, pd_tokens

MAX_TOKENS = 10
VOCAB, H = 512, 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=3)
# Windows (16) shorter than the long prompts; experts small, several per token.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=6, num_experts_per_tok=2,
                                      intermediate_size=48, sliding_window=16)),
    # Layer 0 dense (decoder_sparse_step 2), layer 1 sparse; q/k norms; renormalised top-k.
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=3,
                                         moe_intermediate_size=32, intermediate_size=96,
                                         decoder_sparse_step=2, norm_topk_prob=True)),
    # Sinks, a sliding then a full layer, yarn RoPE, router/expert biases, clamped SwiGLU.
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=6, num_experts_per_tok=2,
                                     intermediate_size=48, sliding_window=16, swiglu_limit=3.0,
                                     layer_types=["sliding_attention", "full_attention"])),
}
_MADE: dict[str, str] = {}


def _init(model: Any, n_real: int, gpt_oss: bool) -> None:
    """Weights at unit-RMS scales (HF's std 0.02 init gives flat logits: greedy near-ties)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                continue
            if name.endswith("embed_tokens.weight"):
                std = 1.0
            elif name.startswith("lm_head."):
                std = 6.0 / math.sqrt(H)
            elif name.endswith(("bias", "sinks")) or p.dim() == 1:
                std = 0.3 if name.endswith("sinks") else 0.1
            elif p.dim() == 3:  # stacked experts: fan-in is H or I, by layout
                std = 1.0 / math.sqrt(p.shape[1] if gpt_oss else p.shape[2])
            else:
                std = (1.5 if ".q_proj." in name or ".k_proj." in name else 1.0) / math.sqrt(
                    p.shape[1])
            p.copy_(std * torch.randn(p.shape, generator=gen))
            if "embed_tokens" in name or name.startswith("lm_head."):
                p[n_real:] = 0.0
            if name.startswith("lm_head."):
                p[[0, 1, 3]] = 0.0


@pytest.fixture(scope="session")
def moe_model(tmp_path_factory: pytest.TempPathFactory):
    def make(name: str) -> str:
        if name not in _MADE:
            import transformers

            cls_name, fields = FAMILIES[name]
            tokenizer, n_real = build_tokenizer(VOCAB)
            cfg = getattr(transformers, cls_name)(**_COMMON, **fields)
            cfg.architectures = [cls_name.replace("Config", "ForCausalLM")]
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
            _init(model, n_real, name == "gpt_oss")
            out = tmp_path_factory.mktemp("moe_families") / name
            _MADE[name] = str(save_checkpoint(model, tokenizer, out, {"arch": name}))
        return _MADE[name]
    return make


def check_greedy(llm: LLM, model_dir: str, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert out.outputs[0].finish_reason == "length"
        assert_greedy_matches(model_dir, prompt, out.outputs[0].token_ids,
                              hf_greedy(model_dir, prompt, MAX_TOKENS))
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_matches_hf_chunked_and_prefix_cached(moe_model, name: str) -> None:
    model_dir = moe_model(name)
    llm = LLM(model=model_dir, block_size=8, max_num_batched_tokens=12,
              enable_prefix_caching=True)
    prompts = [random_prompt(n, seed=n) for n in (3, 13, 40)]
    check_greedy(llm, model_dir, prompts)
    shared = [prompts[-1][:32] + random_prompt(9, seed=1)]
    check_greedy(llm, model_dir, shared)
    assert llm.engine.stats()["prefix_cache_hit_blocks"] >= 4
    llm.engine.check_no_leaks()


def test_specs_put_moe_where_hf_does(moe_model) -> None:
    from pd_cluster.models.families import spec_from_config

    def spec(name: str) -> Any:
        return spec_from_config(json.loads(Path(moe_model(name), "config.json").read_text()))

    assert [la.mlp.kind for la in spec("qwen3_moe").layers] == ["gated", "moe"]
    gpt = spec("gpt_oss")
    assert [la.attention.sliding_window for la in gpt.layers] == [16, None]
    assert all(la.attention.sinks and la.mlp.kind == "moe" for la in gpt.layers)
    assert gpt.layers[0].mlp.extra["moe"].router_name == "router"
    assert all(la.attention.sliding_window == 16 for la in spec("mixtral").layers)


def test_pd_mixtral_equals_colocated_and_hf(moe_model) -> None:
    """P prefills in chunks and ships every layer's KV; D decodes; its tokens equal the
    colocated engine's and HF's."""
    model_dir = moe_model("mixtral")
    prompts = [random_prompt(n, seed=100 + n) for n in (5, 9, 30)]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = pd_tokens(model_dir, prompts, [greedy] * len(prompts), chunk=12)
    colocated = colocated_tokens(model_dir, prompts, [greedy] * len(prompts), block_size=8)
    for i, prompt in enumerate(prompts):
        assert got[i] == colocated[i]
        assert_greedy_matches(model_dir, prompt, got[i],
                              hf_greedy(model_dir, prompt, MAX_TOKENS))


@pytest.mark.parametrize("changes, match", [
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config 'gptq'"),
])
def test_refusals_are_one_line_errors(moe_model, tmp_path: Path, changes: dict[str, Any],
                                      match: str) -> None:
    bad = edit_config(moe_model("gpt_oss"), tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=match) as err:
        LLM(model=bad)
    assert "\n" not in str(err.value)


def test_checkpoint_missing_an_expert_is_refused(moe_model, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = Path(moe_model("mixtral"))
    dst = tmp_path / "partial"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).symlink_to(f)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.4.w3.weight"]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.experts.gate_up_proj'"):
        LLM(model=str(dst))


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_tp2_greedy_matches_hf(moe_model, name: str) -> None:
    """Each rank holds half of every expert's intermediate dimension (gpt-oss: its slice of
    the interleaved fused tensors, the down bias added on rank 0 only); HF-exact."""
    model_dir = moe_model(name)
    llm = LLM(model=model_dir, tensor_parallel_size=2, num_kv_blocks=64, block_size=8,
              max_num_batched_tokens=16, collective_timeout=20.0)
    try:
        experts = llm.engine.runner.model.model.layers[1].mlp.experts
        assert experts.down_proj.shape[-1] == FAMILIES[name][1]["intermediate_size"] // 2
        check_greedy(llm, model_dir, [random_prompt(n, seed=n) for n in (4, 30)])
    finally:
        workers = llm.engine.executor.workers
        llm.close()
    assert workers is not None and all(p.poll() is not None for p in workers.procs)
