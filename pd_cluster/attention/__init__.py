from pd_cluster.attention.base import AttentionBackend, create_backend, register_backend
from pd_cluster.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "create_backend", "register_backend"]
