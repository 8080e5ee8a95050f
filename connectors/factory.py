"""Builds a connector pair (scheduler half, worker half) by name from the kv_transfer config."""
from __future__ import annotations

from typing import Any, Callable

from connectors.base import KVConnectorBase_Scheduler, KVConnectorBase_Worker
from connectors.config import KVTransferConfig

ConnectorPair = tuple[KVConnectorBase_Scheduler, KVConnectorBase_Worker]
_CONNECTORS: dict[str, Callable[[KVTransferConfig, dict[str, Any]], ConnectorPair]] = {}


def register_connector(name: str) -> Callable:
    def wrap(factory: Callable[[KVTransferConfig, dict[str, Any]], ConnectorPair]) -> Callable:
        _CONNECTORS[name] = factory
        return factory
    return wrap


def create_connector(kv_transfer: dict[str, Any] | KVTransferConfig,
                     engine_info: dict[str, Any]) -> ConnectorPair:
    """engine_info: block_size, num_layers, num_kv_heads, head_dim, dtype, model_id."""
    config = KVTransferConfig.model_validate(kv_transfer)
    import connectors.pd_connector  # noqa: F401  (registers "pd")
    if config.connector not in _CONNECTORS:
        raise ValueError(f"kv_transfer.connector: unknown connector {config.connector!r}; "
                         f"known: {sorted(_CONNECTORS)}")
    return _CONNECTORS[config.connector](config, engine_info)
