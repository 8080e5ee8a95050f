"""Producer side of the wire: what one layer of a request becomes (messages over the cache's
blocks), and the one path every producer send takes (in order through pinned host staging
when the KV is on a GPU and the pipe carries host memory only)."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, NamedTuple

import torch

from connectors.block_io import BufferPool, contiguous_runs, gather_blocks
from connectors.host_staging import HostStaging
from connectors.metadata import KVLayerHeader, encode_header
from connectors.pipes.base import KVPipe

_MAX_ZERO_COPY_RUNS = 4


class Staged(NamedTuple):
    """A message's host buffer was copied from a device buffer (host_staging.py)."""
    copied: Any  # the copy's CUDA event: the host buffer is ready once it completes
    device_buf: torch.Tensor  # copied from; kept alive until the copy is done


class LayerMessage(NamedTuple):
    header: KVLayerHeader
    tensor: torch.Tensor  # what goes on the wire
    pooled: bool  # a pool buffer, returned once the pipe let go of it
    staged: Staged | None = None  # set when ``tensor`` is a host copy of a device buffer


class LayerSender:
    def __init__(self, pipe: KVPipe, max_pooled_bytes: int, copy_timeout: float):
        # Each message's integrity tag is the pipe's (pipes/integrity.py), taken off the
        # forward thread over the bytes that go on the wire (the pinned copy, when staged).
        self.pipe = pipe
        self.copy_timeout = copy_timeout
        self.buffers = BufferPool(max_bytes=max_pooled_bytes)
        self._staging: HostStaging | None = None

    def use_device(self, device: torch.device) -> None:
        """Where the KV cache lives: GPU KV over a host-memory pipe is staged (host_staging.py)."""
        if not self.pipe.carries(device):
            self._staging = HostStaging(self.pipe.send_tensor, self.buffers, device,
                                        self.copy_timeout)

    def layer_messages(self, spec: Any, layer: int, kv_layer: torch.Tensor,
                       heads: tuple[int, int, int] | None = None) -> list[LayerMessage]:
        """Zero-copy views of the cache when the blocks form a few contiguous runs (CPU, the
        common case: a prompt's blocks are allocated together); else one gathered copy,
        staged to pinned host memory when the pipe cannot carry device memory.
        ``heads``: (first local head, count, consumer's first head) when only a slice of this
        rank's heads goes to this consumer rank (copied: a head slice is not contiguous)."""
        if heads is not None and heads[:2] == (0, kv_layer.shape[3]) and heads[2] == 0:
            heads = None
        if heads is not None:
            return self._head_slice_messages(spec, layer, kv_layer, heads)
        runs = contiguous_runs(spec.block_ids)
        if kv_layer.device.type == "cpu" and len(runs) <= _MAX_ZERO_COPY_RUNS:
            # At most one pipe frame per message: the receiver then uses the frame in place
            # instead of joining frames with a copy.
            per_msg = max(1, self.pipe.config.max_frame_bytes // kv_layer[0, 0].nbytes)
            out = []
            for run in runs:
                for off in range(0, run.count, per_msg):
                    n = min(per_msg, run.count - off)
                    # Offsets within a descending run count from its high end.
                    lo = run.low + (run.count - off - n if run.descending else off)
                    out += [LayerMessage(KVLayerHeader(spec.request_id, layer,
                                                       spec.first_block + run.first + off, part,
                                                       run.descending),
                                         kv_layer[part, lo:lo + n], False)
                            for part in range(kv_layer.shape[0])]
            return out
        # Gathered blocks: on CPU, messages of whole blocks (every part) of at most one frame
        # each, so the receiver scatters each frame in place instead of first joining a
        # message's frames with a copy (wire.py); one message elsewhere (staged, as before).
        n = len(spec.block_ids)
        per_msg = n if kv_layer.device.type != "cpu" else max(
            1, self.pipe.config.max_frame_bytes // (kv_layer.shape[0] * kv_layer[0, 0].nbytes))
        out = []
        for off in range(0, n, per_msg):
            ids = spec.block_ids[off:off + per_msg]
            shape = (kv_layer.shape[0], len(ids), *kv_layer.shape[2:])  # every part
            payload = self.buffers.acquire(shape, kv_layer.dtype, kv_layer.device)
            gather_blocks(kv_layer, ids, payload)
            header = KVLayerHeader(spec.request_id, layer, spec.first_block + off)
            if self._staging is not None:
                host, copied = self._staging.stage(payload)
                out.append(LayerMessage(header, host, True, Staged(copied, payload)))
            else:
                out.append(LayerMessage(header, payload, True))
        return out

    def _head_slice_messages(self, spec: Any, layer: int, kv_layer: torch.Tensor,
                             heads: tuple[int, int, int]) -> list[LayerMessage]:
        first, count, dst = heads
        ids = torch.tensor(spec.block_ids, dtype=torch.long, device=kv_layer.device)
        payload = kv_layer[:, :, :, first:first + count].index_select(1, ids)
        header = KVLayerHeader(spec.request_id, layer, spec.first_block, head_start=dst)
        if self._staging is not None:
            host, copied = self._staging.stage(payload)
            return [LayerMessage(header, host, True, Staged(copied, payload))]
        return [LayerMessage(header, payload, False)]

    def send_layer(self, peer: str, msg: LayerMessage) -> Future:
        future = self.send(peer, encode_header(msg.header), msg.tensor, msg.staged)
        if msg.pooled:
            self.buffers.release_when_done(msg.tensor, future)
        return future

    def send(self, peer: str, header: dict, payload: torch.Tensor | None,
             staged: Staged | None = None) -> Future:
        """Every producer send: through the staging thread when it is on (keeps order)."""
        if self._staging is None:
            return self.pipe.send_tensor(peer, header, payload)
        if staged is None:
            return self._staging.send(peer, header, payload, None, None)
        return self._staging.send(peer, header, payload, staged.copied, staged.device_buf)

    def close(self) -> None:
        if self._staging is not None:
            self._staging.close()
