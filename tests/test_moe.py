"""MoE layers against transformers' own MoE blocks (fp32, random hidden states).

For each family a one-layer HF model is built from a tiny config and saved (so the expert
tensors come in the checkpoint's own format: per expert, Mixtral's w1/w3/w2, gpt-oss's fused
interleaved tensors); our block is built from the family reader's MoE description and loaded
from those tensors through ``checkpoint_target`` and the weight loaders. Routers are compared
as (expert set, weights) per token; blocks by output. Tensor parallelism is checked by
building every rank of a size-2 split and summing their pre-all-reduce partial outputs.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pd_cluster.models.families.deepseek_v3_moe import deepseek_v3_moe
from pd_cluster.models.families.gpt_oss import gpt_oss_moe
from pd_cluster.models.families.mixtral import mixtral_moe
from pd_cluster.models.families.qwen3_moe import qwen3_moe_moe
from pd_cluster.models.layers.linear import attach_weight_loaders
from pd_cluster.models.layers.moe import MoESpec, SparseMoE, checkpoint_target, expected_shards
from pd_cluster.models.layers.moe_experts import grouped_experts
from pd_cluster.models.layers.moe_router import RoutingSpec
from pd_cluster.models.layers.tp import TPGroup

H, E = 32, 8
_COMMON = dict(vocab_size=64, hidden_size=H, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, head_dim=16)
FAMILIES: dict[str, tuple[str, dict[str, Any], Any]] = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=E, num_experts_per_tok=2,
                                      intermediate_size=24), mixtral_moe),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=E, num_experts_per_tok=3,
                                         moe_intermediate_size=24, intermediate_size=40,
                                         norm_topk_prob=False), qwen3_moe_moe),
    "qwen3_moe_norm": ("Qwen3MoeConfig", dict(num_experts=E, num_experts_per_tok=3,
                                              moe_intermediate_size=24, intermediate_size=40,
                                              norm_topk_prob=True), qwen3_moe_moe),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=E, num_experts_per_tok=3,
                                     intermediate_size=24, swiglu_limit=1.5,
                                     layer_types=["full_attention"]), gpt_oss_moe),
    "deepseek_v3": ("DeepseekV3Config", dict(
        n_routed_experts=E, num_experts_per_tok=3, moe_intermediate_size=24,
        intermediate_size=40, n_shared_experts=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16), deepseek_v3_moe),
}
_BUILT: dict[str, tuple[Any, dict[str, Any], dict[str, torch.Tensor]]] = {}


def hf_family(name: str, tmp: Path) -> tuple[Any, dict[str, Any], dict[str, torch.Tensor]]:
    """(HF layer-0 MoE block, config dict, layer-0 MoE checkpoint tensors) of a family."""
    if name not in _BUILT:
        import transformers

        cls_name, fields, _ = FAMILIES[name]
        cfg = getattr(transformers, cls_name)(**_COMMON, **fields)
        torch.manual_seed(hash(name) % 1000)
        model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
        with torch.no_grad():  # HF's init is std 0.02: scale up so routing and outputs vary
            for pname, p in model.named_parameters():
                if ".mlp." in pname or ".block_sparse_moe." in pname:
                    p.normal_(0.0, 0.3)
            block = model.model.layers[0].mlp
            if name == "deepseek_v3":
                block.gate.e_score_correction_bias.normal_(0.0, 0.3)
        out = tmp / name
        model.save_pretrained(out)
        tensors = {k: v for k, v in load_file(out / "model.safetensors").items()
                   if ".mlp." in k or ".block_sparse_moe." in k}
        _BUILT[name] = (block, cfg.to_dict(), tensors)
    return _BUILT[name]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe")


def our_block(name: str, tmp: Path, tp: TPGroup = TPGroup()) -> SparseMoE:
    _, cfg, tensors = hf_family(name, tmp)
    spec: MoESpec = FAMILIES[name][2](cfg)
    block = SparseMoE(spec, tp)
    attach_weight_loaders(block)
    params = {f"model.layers.0.mlp.{k}": p for k, p in block.named_parameters()}
    loaded = set()
    for key, tensor in tensors.items():
        target = checkpoint_target(key, params)
        if target is None and ".shared_experts." in key:  # the loader's dense gate/up fusion
            fused = key.replace(".gate_proj.", ".gate_up_proj.").replace(".up_proj.",
                                                                         ".gate_up_proj.")
            target = (fused, 0 if ".gate_proj." in key else 1)
        assert target is not None, f"no parameter for checkpoint tensor {key}"
        pname, shard = target
        params[pname].weight_loader(params[pname], tensor, shard)
        loaded.add((pname, shard))
    for pname, p in params.items():  # every parameter (or every shard of it) was loaded
        shards = expected_shards(pname, p) or ([0, 1] if "gate_up_proj.weight" in pname
                                               else [None])
        assert (pname, None) in loaded or all((pname, s) in loaded for s in shards), pname
    return block


def hf_out(block: Any, x: torch.Tensor) -> torch.Tensor:
    out = block(x)
    return out[0] if isinstance(out, tuple) else out  # GptOssMLP also returns router scores


def hf_router(name: str, block: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    router = block.router if name == "gpt_oss" else block.gate
    _, weights, ids = router(x)
    return weights, ids


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_router_matches_hf(name: str, tmp: Path) -> None:
    block, _, _ = hf_family(name, tmp)
    ours = our_block(name, tmp)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_w, want_ids = by_expert(*hf_router(name, block, x))
        got_w, got_ids = by_expert(*ours.router_module(x))
    assert torch.equal(got_ids, want_ids)
    assert got_w.dtype == want_w.dtype
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_deepseek_choice_uses_correction_bias_and_groups(tmp: Path) -> None:
    """The bias and the group limit change which experts are chosen (so the router test above
    would fail without them), while the weights stay the plain sigmoid scores."""
    block, cfg, _ = hf_family("deepseek_v3", tmp)
    ours = our_block("deepseek_v3", tmp)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ids = by_expert(*ours.router_module(x))[1]
        plain = torch.sigmoid(x @ ours.router_module.weight.T)
        naive = plain.topk(3, dim=-1).indices.sort(dim=-1).values
        assert not torch.equal(ids, naive)
        ours.router_module.e_score_correction_bias.zero_()
        no_group = RoutingSpec("sigmoid", E, 3, n_group=1, topk_group=1)
        object.__setattr__(ours.router_module, "spec", no_group)
        assert torch.equal(by_expert(*ours.router_module(x))[1], naive)
    groups = ids // (E // cfg["n_group"])
    assert all(len(set(row.tolist())) <= cfg["topk_group"] for row in groups)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_block_matches_hf(name: str, tmp: Path) -> None:
    block, _, _ = hf_family(name, tmp)
    ours = our_block(name, tmp)
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf_out(block, x)
        got = ours(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_block_bf16_rounds_as_hf(name: str, tmp: Path) -> None:
    """In bf16, bit for bit HF's block (its default grouped_mm experts): biases added after the
    matmul, routing weights applied in their own dtype (fp32 for Mixtral and DeepSeek-V3),
    the top-k sum in that dtype, rounded once."""
    block, _, _ = hf_family(name, tmp)
    ours = our_block(name, tmp).to(torch.bfloat16)
    x = torch.randn(1, 48, H, generator=torch.Generator().manual_seed(6)).bfloat16()
    with torch.no_grad():
        want = hf_out(copy.deepcopy(block).to(torch.bfloat16), x)
        got = ours(x)
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_tensor_parallel_shards_sum_to_hf(name: str, tmp: Path) -> None:
    """Each rank of a 2-way split loads its slice of every expert (per-expert and gpt-oss's
    fused interleaved tensors, shared experts); the ranks' partial outputs sum to HF's."""
    block, _, _ = hf_family(name, tmp)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        partials = [our_block(name, tmp, TPGroup(r, 2, group=object())).partial(x)
                    for r in range(2)]
        want = hf_out(block, x[None])[0]
    assert not torch.allclose(partials[0], want, atol=1e-3)  # each rank holds only a part
    torch.testing.assert_close(partials[0] + partials[1], want, rtol=1e-5, atol=1e-5)


def test_grouped_experts_equals_per_token_loop() -> None:
    """The sorted, one-matmul-per-expert path against a plain per-token sum, with experts that
    receive no token and a token routed to one expert twice."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 6, generator=g)
    w13, w2 = torch.randn(5, 8, 6, generator=g), torch.randn(5, 6, 4, generator=g)
    ids = torch.tensor([[0, 3], [3, 0], [3, 3], [4, 0], [0, 4], [3, 4], [4, 3]])
    weights = torch.rand(7, 2, generator=g)

    def act(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    want = torch.zeros_like(x)
    for t in range(7):
        for k in range(2):
            e = int(ids[t, k])
            want[t] += weights[t, k] * (act(x[t] @ w13[e].T) @ w2[e].T)
    torch.testing.assert_close(grouped_experts(x, w13, w2, weights, ids, act), want)


def test_bad_routing_settings_are_value_errors() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        RoutingSpec("softmax", 8, 9)
    with pytest.raises(ValueError, match="n_group=3"):
        RoutingSpec("sigmoid", 8, 2, n_group=3)
    with pytest.raises(ValueError, match="topk_group=1 groups of 2"):
        RoutingSpec("sigmoid", 8, 4, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="tensor_parallel_size=5 does not divide the "
                                         "experts. intermediate_size=24"):
        SparseMoE(mixtral_moe(dict(hidden_size=H, intermediate_size=24)),
                  TPGroup(0, 5, group=object()))


def test_which_layers_are_sparse_follows_hf() -> None:
    """Qwen3-MoE's decoder_sparse_step / mlp_only_layers and DeepSeek-V3's dense first layers,
    against the block type HF's model puts in each layer."""
    import transformers

    from pd_cluster.models.families.deepseek_v3_moe import deepseek_v3_sparse
    from pd_cluster.models.families.qwen3_moe import qwen3_moe_sparse

    tiny = dict(_COMMON, num_hidden_layers=6)
    for cfg, sparse, moe_class in [
        (transformers.Qwen3MoeConfig(**tiny, num_experts=4, moe_intermediate_size=8,
                                     intermediate_size=8, decoder_sparse_step=2,
                                     mlp_only_layers=[3]), qwen3_moe_sparse, "SparseMoeBlock"),
        (transformers.DeepseekV3Config(**tiny, **FAMILIES["deepseek_v3"][1] | dict(
            first_k_dense_replace=2)), deepseek_v3_sparse, "MoE")]:
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
        want = [type(layer.mlp).__name__.endswith(moe_class) for layer in hf.model.layers]
        assert [sparse(cfg.to_dict(), i) for i in range(6)] == want
        assert True in want and False in want
