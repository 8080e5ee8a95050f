from pd_cluster.attention.base import AttentionBackend, create_backend
from pd_cluster.attention.metadata import AttentionMetadata
from pd_cluster.attention.options import AttentionOptions

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionOptions", "create_backend"]
