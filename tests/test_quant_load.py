"""Quantised checkpoints dequantised on load (issue 20, item 4).

The test makes a tiny checkpoint, quantises its weights itself into the on-disk format (FP8
e4m3 blocks with fp32 ``weight_scale_inv`` for Llama and DeepSeek-V3, incl. dimensions that
are not a multiple of the block and scales in another shard than their weights; gpt-oss
MXFP4 ``_blocks``/``_scales``), and writes beside it an unquantised checkpoint holding a
reference dequantisation written here (explicit per-block loops; FP4 decoded from its sign/exponent/mantissa bits). Checked: the
loaded parameters equal that reference (bf16: one rounding of it), generation equals HF fp32
on the reference checkpoint, and bad checkpoints or configs fail with one-line errors.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pd_cluster.llm import LLM
from pd_cluster.checkpoints.maker import build_tokenizer, make_model, save_checkpoint
from pd_cluster.models.loader import load_model
from pd_cluster.sampling_params import SamplingParams
from tests.conftest import assert_greedy_matches, edit_config, hf_greedy, random_prompt
from tests.test_moe_families import _init as init_moe_weights

BLOCK = (16, 16)  # small blocks so a tiny model has many, and partial edge ones
FP8_MAX = 448.0
MAX_TOKENS = 8


# ---------------------------------------------------------------- checkpoint writing

def _write(src: Path, dst: Path, shards: list[dict[str, torch.Tensor]],
           quant: dict[str, Any] | None) -> Path:
    """src's non-weight files, the given shards (with an index when several) and its config
    with ``quantization_config`` set (or absent)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json",
                                                         "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    names = ([f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
             if len(shards) > 1 else ["model.safetensors"])
    for name, state in zip(names, shards):
        save_file({k: v.contiguous() for k, v in state.items()}, dst / name,
                  metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {k: name for name, state in zip(names, shards) for k in state}
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = {**json.loads((src / "config.json").read_text()), "quantization_config": quant}
    if quant is None:
        del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _state(model_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


# ---------------------------------------------------------------- FP8 blocks

def _quantise_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 16x16 block: scale = amax / 448, q = w / scale in e4m3 (edge blocks partial)."""
    bn, bk = BLOCK
    grid = (math.ceil(w.shape[0] / bn), math.ceil(w.shape[1] / bk))
    scale = torch.empty(grid, dtype=torch.float32)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale[i, j] = blk.abs().max().clamp(min=1e-8) / FP8_MAX
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / scale[i, j]).to(q.dtype)
    return q, scale


def _dequantise_fp8_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    bn, bk = BLOCK
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


# Llama; DeepSeek-V3 (the FP8 checkpoints' family): q LoRA 24 and a latent + rope key of
# 32 + 8 = 40 rows in kv_a_proj_with_mqa, experts 40 wide: partial blocks everywhere.
FP8_SOURCES: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama", seed=5, intermediate_size=72),
    "deepseek_v3": dict(arch="deepseek_v3", seed=5, num_kv_heads=4, intermediate_size=72,
                        max_position_embeddings=512, config_overrides=dict(
                            kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                            v_head_dim=16, q_lora_rank=24, n_routed_experts=4,
                            num_experts_per_tok=2, n_group=2, topk_group=1,
                            moe_intermediate_size=40, n_shared_experts=1,
                            first_k_dense_replace=1)),
}
_FP8_MADE: dict[str, tuple[str, str]] = {}


def _fp8_checkpoints(root: Path, arch: str) -> tuple[str, str]:
    """(FP8 checkpoint, its reference dequantisation): every linear's weight quantised (not
    embeddings, norms, lm_head or the MoE router, as DeepSeek ships them). Layer 1's scales
    live in a second shard, so some scales are read from another file than their weight."""
    if arch in _FP8_MADE:
        return _FP8_MADE[arch]
    src = make_model(root / "src", **FP8_SOURCES[arch])
    main: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, w in _state(src).items():
        if w.dim() == 2 and not name.endswith(("embed_tokens.weight", "mlp.gate.weight")) \
                and not name.startswith("lm_head."):
            q, s = _quantise_fp8(w)
            main[name] = q
            (scales if ".layers.1." in name else main)[name + "_scale_inv"] = s
            ref[name] = _dequantise_fp8_ref(q, s)
            assert not torch.equal(ref[name], w)  # the quantisation did round something
        else:
            main[name] = ref[name] = w
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": list(BLOCK)}
    quant_dir = _write(src, root / "quant", [main, scales], quant)
    ref_dir = _write(src, root / "ref", [ref], None)
    _FP8_MADE[arch] = str(quant_dir), str(ref_dir)
    return _FP8_MADE[arch]


@pytest.fixture(scope="module", params=list(FP8_SOURCES))
def fp8_dirs(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return _fp8_checkpoints(tmp_path_factory.mktemp(f"fp8-{request.param}"), request.param)


@pytest.fixture(scope="module")
def llama_fp8_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return _fp8_checkpoints(tmp_path_factory.mktemp("fp8-llama"), "llama")


def _load(model_dir: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return load_model(model_dir, cfg, dtype, torch.device("cpu")).state_dict()


def test_fp8_weights_equal_the_reference_dequantisation(fp8_dirs: tuple[str, str]) -> None:
    quant_dir, ref_dir = fp8_dirs
    got, want = _load(quant_dir), _load(ref_dir)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in got)
    ref = load_file(Path(ref_dir) / "model.safetensors")
    gate_up = got["model.layers.0.mlp.gate_up_proj.weight"]  # dense in both: 72 = 4.5 blocks
    assert gate_up.shape == (144, 64)
    assert torch.equal(gate_up[72:], ref["model.layers.0.mlp.up_proj.weight"])
    # bf16 engine: the fp32 product rounded once, not the scale or the weight first.
    half = _load(quant_dir, torch.bfloat16)["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(half, ref["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16))


def _check_greedy(quant_dir: str, ref_dir: str, lengths: tuple[int, ...]) -> None:
    """Our engine on the quantised checkpoint vs HF fp32 on the reference dequantisation."""
    prompts = [random_prompt(n, seed=n) for n in lengths]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model=quant_dir, block_size=8) as llm:
        for prompt, out in zip(prompts, llm.generate(prompts, greedy)):
            assert_greedy_matches(ref_dir, prompt, out.outputs[0].token_ids,
                                  hf_greedy(ref_dir, prompt, MAX_TOKENS))
        llm.engine.check_no_leaks()


def test_fp8_generation_equals_hf_on_the_dequantised_weights(fp8_dirs: tuple[str, str]) -> None:
    _check_greedy(*fp8_dirs, lengths=(4, 19))


# ---------------------------------------------------------------- gpt-oss MXFP4

_FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _quantise_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] (K a multiple of 32) -> blocks [E, N, K/32, 16] uint8, scales [E, N, K/32]:
    per group of 32, the power of two putting amax within FP4's 6, values rounded to nearest."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    y = groups / torch.exp2(exp)[..., None]
    idx = (y.abs()[..., None] - _FP4_MAGNITUDES).abs().argmin(-1)
    nibble = (idx | torch.where(y < 0, 8, 0)).to(torch.uint8)
    blocks = nibble[..., 0::2] | (nibble[..., 1::2] << 4)  # element 2k in the low nibble
    return blocks, (exp + 127).to(torch.uint8)


def _dequantise_mxfp4_ref(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """From the bits: sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0); subnormal
    when the exponent is 0. Returns [E, N, K]."""
    nib = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2).long()
    sign = 1.0 - 2.0 * (nib >> 3).double()
    e, m = ((nib >> 1) & 3).double(), (nib & 1).double()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2(e - 1) * (1 + 0.5 * m))
    val = sign * mag * torch.exp2(scales.double() - 127)[..., None]
    return val.flatten(-2).float()


def _gpt_oss_source(root: Path) -> Path:
    """A tiny gpt-oss by transformers (experts 64 wide so down_proj's rows split in groups
    of 32), weights initialised as the MoE family tests do (decisive logits)."""
    import transformers

    tokenizer, n_real = build_tokenizer(512)
    cfg = transformers.GptOssConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2,
        pad_token_id=3)
    cfg.architectures = ["GptOssForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    init_moe_weights(model, n_real, gpt_oss=True)
    return save_checkpoint(model, tokenizer, root / "src", {"arch": "gpt_oss"})


@pytest.fixture(scope="module")
def mxfp4_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(MXFP4 gpt-oss checkpoint, its reference dequantisation). The fused expert weights are
    stored as gpt-oss releases them: rows = output features ([E, 2I, H] / [E, H, I])."""
    root = tmp_path_factory.mktemp("mxfp4")
    src = _gpt_oss_source(root)
    quant: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, w in _state(src).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _quantise_mxfp4(w.transpose(1, 2))
            quant[name + "_blocks"], quant[name + "_scales"] = blocks, scales
            ref[name] = _dequantise_mxfp4_ref(blocks, scales).transpose(1, 2)
            assert not torch.equal(ref[name], w)
        else:
            quant[name] = ref[name] = w
    q_dir = _write(src, root / "quant", [quant], {"quant_method": "mxfp4",
                                                 "modules_to_not_convert": ["router", "lm_head"]})
    return str(q_dir), str(_write(src, root / "ref", [ref], None))


