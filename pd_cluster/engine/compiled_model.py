"""The decoder's forward compiled once per process (``torch.compile``, inductor), attention
left out of the graph as an opaque op (models/layers/paged_call.py).

One graph covers the whole decoder (embedding, every layer's projections, norms, rotary and
MLP or MoE, the final norm), dynamic in the number of tokens, so a step of any batch size
reuses it (no recompile per size; a one-token step may add one specialised graph). Inductor's
caches (FX graph, AOT autograd) persist under ``cache_root()/inductor``, so a restarted
process loads the compiled code instead of generating it again; it still traces the model
(seconds).

``engine.compile`` turns it on or off; unset, ``$PD_CLUSTER_COMPILE`` decides ("1" on;
default off until measured to win), so a test suite can default to eager and opt in per test.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

from pd_cluster.models.context import ForwardContext
from pd_cluster.models.layers.paged_call import step_scope
from pd_cluster.paths import cache_root

logger = logging.getLogger(__name__)

COMPILE_ENV = "PD_CLUSTER_COMPILE"


def compile_enabled(setting: bool | None) -> bool:
    """``engine.compile`` when set, else ``$PD_CLUSTER_COMPILE`` (default off)."""
    if setting is not None:
        return setting
    return os.environ.get(COMPILE_ENV, "0").strip().lower() not in ("0", "false", "no", "off")


def use_persistent_cache() -> str:
    """Point inductor's on-disk caches at the project's cache dir (unless the user chose
    one with ``TORCHINDUCTOR_CACHE_DIR``); returns the dir."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not path:
        path = str(cache_root() / "inductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.makedirs(path, exist_ok=True)
    return path


class CompiledModel:
    """Calls like the model (``(input_ids, positions, ctx) -> hidden``) through one compiled
    graph (the logits stay eager: one matmul on the rows that sample)."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.cache_dir = use_persistent_cache()
        self._layers = [layer.self_attn for layer in model.model.layers]
        for rotary in model.model.rotary.values():
            rotary.frequencies(device)  # copied before tracing, not a guard that fails once
        # Dynamo keeps one cache per code object (DecoderModel.forward), shared by every model
        # in the process: each model (a test process holds many) takes an entry or two.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # fullgraph: a graph break would silently split the step into many small graphs.
        self._compiled = torch.compile(model.model, fullgraph=True)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor:
        # The token count varies every step: one graph for all of them, one token included
        # (unbacked: no specialisation of sizes 0 and 1).
        for t in (input_ids, positions, ctx.rope_lens):
            if t is not None:
                torch._dynamo.decorators.mark_unbacked(t, 0)
        with step_scope(ctx, self._layers, self.model.tp):
            return self._compiled(input_ids, positions, ctx)
