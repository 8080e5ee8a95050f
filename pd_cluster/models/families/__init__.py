"""Family readers: each module registers the architectures it reads (importing them here
fills the registry)."""
from pd_cluster.models.families import gemma, llama, olmo2, phi3, qwen3  # noqa: F401
from pd_cluster.models.families import gpt_oss, mixtral, qwen3_moe  # noqa: F401
from pd_cluster.models.families import deepseek_v3  # noqa: F401
from pd_cluster.models.families.registry import (register_family, spec_from_config,
                                                 supported_architectures)

__all__ = ["register_family", "spec_from_config", "supported_architectures"]
