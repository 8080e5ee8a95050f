"""A draft model made from a checkpoint: the same weights with only the first layers (a
cheap draft pair for ``engine.speculative: {method: draft_model}``). Same tokenizer, same
embeddings and LM head, so it often agrees with the full model; all layers make a draft equal
to the target, which must accept every draft."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def truncate_layers(src: str | os.PathLike, dst: str | os.PathLike, num_layers: int) -> Path:
    """Write ``src`` with its first ``num_layers`` decoder layers to ``dst`` (made if missing;
    every other file copied as is). ValueError naming ``num_layers`` if out of range."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers: must be in [1, {total}] for {src}, got {num_layers}")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            m = _LAYER.search(name)
            if m is None or int(m.group(1)) < num_layers:
                tensors[name] = t.contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types",):  # per-layer lists (sliding/full patterns) shrink with them
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
