"""CUDA IPC handles of a decode engine's KV cache layers as plain msgpack data (the cuda_ipc
pipe's handshake reply; never pickle over a socket), and the producer's opening of them.

torch's own sharing (torch/multiprocessing/reductions.py) pickles ``storage._share_cuda_()``'s
tuple: (device, handle, storage size, storage offset in the allocation, ref counter handle, ref
counter offset, event handle, event sync required); the tensor's offset in its storage and
its shape come beside it, and the GPU's UUID (each engine numbers the GPUs it sees). The same fields travel here as a dict of ints, bytes and a bool,
each type checked before torch sees it (``UntypedStorage._new_shared_cuda``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_FIELDS = (("device", int), ("handle", bytes), ("size", int), ("offset", int),
           ("ref_handle", bytes), ("ref_offset", int), ("event", bytes), ("event_sync", bool))


def export_layer(cache: torch.Tensor) -> dict[str, Any]:
    """One layer's handle (the consumer; its cache is a contiguous CUDA tensor)."""
    storage = cache.untyped_storage()
    values = storage._share_cuda_()
    out = {name: (value if value is not None or kind is not bytes else b"")
           for (name, kind), value in zip(_FIELDS, values)}
    out.update(tensor_offset=cache.storage_offset() * cache.element_size(),
               nbytes=cache.numel() * cache.element_size(),
               uuid=str(torch.cuda.get_device_properties(cache.device).uuid))
    return out


def check_handle(h: Any) -> dict[str, Any]:
    """The handle with its fields' types checked (ValueError naming the first bad one)."""
    if not isinstance(h, dict):
        raise ValueError("a layer's CUDA handle is not a mapping")
    for name, kind in _FIELDS + (("tensor_offset", int), ("nbytes", int), ("uuid", str)):
        if type(h.get(name)) is not kind:
            raise ValueError(f"CUDA handle field {name!r}: expected {kind.__name__}")
    if min(h["size"], h["offset"], h["tensor_offset"], h["nbytes"], h["device"]) < 0:
        raise ValueError("CUDA handle: negative size or offset")
    if h["tensor_offset"] + h["nbytes"] > h["size"]:
        raise ValueError("CUDA handle: the layer lies past its storage")
    return h


def open_layer(h: dict[str, Any], parts: int, num_blocks: int, block_bytes: int
               ) -> torch.Tensor:
    """The producer: the consumer's layer as a [parts, num_blocks, block_bytes] uint8 tensor
    over the opened allocation (kept open while the tensor lives)."""
    h = check_handle(h)
    if parts * num_blocks * block_bytes != h["nbytes"]:
        raise ValueError("CUDA handle: its size differs from the announced layout")
    torch.cuda._lazy_init()
    device = local_index(h["uuid"], [str(torch.cuda.get_device_properties(i).uuid)
                                     for i in range(torch.cuda.device_count())])
    storage = torch.UntypedStorage._new_shared_cuda(
        device, h["handle"], h["size"], h["offset"], h["ref_handle"], h["ref_offset"],
        h["event"] or None, h["event_sync"])
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    flat.set_(storage, h["tensor_offset"], (h["nbytes"],))
    return flat.view(parts, num_blocks, block_bytes)


def export_layers(caches: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    return [export_layer(c) for c in caches]


def local_index(uuid: str, visible: Sequence[str]) -> int:
    """Our index of the consumer's GPU (its index is in its own CUDA_VISIBLE_DEVICES, which
    differs under Ray); ValueError when this process cannot see that GPU."""
    if uuid not in visible:
        raise ValueError(f"the decode engine's GPU {uuid} is not visible to this prefill "
                         f"engine (CUDA_VISIBLE_DEVICES): kv_transfer.pipe: cuda_ipc needs it")
    return list(visible).index(uuid)
