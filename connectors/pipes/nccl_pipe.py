"""NCCL pipe (CuPy): the collective pipe with NCCL communicators, for KV in CUDA memory.
NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): its tests need two GPUs; the
same protocol runs on CPUs as the gloo pipe."""
from __future__ import annotations

import torch

from connectors.pipes.base import PipeConfig, register_pipe
from connectors.pipes.collective import CollectivePipe
from connectors.pipes.communicators import NCCL_NEEDS as NEEDS
from connectors.pipes.communicators import NcclBackend, load_nccl

__all__ = ["NEEDS", "NcclPipe"]


@register_pipe("nccl")
class NcclPipe(CollectivePipe):
    def __init__(self, config: PipeConfig) -> None:
        load_nccl()  # says what is missing before anything starts
        device = torch.device("cuda", int(config.extra.get("device",
                                                           torch.cuda.current_device())))
        super().__init__(config, NcclBackend(device))
