"""pd-cluster: prefill/decode disaggregated LLM serving.

The public names are imported on first use, so `pd-cluster --help` (and anything else that only
needs the CLI or the config) starts without loading torch and transformers.
"""
from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

_LAZY = {"LLM": "pd_cluster.llm", "SamplingParams": "pd_cluster.sampling_params",
         "RequestOutput": "pd_cluster.outputs", "CompletionOutput": "pd_cluster.outputs"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pd_cluster' has no attribute {name!r}")
