"""Builds a connector pair (scheduler half, worker half) by name from the kv_transfer config.

Connectors are named here with the module and function that build them, and a module is
imported only when its connector is asked for (as vLLM's connector factory does).
"""
from __future__ import annotations

import importlib
from typing import Any

from connectors.base import ConnectorPair
from connectors.config import KVTransferConfig

# name -> (module, function(config, engine_info) -> ConnectorPair)
_CONNECTORS: dict[str, tuple[str, str]] = {"pd": ("connectors.pd_connector", "make_pd")}


def create_connector(kv_transfer: dict[str, Any] | KVTransferConfig,
                     engine_info: dict[str, Any]) -> ConnectorPair:
    """engine_info: block_size, num_layers, num_kv_heads, head_dim, dtype, model_id."""
    config = KVTransferConfig.model_validate(kv_transfer)
    if config.connector not in _CONNECTORS:
        raise ValueError(f"kv_transfer.connector: unknown connector {config.connector!r}; "
                         f"known: {sorted(_CONNECTORS)}")
    module, function = _CONNECTORS[config.connector]
    return getattr(importlib.import_module(module), function)(config, engine_info)
