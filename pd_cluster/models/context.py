"""What a forward step passes down to the layers (built by the model runner per step)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pd_cluster.attention import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend
    connector: Any = None  # worker-side KV connector, or None
    # Per token: the sequence length HF's RoPE would see when computing it, max(prompt length,
    # position + 1) (only longrope reads it); None: position + 1.
    rope_lens: torch.Tensor | None = None
    # This step's cos/sin per distinct RoPE (RopeSpec.key), filled by the model, read by layers.
    rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # KV cache groups (engine/kv_groups.py): each group's metadata (its block tables and
    # slots) and each layer's group; None: every layer reads attn_metadata.
    group_metas: list[AttentionMetadata] | None = None
    layer_group: list[int] | None = None

    def meta_for(self, layer_idx: int) -> AttentionMetadata:
        """The metadata this layer attends and writes with (its group's block tables)."""
        if self.group_metas is None or self.layer_group is None:
            return self.attn_metadata
        return self.group_metas[self.layer_group[layer_idx]]
