"""Writing a checkpoint directory the way a hub checkpoint looks (fp32 safetensors, tokenizer
with the chat template, generation config, the maker's metadata file), atomically: a crash
mid-write leaves the previous directory or nothing, never a partial one."""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

MAKER_FILE = "pd_cluster_model.json"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def save_checkpoint(model: Any, tokenizer: Any, out_dir: str | os.PathLike,
                    meta: dict[str, Any], max_shard_size: str | None = None,
                    extra_tensors: dict[str, Any] | None = None) -> Path:
    """Atomically write model (fp32 safetensors), tokenizer and ``meta`` (+ num_params) to
    out_dir; ``extra_tensors``: tensors the model does not hold (DeepSeek's MTP layers),
    stored beside its own (in model.safetensors, or a shard of their own in the index)."""
    from transformers import GenerationConfig

    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the global layers'
    rope_theta = rope.get("rope_theta") or getattr(cfg, "rope_theta", None)
    model.generation_config = GenerationConfig(
        do_sample=False, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id)
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" noise from servers/tests
    try:
        model.save_pretrained(tmp, safe_serialization=True,
                              **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        if extra_tensors:
            _add_tensors(tmp, extra_tensors)
        tokenizer.save_pretrained(tmp)
        _patch_config(tmp / "config.json", rope_theta)
        _patch_tokenizer_config(tmp / "tokenizer_config.json", cfg.max_position_embeddings)
        meta = {**meta, "num_params": param_count(tmp)}
        (tmp / MAKER_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        for f in tmp.iterdir():  # mkdtemp and HF's temp files are 0600/0700: make it readable by all
            f.chmod(0o644)
        tmp.chmod(0o755)
        _atomic_replace(tmp, out)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _add_tensors(folder: Path, tensors: dict[str, Any]) -> None:
    from safetensors.torch import load_file, save_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        save_file(tensors, str(folder / "model-extra.safetensors"), metadata={"format": "pt"})
        data = json.loads(index.read_text())
        data["weight_map"].update({name: "model-extra.safetensors" for name in tensors})
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return
    path = folder / "model.safetensors"
    save_file({**load_file(str(path)), **tensors}, str(path), metadata={"format": "pt"})


def _patch_config(path: Path, rope_theta: float | None) -> None:
    # transformers 5 writes rope_parameters/dtype only; keep the legacy keys too for
    # hand-written loaders (and transformers 4.x). AutoConfig accepts both.
    cfg = json.loads(path.read_text())
    if rope_theta is not None:
        cfg.setdefault("rope_theta", float(rope_theta))
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _patch_tokenizer_config(path: Path, max_len: int) -> None:
    # transformers 5 saves the template only as chat_template.jinja; 4.x and hand-written servers
    # read tokenizer_config.json["chat_template"]; 5.x accepts both.
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # 5.x's "TokenizersBackend" is unknown to 4.x
    cfg["model_max_length"] = max_len
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _atomic_replace(src: Path, dst: Path) -> None:
    """rename(2) src into dst; an existing dst is moved aside first and deleted after."""
    old = None
    if dst.exists() or dst.is_symlink():
        if dst.is_dir() and not any(dst.iterdir()):
            dst.rmdir()
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / "x")
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def param_count(model_dir: str | os.PathLike) -> int:
    """Number of parameters stored in model_dir's safetensors (tied weights counted once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total
