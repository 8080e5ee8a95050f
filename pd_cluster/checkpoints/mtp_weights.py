"""DeepSeek-V3's MTP layers for generated checkpoints (``num_nextn_predict_layers``): the
tensors DeepSeek's checkpoints carry after the decoder layers, named as they name them,
``model.layers.{N}.`` + enorm, hnorm, eh_proj, shared_head.norm, shared_head.head,
embed_tokens (copies of the model's, as DeepSeek stores them) and one decoder layer's own
keys (self_attn, mlp, norms), N = num_hidden_layers + depth. Transformers' DeepseekV3 builds
no MTP layer and skips these keys on load, so the HF oracle of the target is unchanged; the
engine reads them for ``speculative: {method: mtp}`` (models/mtp.py).

The decoder layer's tensors come from a model one layer deeper, made and saved by
transformers itself (so its experts are in the checkpoint layout), initialised by the maker's
rule from another seed: the target's own weights do not change."""
from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MTP_SEED_OFFSET = 7919  # the MTP layers' generator: the target's seed + this


def mtp_tensors(model: Any, n_real_tokens: int, seed: int,
                init_weights: Callable[[Any, int, int], None]) -> dict[str, Any]:
    """name -> tensor for every MTP layer ``model.config`` asks for ({} for none)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = model.config
    count = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    if count < 1:
        return {}
    n = cfg.num_hidden_layers
    deeper_cfg = type(cfg).from_dict({**cfg.to_dict(), "num_hidden_layers": n + count})
    deeper = AutoModelForCausalLM.from_config(deeper_cfg).to(torch.float32).eval()
    init_weights(deeper, n_real_tokens, seed + MTP_SEED_OFFSET)
    from transformers.utils import logging as hf_logging
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            deeper.save_pretrained(tmp, safe_serialization=True)
            saved = load_file(str(Path(tmp) / "model.safetensors"))
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    gen = torch.Generator().manual_seed(seed + MTP_SEED_OFFSET + 1)
    h = cfg.hidden_size
    state = model.state_dict()
    out: dict[str, Any] = {}
    for depth in range(count):
        prefix = f"model.layers.{n + depth}."
        out.update({k: v.clone() for k, v in saved.items() if k.startswith(prefix)})
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            out[f"{prefix}{norm}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
        out[f"{prefix}eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen) / math.sqrt(2 * h)
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        out[f"{prefix}shared_head.head.weight"] = head.detach().clone()
        out[f"{prefix}embed_tokens.weight"] = state["model.embed_tokens.weight"].detach().clone()
    return out
