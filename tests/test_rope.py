"""Each RoPE variant's inverse frequencies and attention factor equal transformers' own
(``ROPE_INIT_FUNCTIONS``), read from transformers 5's ``rope_parameters`` and from
transformers 4's ``rope_theta`` / ``rope_scaling``."""
from __future__ import annotations

import math

import pytest
import torch

from pd_cluster.models.layers.rotary import RopeSpec, RotaryEmbedding, inv_freq_and_factor, read_rope

HEAD_DIM = 64
BASE = dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=4096)
VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                    "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": 1024},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": 2048},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 1024,
                 "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.0 + 0.5 * i for i in range(HEAD_DIM // 2)]},
}


# transformers is imported inside the tests: importing its model configs imports Triton, which
# must not happen before tests/test_kernels.py has set TRITON_INTERPRET (collection order).
def _hf(params: dict, seq_len: int | None = None, **extra) -> tuple[torch.Tensor, float, dict]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(**BASE, rope_parameters={"rope_theta": 50000.0, **params}, **extra)
    inv, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu", seq_len=seq_len)
    return inv, factor, cfg.to_dict()


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_transformers(name: str, partial: float) -> None:
    params = dict(VARIANTS[name])
    if name == "longrope" and partial != 1.0:
        n = int(HEAD_DIM * partial) // 2
        params.update(short_factor=params["short_factor"][:n], long_factor=params["long_factor"][:n])
    params["partial_rotary_factor"] = partial
    want, want_factor, cfg = _hf(params)
    spec = read_rope(cfg, HEAD_DIM)
    assert spec.rope_type == params["rope_type"] and spec.rotary_dim == int(HEAD_DIM * partial)
    got, factor = inv_freq_and_factor(spec)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def test_longrope_switches_to_long_factors_past_the_original_length() -> None:
    params = VARIANTS["longrope"]
    short, _, cfg = _hf(params, seq_len=1024)
    long, factor, _ = _hf(params, seq_len=1025)
    spec = read_rope(cfg, HEAD_DIM)
    assert not torch.equal(short, long)
    torch.testing.assert_close(inv_freq_and_factor(spec, seq_len=1024)[0], short, rtol=0, atol=0)
    torch.testing.assert_close(inv_freq_and_factor(spec, seq_len=1025)[0], long, rtol=0, atol=0)
    assert factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(1024)))
    # Per token: a position is rotated with the long factors iff its sequence (prompt
    # included) is longer than the original context.
    rot = RotaryEmbedding(spec)
    pos = torch.tensor([5, 5, 1030])
    cos, _ = rot.cos_sin(pos, torch.float32, rope_lens=torch.tensor([1024, 1025, 1031]))
    half = HEAD_DIM // 2
    assert torch.allclose(cos[0, 0, :half], (5 * short).cos() * factor)
    assert torch.allclose(cos[1, 0, :half], (5 * long).cos() * factor)


def test_dynamic_is_unscaled_within_max_positions_and_ntk_beyond() -> None:
    params = VARIANTS["dynamic"]
    within, _, cfg = _hf(params)
    spec = read_rope(cfg, HEAD_DIM)
    torch.testing.assert_close(inv_freq_and_factor(spec)[0], within, rtol=0, atol=0)
    beyond, _, _ = _hf(params, seq_len=6000)
    torch.testing.assert_close(inv_freq_and_factor(spec, seq_len=6000)[0], beyond, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn"])
def test_transformers4_rope_scaling_reads_the_same(name: str) -> None:
    want, want_factor, _ = _hf(VARIANTS[name])
    params = dict(VARIANTS[name])
    legacy = {**BASE, "rope_theta": 50000.0,
              "rope_scaling": {"type" if name == "linear" else "rope_type": params.pop("rope_type"),
                               **params}}
    got, factor = inv_freq_and_factor(read_rope(legacy, HEAD_DIM))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert factor == pytest.approx(want_factor)


def test_gemma3_local_and_global_rope_per_layer_type() -> None:
    from transformers import Gemma3TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = Gemma3TextConfig(hidden_size=256, num_attention_heads=4, head_dim=HEAD_DIM,
                           rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                  "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear",
                                                               "factor": 8.0,
                                                               "rope_theta": 1e6}})
    d = cfg.to_dict()
    full, _ = ROPE_INIT_FUNCTIONS["linear"](cfg, "cpu", layer_type="full_attention")
    got = inv_freq_and_factor(read_rope(d, HEAD_DIM, "full_attention"))[0]
    torch.testing.assert_close(got, full, rtol=0, atol=0)
    local = read_rope(d, HEAD_DIM, "sliding_attention")
    assert (local.rope_type, local.theta) == ("default", 10000.0)
    # transformers 4's Gemma 3 config: rope_local_base_freq for local layers, rope_scaling global.
    from pd_cluster.models.families.gemma import gemma3
    legacy = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 300, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 4,
              "num_key_value_heads": 1, "head_dim": HEAD_DIM, "rope_theta": 1e6,
              "rope_local_base_freq": 10000.0, "sliding_window": 512,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    layers = gemma3(legacy).layers
    assert [la.attention.rope.theta for la in layers] == [1e4] * 5 + [1e6]
    assert [la.attention.rope.rope_type for la in layers] == ["default"] * 5 + ["linear"]
    assert [la.attention.sliding_window for la in layers] == [512] * 5 + [None]


def test_unknown_rope_type_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match="rope_type 'mrope' is not supported"):
        read_rope({**BASE, "rope_scaling": {"rope_type": "mrope"}}, HEAD_DIM)


def test_partial_rotary_leaves_the_tail_of_each_head_unrotated() -> None:
    spec = RopeSpec("default", 10000.0, 16, 8, 128)
    rot = RotaryEmbedding(spec)
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    q2, k2 = RotaryEmbedding.apply(rot.cos_sin(torch.tensor([0, 4, 9]), torch.float32), q, k)
    assert torch.equal(q2[..., 8:], q[..., 8:]) and torch.equal(k2[..., 8:], k[..., 8:])
    assert torch.equal(q2[0], q[0])  # position 0 is not rotated
    assert not torch.allclose(q2[1, :, :8], q[1, :, :8])
