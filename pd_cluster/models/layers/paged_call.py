"""The attention call (and the tensor-parallel all-reduce) as opaque ops, so a compiled
decoder keeps them out of its graph.

The paged-cache part of an attention layer (write this step's KV, attend over the blocks, the
KV connector's per-layer loads and saves) reads Python state a graph cannot hold: the step's
metadata with its host lists, the cache tensors, the connector. Everything around it (the
projections, norms, rotary, the MLP) is plain tensor work that ``torch.compile`` fuses.

A compiled model calls ``torch.ops.pd_cluster.paged_attention`` at each layer: an opaque
custom op whose inputs are the layer's tensors and its index. The op runs the layer's
``paged_forward`` with the step's ``ForwardContext``, which reaches it through a context
variable set around the compiled call (``step_scope``): a custom op's arguments can only be
tensors and scalars, and the variable is scoped to one forward on one thread. Eager models
call ``paged_forward`` directly and never touch the variable.

``pd_cluster::tp_all_reduce`` sums a tensor over the model's tensor-parallel group (from the
same scope) eagerly, on a copy (an op may not modify its inputs).
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import torch

from pd_cluster.models.context import ForwardContext
from pd_cluster.models.layers.tp import TPGroup


class PagedLayer(Protocol):
    layer_idx: int

    def paged_forward(self, inputs: Sequence[torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        """The layer's cache write + attention over the paged blocks -> [tokens, heads, dim]."""


@dataclass(frozen=True)
class _Step:
    ctx: ForwardContext
    layers: Sequence[PagedLayer]  # by layer index
    tp: TPGroup


_STEP: ContextVar[_Step | None] = ContextVar("pd_cluster_paged_step", default=None)


@contextmanager
def step_scope(ctx: ForwardContext, layers: Sequence[PagedLayer], tp: TPGroup
               ) -> Iterator[None]:
    """The context the compiled forward's opaque ops run with (this thread, this call)."""
    token = _STEP.set(_Step(ctx, layers, tp))
    try:
        yield
    finally:
        _STEP.reset(token)


def _step() -> _Step:
    step = _STEP.get()
    if step is None:
        raise RuntimeError("a pd_cluster op ran outside step_scope (a compiled model must be "
                           "called through CompiledModel)")
    return step


@torch.library.custom_op("pd_cluster::paged_attention", mutates_args=())
def paged_attention(inputs: list[torch.Tensor], layer_idx: int,
                    out_tail: list[int]) -> torch.Tensor:
    step = _step()
    out = step.layers[layer_idx].paged_forward(inputs, step.ctx)
    # An op's output may not alias its inputs (the backend may return a view of q).
    return out if not any(out.data_ptr() == t.data_ptr() for t in inputs) else out.clone()


@paged_attention.register_fake
def _(inputs: list[torch.Tensor], layer_idx: int, out_tail: list[int]) -> torch.Tensor:
    return inputs[0].new_empty(inputs[0].shape[0], *out_tail)


@torch.library.custom_op("pd_cluster::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _step().tp.all_reduce(x.clone())


@tp_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def paged_call(layer: PagedLayer, inputs: Sequence[torch.Tensor], out_tail: Sequence[int],
               ctx: ForwardContext) -> torch.Tensor:
    """The layer's paged attention: the opaque op while compiling, a direct call otherwise.
    ``out_tail``: the output's shape after the token dimension."""
    if torch.compiler.is_compiling():
        return torch.ops.pd_cluster.paged_attention(list(inputs), layer.layer_idx, list(out_tail))
    return layer.paged_forward(inputs, ctx)
