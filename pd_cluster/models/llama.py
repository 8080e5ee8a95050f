"""Kept for imports that predate the one decoder: ``ForwardContext`` lives in context.py."""
from pd_cluster.models.context import ForwardContext

__all__ = ["ForwardContext"]
