"""A checkpoint's static KV cache scales (vLLM's ``k_scale``/``v_scale`` per attention layer,
or one ``kv_scale`` for both): per-tensor scales an FP8 KV cache writes with instead of
computing its own per block (kernels/kv_quant.py). A stored value times the scale is the value
it stands for. An engine whose cache is not FP8 ignores them, as vLLM does."""
from __future__ import annotations

import re
from typing import Any

import torch

_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale|kv_scale)$")


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer index, "k_scale" | "v_scale" | "kv_scale") for a KV scale tensor's name."""
    m = _NAME.search(name)
    return None if m is None else (int(m.group(1)), m.group(2))


def attach_kv_scales(layers: Any, found: dict[tuple[int, str], torch.Tensor]) -> None:
    """Sets each attention layer's ``kv_scales`` (K, V floats) from what the checkpoint held
    (a scale it lacks is 1.0, vLLM's default); ValueError for a non-positive or non-scalar
    scale, naming it."""
    by_layer: dict[int, dict[str, float]] = {}
    for (layer, which), tensor in found.items():
        if tensor.numel() != 1 or not float(tensor.float().reshape(())) > 0:
            raise ValueError(f"checkpoint KV scale layers.{layer}.self_attn.{which} must be "
                             f"one positive number, got shape {tuple(tensor.shape)}")
        value = float(tensor.float().reshape(()))
        names = ("k_scale", "v_scale") if which == "kv_scale" else (which,)
        by_layer.setdefault(layer, {}).update({n: value for n in names})
    for layer, scales in by_layer.items():
        if layer >= len(layers):
            raise ValueError(f"checkpoint KV scale for layer {layer}: the model has "
                             f"{len(layers)} layers")
        layers[layer].self_attn.kv_scales = (scales.get("k_scale", 1.0),
                                             scales.get("v_scale", 1.0))
