"""Tensor-parallel linear layers (the nano-vllm / Megatron split).

Column-parallel layers split the output features over ranks (each rank computes its slice, no
communication); row-parallel layers split the input features and sum the partial products
with one all-reduce. A block is column -> row, so it costs one all-reduce.

Every parameter carries ``weight_loader(param, loaded, shard_id=None)`` (its module's
``weight_loader`` method, attached by ``attach_weight_loaders``): it receives the whole
checkpoint tensor and copies this rank's slice into ``param`` (so a rank never materialises
more than one checkpoint tensor). ``shard_id`` names which part of a merged layer a
checkpoint tensor is ("q"/"k"/"v", or 0/1 for gate/up); ``None`` means the checkpoint already
holds the fused tensor (Phi-3's ``qkv_proj`` / ``gate_up_proj``), which is split the same way.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pd_cluster.models.layers import cpu_gemm
from pd_cluster.models.layers.tp import TPGroup


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor for {what}: shape {tuple(loaded.shape)} does not "
                         f"match the model's {tuple(param.shape)}")


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Replicated parameters (norms, biases of row layers): the whole tensor on every rank."""
    _check_shape(param, loaded, "a replicated parameter")
    param.data.copy_(loaded)


def attach_weight_loaders(root: nn.Module) -> None:
    """Give every parameter its module's ``weight_loader`` (or the replicated default).
    Called after the parameters are materialised: moving a meta model to a device makes
    new Parameter objects, which drops attributes set on the old ones."""
    for module in root.modules():
        loader = getattr(module, "weight_loader", default_weight_loader)
        for param in module.parameters(recurse=False):
            param.weight_loader = loader  # type: ignore[attr-defined]


class _Linear(nn.Module):
    """y = x W^T (+ b) with W of shape [out_per_rank, in_per_rank]; subclasses say how to slice.
    On CPU the weight may be stored transposed or packed after loading (cpu_gemm.py)."""

    cpu_gemm_layouts = ("transposed", "packed", "upcast")
    keep_layout = False  # True: the weight is read as a tensor elsewhere (cpu_gemm leaves it)

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.packed: torch.Tensor | None = None  # cpu_gemm's packed weight, if any
        self.packed_cpp = False  # a compiled step calls the C++ op with it (cpu_gemm.pack)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.linear(x, self.weight, self.bias, self.packed, self.packed_cpp)


class ReplicatedLinear(_Linear):
    """The same full weight on every rank."""

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        default_weight_loader(param, loaded)


class ColumnParallelLinear(_Linear):
    """Output features split over ranks: rank r holds rows [r*out/size, (r+1)*out/size)
    (of the weight and of the bias)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = TPGroup()) -> None:
        _, part = tp.split(out_features, "output features")
        super().__init__(in_features, part, bias, tp)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        part = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp.rank * part, part))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up): each is split over ranks on
    its own, so rank r holds [gate_r; up_r]."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp: TPGroup = TPGroup()) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias, tp)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:  # the checkpoint holds the fused tensor: split it into its parts
            for i, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        size = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, split by heads. When there are fewer KV heads than
    ranks, each KV head is replicated on ``size / num_kv_heads`` consecutive ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPGroup = TPGroup()) -> None:
        _, self.num_heads = tp.split(num_heads, "num_attention_heads")
        if tp.size >= num_kv_heads:
            if tp.size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size={tp.size} is not a multiple of "
                                 f"num_key_value_heads={num_kv_heads}")
            self.num_kv_heads, self.kv_replicas = 1, tp.size // num_kv_heads
        else:
            _, self.num_kv_heads = tp.split(num_kv_heads, "num_key_value_heads")
            self.kv_replicas = 1
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.total_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        # Built with the per-rank size directly (the parent would split the total again).
        _Linear.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias, tp)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:  # fused checkpoint qkv_proj
            for sid, part in zip("qkv", loaded.split(self.total_sizes, dim=0)):
                self.weight_loader(param, part, sid)
            return
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, start = self.kv_size, (self.tp.rank // self.kv_replicas) * self.kv_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class RowParallelLinear(_Linear):
    """Input features split over ranks; partial products summed by all-reduce. The bias is
    replicated and added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = TPGroup()) -> None:
        _, part = tp.split(in_features, "input features")
        super().__init__(part, out_features, bias, tp)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if param.dim() == 1:  # bias
            default_weight_loader(param, loaded)
            return
        part = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp.rank * part, part))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product (no bias, not reduced)."""
        return cpu_gemm.linear(x, self.weight, None, self.packed, self.packed_cpp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.partial(x))
        return y if self.bias is None else y + self.bias
