"""Build a model from a Hugging Face checkpoint directory (config.json + *.safetensors).

Weights stream in: one shard file open at a time (``safe_open``), one tensor read at a time
straight onto the target device, handed to its parameter's ``weight_loader``, which copies
this rank's slice (converting the dtype in the copy). Host memory therefore peaks near one
tensor (plus the mapped pages of the open shard), never the whole checkpoint.

Quantised checkpoints (``quantization_config``, see models/quant/) dequantise tensor by
tensor in the same stream: a quantised tensor is read with its scales (looked up in whichever
shard holds them) and handed on in the model's dtype; scales are never loaded on their own.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from pd_cluster.models.decoder import CausalLM
from pd_cluster.models.families import spec_from_config
from pd_cluster.models.kv_scales import attach_kv_scales, kv_scale_target
from pd_cluster.models.layers import moe
from pd_cluster.models.layers.tp import TPGroup
from pd_cluster.models.quant import QuantFormat, quant_format

logger = logging.getLogger(__name__)

# Checkpoint module -> (our fused module, its shard id). A checkpoint that already stores the
# fused module (Phi-3) maps by name with shard id None.
_STACKED = ((".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"),
            (".v_proj.", ".qkv_proj.", "v"), (".gate_proj.", ".gate_up_proj.", 0),
            (".up_proj.", ".gate_up_proj.", 1))
_IGNORED = ("rotary_emb.",)  # buffers some checkpoints carry; recomputed here


def checkpoint_files(model_dir: str) -> list[Path]:
    """The shard files: those named by model.safetensors.index.json, else every *.safetensors."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"model: {index} names missing shard files {missing[:3]}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_dir!r}")
    return files


def _tensor_files(files: list[Path], model_dir: str) -> dict[str, Path]:
    """Tensor name -> the shard holding it (the index's weight_map, else the shards' headers)."""
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return {name: Path(model_dir) / file for name, file in weight_map.items()}
    where: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            where.update((name, path) for name in f.keys())
    return where


def iter_checkpoint(model_dir: str, device: torch.device, fmt: QuantFormat | None = None,
                    dtype: torch.dtype = torch.float32,
                    only: Callable[[str], bool] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time, each read straight onto ``device``; with a quantisation
    ``fmt``, quantised tensors come dequantised to ``dtype`` and their scales do not come.
    ``only``: the names wanted (the others are not read)."""
    dev = str(device) if device.type != "cuda" or device.index is not None else "cuda:0"
    files = checkpoint_files(model_dir)
    where = _tensor_files(files, model_dir) if fmt is not None else {}
    used: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt", device=dev) as f:
            for name in f.keys():
                if only is not None and not only(name):
                    continue
                if fmt is None:
                    yield name, f.get_tensor(name)
                    continue
                if fmt.is_companion(name):
                    continue
                tensor = f.get_tensor(name)
                needed = fmt.companions(name, tensor)
                if needed:
                    extra = {n: _companion(n, name, path, f, where, dev) for n in needed}
                    used.update(needed)
                    name, tensor = fmt.dequantize(name, tensor, extra, dtype)
                    del extra
                yield name, tensor
    orphans = sorted(n for n in where if fmt is not None and only is None
                     and fmt.is_companion(n) and n not in used)
    if orphans:
        raise ValueError(f"checkpoint {model_dir!r} has scales whose tensors are missing or "
                         f"not quantised: {orphans[:3]}")


def _companion(name: str, owner: str, path: Path, f: Any, where: dict[str, Path],
               dev: str) -> torch.Tensor:
    """A scale tensor, from the open shard when it is there (the usual case), else from its own."""
    if name not in where:
        raise ValueError(f"checkpoint tensor {owner} is quantised but {name} is missing")
    if where[name] == path:
        return f.get_tensor(name)
    with safe_open(str(where[name]), framework="pt", device=dev) as other:
        return other.get_tensor(name)


def _target(name: str, params: dict[str, nn.Parameter]) -> tuple[str, Any] | None:
    if name in params:
        return name, None
    for theirs, ours, shard in _STACKED:
        if theirs in name:
            mapped = name.replace(theirs, ours)
            if mapped in params:
                return mapped, shard
    return moe.checkpoint_target(name, params)  # per-expert tensors, Mixtral's names


def load_weights(model: CausalLM, model_dir: str, device: torch.device,
                 fmt: QuantFormat | None = None) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = model.spec.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    dtype = next(iter(params.values())).dtype
    kv_scales: dict[tuple[int, str], torch.Tensor] = {}
    for name, tensor in iter_checkpoint(model_dir, device, fmt, dtype):
        scale_of = kv_scale_target(name)
        if scale_of is not None:  # a static KV cache scale, not a parameter
            kv_scales[scale_of] = tensor
            continue
        if (any(s in name for s in _IGNORED) or (tied and name == "lm_head.weight")
                or name.startswith(model.spec.skipped_weights)):
            continue
        target = _target(name, params)
        if target is None:
            unexpected.append(name)
            continue
        pname, shard = target
        param = params[pname]
        loader = param.weight_loader  # type: ignore[attr-defined]
        with torch.no_grad():
            loader(param, tensor, shard) if shard is not None else loader(param, tensor)
        loaded.add(pname + ("" if shard is None else f"#{shard}"))
        del tensor
    needed = set()
    for pname, param in params.items():
        if tied and pname == "lm_head.weight":
            continue
        if ".qkv_proj." in pname:
            parts = [f"{pname}#{s}" for s in "qkv"]
        elif ".gate_up_proj." in pname:
            parts = [f"{pname}#0", f"{pname}#1"]
        else:
            parts = [f"{pname}#{s}" for s in moe.expected_shards(pname, param)]
        if pname not in loaded and not (parts and all(p in loaded for p in parts)):
            needed.add(pname)
    if needed or unexpected:
        raise ValueError(f"checkpoint {model_dir!r} does not match {model.spec.architecture}: "
                         f"missing {sorted(needed)[:5]}, unexpected {sorted(unexpected)[:5]}")
    attach_kv_scales(model.model.layers, kv_scales)


def load_model(model_dir: str, cfg: dict[str, Any], dtype: torch.dtype, device: torch.device,
               tp: TPGroup = TPGroup()) -> CausalLM:
    """The model for this rank of ``tp``, weights in ``dtype`` on ``device``.

    What the engine reads from it: ``model.args`` (a ``KVLayout``: num_layers, this rank's
    num_kv_heads, head_dim, vocab_size), ``model(input_ids, positions, ctx)`` -> hidden
    states and ``model.compute_logits(hidden)`` -> fp32 logits over the whole vocabulary.
    """
    spec = spec_from_config(cfg)
    with torch.device("meta"):
        model = CausalLM(spec, tp)
    model.materialize(dtype, device)
    load_weights(model, model_dir, device, quant_format(cfg))
    args = model.args
    logger.info("loaded %s: %d layers, hidden %d, kv heads %d x %d per rank (tp %d/%d), "
                "%.1fM params, %s on %s", spec.architecture, args.num_layers, spec.hidden_size,
                args.num_kv_heads, args.head_dim, tp.rank, tp.size,
                sum(p.numel() for p in model.parameters()) / 1e6, dtype, device)
    return model.eval()
