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


def with_transformers_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config as transformers itself reads it: fields the file leaves out take the config
    class's defaults (real checkpoints omit them: Gemma 3's config.json has no
    tie_word_embeddings, which defaults to True), and older spellings are converted
    (rope_theta/rope_scaling -> rope_parameters, Gemma 3's rope_local_base_freq, layer_types
    from sliding_window_pattern). Unknown model types are read as written."""
    from transformers import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return cfg
    try:
        full = CONFIG_MAPPING[model_type].from_dict(dict(cfg)).to_dict()
    except Exception as e:  # transformers' own validation: one line naming what it refused
        msg = " ".join(str(e).split())
        raise ValueError(f"config.json: transformers cannot read this {model_type} config: "
                         f"{msg}") from e
    return {**full, "architectures": cfg.get("architectures")}


def spec_from_config(cfg: dict[str, Any]) -> ModelSpec:
    cfg = with_transformers_defaults(cfg)
    archs = cfg.get("architectures") or []
    known = [a for a in archs if a in _FAMILIES]
    if not known:
        raise ValueError(f"architecture {archs or cfg.get('model_type')!r} is not supported; "
                         f"supported: {supported_architectures()}")
    return _FAMILIES[known[0]](cfg)
