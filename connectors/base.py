"""KV connector interfaces, split by role as in vLLM v1 (the contract: docs/design.md).

The scheduler half decides *what* moves (no tensors); the worker half moves it, beside the
model. In one engine process both halves exist; they talk only through KVConnectorMetadata
(scheduler -> worker, once per step) and get_finished() (worker -> scheduler).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch

from connectors.metadata import KVConnectorMetadata


class KVConnectorBase_Scheduler(ABC):  # noqa: N801 (vLLM's name)
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """(tokens that will come from outside, whether they arrive asynchronously). Pure."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """Record where the external tokens must land (the request's fresh blocks)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """The step's transfer plan; resets per-step state."""

    @abstractmethod
    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        """Delay freeing the blocks until the worker reports the send done? (The first token
        travels to the consumer in the FIN, so no kv_transfer_params go back to the proxy.)"""

    def stats(self) -> dict[str, Any]:
        return {}

    def unshipped_blocks(self, request: Any) -> int:
        """Consumer: leading prompt blocks some layer's KV was not shipped for (they are not
        to be registered for prefix hits); 0 unless a connector ships less than everything."""
        return 0


class FinishedTransfers(NamedTuple):
    """What get_finished() reports (a tuple: ``sent, received = ...`` reads it too)."""
    sent: set[str]  # producer: sends done (or given up on): the blocks may be freed
    # consumer: request id -> the first token that came with its KV, or None when the KV did
    # not arrive (the request computes its prompt itself)
    received: dict[str, int | None]
    # consumer: ended receives (any end: done, failed, cancelled) whose blocks no producer can
    # write into any more; a failed or cancelled one's blocks are fenced until it is here
    unfenced: frozenset[str] = frozenset()


class KVConnectorBase_Worker(ABC):  # noqa: N801
    # A connector whose consumer loads KV layer by layer during the forward pass sets this:
    # only then are start_load_kv / wait_for_layer_load called. The P/D connector pushes whole
    # prompts before D schedules them, so it needs neither; they become live with prefix-aware
    # P/D (docs/design.md, "Layer-wise load").
    loads_layerwise: bool = False

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None: ...

    @abstractmethod
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None: ...

    @abstractmethod
    def clear_connector_metadata(self) -> None: ...

    @abstractmethod
    def start_load_kv(self, kv_caches: list[torch.Tensor]) -> None:
        """Consumer: begin loading the step's KV (a push design has nothing to start)."""

    @abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Consumer: block until ``layer``'s KV needed by this step is in the cache."""

    @abstractmethod
    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Producer: ``layer``'s KV is final; start shipping it (must not block on the wire)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Producer: the sends started so far no longer read the cache. The engine calls it
        before each forward (the next one may write blocks a send still reads), not at the
        end of the step that started them: that step's tokens go out without waiting."""

    @abstractmethod
    def get_finished(self) -> "FinishedTransfers":
        """The transfers that ended since the previous call (see FinishedTransfers)."""

    def endpoint(self) -> str | None:
        """Address producers connect to, for a consumer."""
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


ConnectorPair = tuple[KVConnectorBase_Scheduler, KVConnectorBase_Worker]
