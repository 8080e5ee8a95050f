"""The routed experts of an MoE layer: stacked weights, sharded on load, computed grouped.

Weights are stacked over experts: ``gate_up_proj`` [E, 2*I_r, H] (this rank's gate rows, then
its up rows) and ``down_proj`` [E, H, I_r], where I_r is this rank's share of each expert's
intermediate size (tensor parallelism splits every expert the way a dense MLP is split, so
each rank computes a partial sum and the block does one all-reduce). gpt-oss adds biases:
``gate_up_proj_bias`` [E, 2*I_r] and ``down_proj_bias`` [E, H], the latter added on rank 0
only so the all-reduce counts it once.

Checkpoints come per expert (``experts.{e}.gate_proj/up_proj/down_proj``, Mixtral's
``w1/w3/w2``: shard ids ``(e, 0|1)`` and ``e``) or fused (``shard_id=None``): transformers'
layout [E, 2I, H] / [E, H, I], or gpt-oss's transposed, gate/up *interleaved* layout
[E, H, 2I] (gate in even columns) / [E, I, H] (``fused_layout="gpt_oss"``).

Compute is grouped: the (token, slot) pairs are sorted by expert and each active expert runs
one matmul over its contiguous run of tokens (``grouped_experts``); a Triton kernel doing the
same on CUDA is in kernels/fused_moe.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pd_cluster.models.layers.mlp import activation
from pd_cluster.models.layers.tp import TPGroup

FUSED_LAYOUTS = ("hf", "gpt_oss")


@dataclass(frozen=True)
class ExpertsSpec:
    num_experts: int
    hidden_size: int
    intermediate_size: int  # per expert, before the tensor-parallel split
    activation: str = "silu"  # a gated activation name, or "swiglu_clamped" (gpt-oss)
    bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    fused_layout: str = "hf"

    def __post_init__(self) -> None:
        if self.fused_layout not in FUSED_LAYOUTS:
            raise ValueError(f"fused_layout {self.fused_layout!r} is not one of {FUSED_LAYOUTS}")


def gated_activation(spec: ExpertsSpec) -> Callable[[torch.Tensor], torch.Tensor]:
    """[N, 2*I_r] (gate | up) -> [N, I_r]. Element-wise, so any intermediate split is exact."""
    if spec.activation == "swiglu_clamped":
        alpha, limit = spec.swiglu_alpha, spec.swiglu_limit

        def swiglu_clamped(h: torch.Tensor) -> torch.Tensor:
            gate, up = h.chunk(2, dim=-1)
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
            return (up + 1) * (gate * torch.sigmoid(gate * alpha))
        return swiglu_clamped
    act = activation(spec.activation)

    def gated(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return act(gate) * up
    return gated


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K] -> (order [T*K]: flat (token, slot) indices sorted by expert (stable, so
    tokens keep their order within an expert), counts [E]: pairs per expert)."""
    flat = ids.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor,
                    act: Callable[[torch.Tensor], torch.Tensor],
                    b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token, one matmul per active
    expert (torch, any device). Rounding as transformers' default (``grouped_mm``) experts:
    biases added after the matmul, each pair's output times its weight in the weights' dtype
    (fp32 for Mixtral and DeepSeek-V3), the top-k products summed in that dtype, then cast."""
    num_tokens, top_k = ids.shape
    order, counts = sort_by_expert(ids, w13.shape[0])
    xs = x[order // top_k]
    out = torch.empty(order.numel(), w2.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):  # one host sync: the group sizes
        if n == 0:
            continue
        h = F.linear(xs[start:start + n], w13[e])
        if b13 is not None:
            h = h + b13[e]
        y = F.linear(act(h), w2[e])
        out[start:start + n] = y if b2 is None else y + b2[e]
        start += n
    by_pair = torch.empty_like(out)
    by_pair[order] = out  # back to (token, slot) order: the top-k sum is a reshape
    weighted = by_pair * weights.reshape(-1, 1)
    return weighted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


class MoEExperts(nn.Module):
    # Expert weights [E, out, in] may be stored with their last two dims column-major on CPU
    # (cpu_gemm.py): F.linear on w[e] then runs a plain GEMM. Packing would need one op per
    # expert and the torch loop's signature (the CUDA kernel's too) to change.
    cpu_gemm_layouts = ("transposed",)

    def __init__(self, spec: ExpertsSpec, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        _, self.part = tp.split(spec.intermediate_size, "the experts' intermediate_size")
        e, h, i = spec.num_experts, spec.hidden_size, self.part
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        if spec.bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.act = gated_activation(spec)

    # -- loading (linear.attach_weight_loaders gives every parameter this method) ---------
    def _rank_slice(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.narrow(dim, self.tp.rank * self.part, self.part)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if param is self.down_proj_bias:  # replicated; rank 0 adds it
            self._copy(param if shard_id is None else param[shard_id], loaded, "down_proj_bias")
        elif param is self.gate_up_proj or param is self.gate_up_proj_bias:
            self._load_gate_up(param, loaded, shard_id)
        elif param is self.down_proj:
            self._load_down(param, loaded, shard_id)
        else:
            raise ValueError("MoEExperts.weight_loader: not one of this module's parameters")

    def _load_gate_up(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any) -> None:
        i = self.part
        if shard_id is not None:  # (expert, 0 gate | 1 up): one expert's [I, H] (or [I])
            e, which = shard_id
            dst = param[e].narrow(0, which * i, i)
            self._copy(dst, self._rank_slice(loaded, 0), "an expert's gate/up")
            return
        if self.spec.fused_layout == "gpt_oss":  # [E, H, 2I] / [E, 2I], gate|up interleaved
            gate, up = loaded[..., 0::2], loaded[..., 1::2]
            if loaded.dim() == 3:
                gate, up = gate.transpose(1, 2), up.transpose(1, 2)
        else:  # transformers' [E, 2I, H]: gate rows then up rows
            gate, up = loaded.chunk(2, dim=1)
        self._copy(param.narrow(1, 0, i), self._rank_slice(gate, 1), "experts' gate")
        self._copy(param.narrow(1, i, i), self._rank_slice(up, 1), "experts' up")

    def _load_down(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any) -> None:
        if shard_id is not None:  # one expert's [H, I]
            self._copy(param[shard_id], self._rank_slice(loaded, 1), "an expert's down_proj")
            return
        if self.spec.fused_layout == "gpt_oss":  # [E, I, H]
            loaded = loaded.transpose(1, 2)
        self._copy(param, self._rank_slice(loaded, 2), "experts' down_proj")

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
        if dst.shape != src.shape:
            raise ValueError(f"checkpoint tensor for {what}: shape {tuple(src.shape)} (this "
                             f"rank's slice) does not match the model's {tuple(dst.shape)}")
        dst.copy_(src)

    # -- compute -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                fused: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """This rank's partial sum [T, H] (the caller all-reduces). ``fused``: a kernel with
        ``grouped_experts``'s signature to use instead of the torch loop; by default the
        Triton kernel on CUDA tensors, the torch loop elsewhere."""
        b2 = self.down_proj_bias if self.tp.rank == 0 else None
        if fused is None and torch.compiler.is_compiling():
            # The per-expert loop sizes its matmuls from the routing (host values): one
            # opaque op in a compiled graph, like attention.
            s = self.spec
            return torch.ops.pd_cluster.grouped_experts(
                x, self.gate_up_proj, self.down_proj, weights, ids, self.gate_up_proj_bias, b2,
                s.activation, s.swiglu_alpha, s.swiglu_limit)
        run = fused
        if run is None and x.is_cuda:
            from kernels.fused_moe import fused_experts  # imports Triton: only on CUDA
            run = fused_experts
        run = run or grouped_experts
        return run(x, self.gate_up_proj, self.down_proj, weights, ids, self.act,
                   self.gate_up_proj_bias, b2)


@torch.library.custom_op("pd_cluster::grouped_experts", mutates_args=())
def _grouped_experts_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        weights: torch.Tensor, ids: torch.Tensor, b13: torch.Tensor | None,
                        b2: torch.Tensor | None, activation: str, swiglu_alpha: float,
                        swiglu_limit: float) -> torch.Tensor:
    """``MoEExperts.forward``'s default path for a compiled graph (the activation travels as
    its ``ExpertsSpec`` fields: an op's arguments cannot be functions)."""
    act = gated_activation(ExpertsSpec(w13.shape[0], x.shape[-1], w2.shape[-1], activation,
                                       swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit))
    if x.is_cuda:
        from kernels.fused_moe import fused_experts
        return fused_experts(x, w13, w2, weights, ids, act, b13, b2)
    return grouped_experts(x, w13, w2, weights, ids, act, b13, b2)


@_grouped_experts_op.register_fake
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
      ids: torch.Tensor, b13: torch.Tensor | None, b2: torch.Tensor | None, activation: str,
      swiglu_alpha: float, swiglu_limit: float) -> torch.Tensor:
    return x.new_empty(x.shape[0], w2.shape[1])
