"""DeepSeek-V3's multi-token prediction (MTP) layer, read from the served checkpoint for
``speculative: {method: mtp}`` (the target model itself skips it: ModelSpec.skipped_weights).

Depth 1 of DeepSeek's MTP, as vLLM (deepseek_mtp.py) and SGLang (deepseek_nextn.py) serve it:
at position p it reads the target's hidden state h_p (the model's output, after its final
norm, as both feed it) and the embedding of token p+1,

    o_p = block(eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)]))

where ``block`` is one decoder layer of the model's own kind (checkpoint layer index
num_hidden_layers, keys ``model.layers.{N}.self_attn/mlp/...``), attending over its own KV
cache of earlier positions, and ``shared_head.head(shared_head.norm(o_p))`` scores token p+2.
Chained (vLLM's num_speculative_tokens > num_nextn_predict_layers), o_p stands in for the
target's hidden state at the next position. Like vLLM, the embedding at position 0 is zeroed.

The layer keeps its own embedding and head (DeepSeek's checkpoints store copies under the
layer; where absent, the model's ``model.embed_tokens`` / ``lm_head``), unsharded: it runs on
rank 0 only, whatever the target's tensor-parallel size."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from pd_cluster.models.context import ForwardContext
from pd_cluster.models.decoder import DecoderLayer
from pd_cluster.models.families import spec_from_config
from pd_cluster.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pd_cluster.models.layers.linear import attach_weight_loaders
from pd_cluster.models.layers.norm import RMSNorm
from pd_cluster.models.layers.rotary import RotaryEmbedding
from pd_cluster.models.loader import _target, iter_checkpoint
from pd_cluster.models.quant import quant_format

logger = logging.getLogger(__name__)

_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")  # not the block's


class _SharedHead(nn.Module):
    def __init__(self, vocab: int, hidden: int, eps: float, kind: str) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps, kind)
        self.head = ParallelLMHead(vocab, hidden)


class MTPLayer(nn.Module):
    """One MTP depth: a HiddenStateHead (engine/spec/hidden_head.py)."""

    def __init__(self, cfg: dict[str, Any], depth: int = 0) -> None:
        super().__init__()
        n = int(cfg["num_hidden_layers"])
        self.layer_index = n + depth  # its checkpoint index
        full = spec_from_config({**cfg, "num_hidden_layers": n + depth + 1})
        spec = replace(full, layers=(full.layers[-1],))  # the block alone, as layer 0
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, h)
        self.enorm = RMSNorm(h, eps, spec.norm)
        self.hnorm = RMSNorm(h, eps, spec.norm)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DecoderLayer(spec, 0)
        self.shared_head = _SharedHead(spec.vocab_size, h, eps, spec.norm)
        self.rope_key = spec.layers[0].attention.rope.key
        self.rotary = RotaryEmbedding(spec.layers[0].attention.rope)

    def kv_cache_specs(self, dtype: torch.dtype) -> list[Any]:
        return [self.block.self_attn.kv_cache_spec(dtype)]

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """token_ids[i] = t_{p+1}, hidden[i] = h_p at positions[i] = p -> o_p [T, hidden]."""
        e = self.embed_tokens(token_ids)
        e = e.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden.to(e.dtype))], dim=-1))
        ctx.rope = {self.rope_key: self.rotary.cos_sin(positions, x.dtype, ctx.rope_lens)}
        return self.block(x, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(hidden)).float()


def mtp_layer_count(cfg: dict[str, Any]) -> int:
    return int(cfg.get("num_nextn_predict_layers") or 0)


def load_mtp(model_dir: str, cfg: dict[str, Any], dtype: torch.dtype, device: torch.device
             ) -> MTPLayer:
    """The checkpoint's first MTP layer (DeepSeek-V3/R1 ship one); ValueError naming
    ``speculative.method`` when the checkpoint has none."""
    if mtp_layer_count(cfg) < 1:
        raise ValueError(f"speculative.method: mtp needs a checkpoint with MTP layers "
                         f"(num_nextn_predict_layers >= 1); {model_dir} has none")
    with torch.device("meta"):
        layer = MTPLayer(cfg)
    layer.to(dtype).to_empty(device=device)
    attach_weight_loaders(layer)
    params = dict(layer.named_parameters())
    prefix = f"model.layers.{layer.layer_index}."
    shared = {"model.embed_tokens.weight": "embed_tokens.weight",
              "lm_head.weight": "shared_head.head.weight"}
    found: dict[str, torch.Tensor] = {}  # the model's embedding/head: used where the layer's lack
    loaded: set[str] = set()
    for name, tensor in iter_checkpoint(model_dir, device, quant_format(cfg), dtype,
                                        only=lambda n: n.startswith(prefix) or n in shared):
        if name in shared:
            found[shared[name]] = tensor
            continue
        rest = name[len(prefix):]
        mapped = rest if rest.startswith(_OWN) else "block." + rest
        target = _target(mapped, params)
        if target is None:
            raise ValueError(f"checkpoint {model_dir!r}: unexpected MTP tensor {name}")
        pname, shard = target
        loader = params[pname].weight_loader  # type: ignore[attr-defined]
        with torch.no_grad():
            loader(params[pname], tensor) if shard is None else loader(params[pname], tensor,
                                                                       shard)
        loaded.add(pname)
    if cfg.get("tie_word_embeddings") and "model.embed_tokens.weight" in shared:
        found.setdefault("shared_head.head.weight", found.get("embed_tokens.weight"))
    for pname, tensor in found.items():
        if pname not in loaded and tensor is not None:
            with torch.no_grad():
                params[pname].weight_loader(params[pname], tensor)  # type: ignore[attr-defined]
            loaded.add(pname)
    missing = [p for p in params if p not in loaded]  # a fused one: any part counts
    if missing:
        raise ValueError(f"checkpoint {model_dir!r}: MTP layer {layer.layer_index} lacks "
                         f"{sorted(missing)[:5]}")
    logger.info("MTP layer %d loaded (%.1fM params)", layer.layer_index,
                sum(p.numel() for p in layer.parameters()) / 1e6)
    return layer.eval()