def test_mxfp4_reference_matches_transformers_dequantiser(mxfp4_dirs: tuple[str, str]) -> None:
    """The layout (nibble order, transposition) as transformers' own MXFP4 dequantiser."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    quant = load_file(Path(mxfp4_dirs[0]) / "model.safetensors")
    ref = load_file(Path(mxfp4_dirs[1]) / "model.safetensors")
    for proj in ("gate_up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.{proj}"
        hf = convert_moe_packed_tensors(quant[name + "_blocks"], quant[name + "_scales"],
                                        dtype=torch.float32)
        assert torch.equal(hf, ref[name])


def test_mxfp4_weights_equal_the_reference_dequantisation(mxfp4_dirs: tuple[str, str]) -> None:
    got, want = _load(mxfp4_dirs[0]), _load(mxfp4_dirs[1])
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in got)
    half, want_half = _load(mxfp4_dirs[0], torch.bfloat16), _load(mxfp4_dirs[1], torch.bfloat16)
    assert all(torch.equal(half[k], want_half[k]) for k in half)


def test_mxfp4_generation_equals_hf_on_the_dequantised_weights(
        mxfp4_dirs: tuple[str, str]) -> None:
    _check_greedy(*mxfp4_dirs, lengths=(5, 30))  # shorter and longer than the window (16)


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("quant, match", [
    ({"quant_method": "awq", "bits": 4}, "quantization_config 'awq'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config fmt 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "mxfp4"}, "'mxfp4' is supported for GptOssForCausalLM only"),
])
def test_unsupported_quantization_is_a_one_line_error(llama_fp8_dirs, tmp_path: Path,
                                                      quant: dict[str, Any], match: str) -> None:
    bad = edit_config(llama_fp8_dirs[0], tmp_path / "bad", quantization_config=quant)
    with pytest.raises(ValueError, match=match) as err:
        LLM(model=bad)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("drop, match", [
    ("model.layers.0.self_attn.q_proj.weight_scale_inv", "q_proj.weight is quantised but"),
    ("model.layers.1.self_attn.q_proj.weight", "scales whose tensors are missing"),
])
def test_checkpoint_missing_a_scale_or_its_weight_is_rejected(llama_fp8_dirs, tmp_path: Path,
                                                             drop: str, match: str) -> None:
    src = Path(llama_fp8_dirs[0])
    shards = [{k: v for k, v in load_file(f).items() if k != drop}
              for f in sorted(src.glob("*.safetensors"))]
    cfg = json.loads((src / "config.json").read_text())
    bad = _write(src, tmp_path / "bad", shards, cfg["quantization_config"])
    with pytest.raises(ValueError, match=match) as err:
        _load(str(bad))
    assert "\n" not in str(err.value)
