"""Gloo pipe: the collective pipe (the NCCL pipe's protocol) with torch.distributed Gloo
communicators, for KV in CPU memory. It runs the NCCL pipe's logic -- group per peer, header
order, bounded waits, abort and re-create -- on machines without GPUs."""
from __future__ import annotations

from connectors.pipes.base import PipeConfig, register_pipe
from connectors.pipes.collective import CollectivePipe
from connectors.pipes.communicators import GlooBackend


@register_pipe("gloo")
class GlooPipe(CollectivePipe):
    def __init__(self, config: PipeConfig) -> None:
        super().__init__(config, GlooBackend())
