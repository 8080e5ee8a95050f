"""Architecture name (config.json ``architectures``) -> the reader that describes it."""
from __future__ import annotations

from typing import Any, Callable

from pd_cluster.models.spec import ModelSpec

FamilyReader = Callable[[dict[str, Any]], ModelSpec]
_FAMILIES: dict[str, FamilyReader] = {}


def register_family(*architectures: str) -> Callable[[FamilyReader], FamilyReader]:
    def wrap(reader: FamilyReader) -> FamilyReader:
        for arch in architectures:
            _FAMILIES[arch] = reader
        return reader
    return wrap


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


def spec_from_config(cfg: dict[str, Any]) -> ModelSpec:
    archs = cfg.get("architectures") or []
    known = [a for a in archs if a in _FAMILIES]
    if not known:
        raise ValueError(f"architecture {archs or cfg.get('model_type')!r} is not supported; "
                         f"supported: {supported_architectures()}")
    return _FAMILIES[known[0]](cfg)
