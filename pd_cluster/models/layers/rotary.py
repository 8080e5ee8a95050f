"""Rotary position embeddings, every variant as Hugging Face computes it.

``read_rope`` turns a config (transformers 4's ``rope_theta`` / ``rope_scaling`` or 5's
``rope_parameters``, possibly per layer type) into a ``RopeSpec``; ``inv_freq_and_factor``
computes the inverse frequencies and the attention factor (which scales cos and sin) like
transformers' ``ROPE_INIT_FUNCTIONS``; ``RotaryEmbedding`` applies them to q and k.

Variants whose frequencies depend on the sequence length (HF decides per forward call from
its largest position):
- ``longrope`` uses the long factors when that length exceeds the original context, so a
  token at position p was rotated with the long factors iff max(prompt length, p + 1) >
  original_max_position_embeddings: the runner passes that length per token (``rope_lens``).
- ``dynamic`` (NTK) only rescales beyond ``max_position_embeddings``, which the engine never
  reaches (max_model_len <= max_position_embeddings): within it, it is the default RoPE.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str
    theta: float
    head_dim: int
    rotary_dim: int  # head_dim * partial_rotary_factor: the leading dims that rotate
    max_position_embeddings: int
    params: dict[str, Any] = field(default_factory=dict, compare=False)  # the variant's settings

    @property
    def key(self) -> tuple:
        """Equal keys compute equal cos/sin (layers with the same RoPE share one per step)."""
        return (self.rope_type, self.theta, self.rotary_dim, self.max_position_embeddings,
                repr(sorted(self.params.items())))


def read_rope(cfg: dict[str, Any], head_dim: int, layer_type: str | None = None,
              default_theta: float = 10000.0, legacy_scaling: bool = True) -> RopeSpec:
    """The RoPE of layers of ``layer_type`` (None: the model's only RoPE).

    transformers 5 writes ``rope_parameters`` (nested per layer type for Gemma 3 and the like);
    transformers 4 wrote ``rope_theta`` and ``rope_scaling``. A legacy ``rope_scaling`` wins, as
    in HF; ``legacy_scaling=False`` keeps it off layers it does not apply to (Gemma 3's local).
    """
    params_cfg = cfg.get("rope_parameters") or {}
    if layer_type is not None and isinstance(params_cfg.get(layer_type), dict):
        params = dict(params_cfg[layer_type])
    elif params_cfg and all(isinstance(v, dict) for v in params_cfg.values()):
        raise ValueError(f"rope_parameters: no entry for layer type {layer_type!r} "
                         f"(has {sorted(params_cfg)})")
    else:
        params = dict(params_cfg)
    if legacy_scaling and cfg.get("rope_scaling"):
        params.update(cfg["rope_scaling"])
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or default_theta)
    partial = float(params.pop("partial_rotary_factor", None)
                    or cfg.get("partial_rotary_factor") or 1.0)
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    if rope_type in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings") or max_pos)
    return RopeSpec(rope_type, theta, head_dim, int(head_dim * partial), max_pos, params)


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(spec: RopeSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    p = spec.params
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    p, dim, base = spec.params, spec.rotary_dim, spec.theta
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or spec.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all
                            else mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # share of the unscaled frequency per dim
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention_factor


def _longrope(spec: RopeSpec, long: bool) -> tuple[torch.Tensor, float]:
    p = spec.params
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or spec.max_position_embeddings / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    ext = torch.tensor(p["long_factor"] if long else p["short_factor"], dtype=torch.float32)
    shape = torch.arange(0, spec.rotary_dim, 2, dtype=torch.int64).float() / spec.rotary_dim
    return 1.0 / (ext * spec.theta ** shape), attention_factor


def inv_freq_and_factor(spec: RopeSpec, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim / 2] (fp32, CPU) and the attention factor, for a
    forward whose longest sequence is ``seq_len`` (only longrope and dynamic look at it)."""
    t, dim = spec.rope_type, spec.rotary_dim
    if t == "yarn":
        return _yarn(spec)
    if t == "longrope":
        return _longrope(spec, long=bool(seq_len and seq_len >
                                         spec.params["original_max_position_embeddings"]))
    base = spec.theta
    if t == "dynamic" and seq_len and seq_len > spec.max_position_embeddings:
        factor = spec.params["factor"]
        base = base * ((factor * seq_len / spec.max_position_embeddings) - (factor - 1)) \
            ** (dim / (dim - 2))
    inv = _default_inv_freq(base, dim)
    if t == "linear":
        inv = inv / spec.params["factor"]
    elif t == "llama3":
        inv = _llama3(spec, inv)
    return inv, 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin for a step's positions, computed on the fly in fp32 (as HF does: one multiply
    per entry, then cos/sin) and cast to the activations' dtype."""

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        self.spec = spec
        with torch.device("cpu"):  # models are built on the meta device; these are real
            self._inv, self._factor = inv_freq_and_factor(spec)
            self._long = (inv_freq_and_factor(spec, seq_len=spec.params[
                "original_max_position_embeddings"] + 1)[0] if spec.rope_type == "longrope"
                else None)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def frequencies(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The inverse frequencies (and longrope's long ones) on ``dev``, copied once."""
        if dev not in self._on:
            self._on[dev] = (self._inv.to(dev), None if self._long is None else self._long.to(dev))
        return self._on[dev]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                rope_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inv, long = self.frequencies(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        if long is not None:
            lens = positions + 1 if rope_lens is None else rope_lens
            use_long = lens > self.spec.params["original_max_position_embeddings"]
            freqs = torch.where(use_long[:, None], positions.float()[:, None] * long[None, :],
                                freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self._factor, emb.sin() * self._factor
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate the leading ``rotary_dim`` dims of q and k ([tokens, heads, head_dim])."""
        cos, sin = cos_sin
        rot = cos.shape[-1]
        if rot == q.shape[-1]:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q_rot, q_pass = q[..., :rot], q[..., rot:]
        k_rot, k_pass = k[..., :rot], k[..., rot:]
        return (torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q_pass), dim=-1),
                torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k_pass), dim=-1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
