"""Where an engine's checkpoint comes from, resolved on the engine's own node.

``model:`` in a cluster config is one of
- a built-in preset name (generated on first use on each node, deterministic),
- a local checkpoint directory (it must exist on every node that runs an engine),
- a Hugging Face repo id (``org/name``), fetched into or found in each node's Hugging Face cache
  by huggingface_hub, which honours ``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE``/``HF_HOME``.
Errors name the node, so a launch on many machines says which one lacks the model.
"""
from __future__ import annotations

import difflib
import re
import socket
from pathlib import Path

# What an engine reads from a checkpoint; nothing else is fetched from a repo.
_CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_preset(model: str) -> bool:
    from pd_cluster.checkpoints.presets import PRESETS
    return model in PRESETS


def check_model(model: str) -> None:
    """On the launch node, before anything starts: ValueError (one line) unless ``model`` is a
    preset, a checkpoint directory here, or a repo id the Hub (or the local cache) may have."""
    from pd_cluster.checkpoints.presets import preset_names
    if is_preset(model):
        return
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {model!r} has no config.json (expected a Hugging Face "
                             f"checkpoint directory; `pd-cluster make-model --out DIR` writes one)")
        return
    if is_repo_id(model):
        _check_cached_when_offline(model)
        return  # fetched (or found in the HF cache) by each engine, which says why if not
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:
        raise ValueError(f"model: {model!r}: no such directory on this machine")
    close = difflib.get_close_matches(model, preset_names(), n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(close)}? " if close else "")
    raise ValueError(f"model: {model!r} is not a built-in preset, a checkpoint directory or a "
                     f"Hugging Face repo id (org/name); {hint}presets: "
                     f"{', '.join(preset_names())}")


def is_repo_id(model: str) -> bool:
    """``org/name`` that is not a local path (paths win: ``./org/name`` is always a path)."""
    return bool(_REPO_ID.fullmatch(model)) and not Path(model).exists()


def served_name(model: str) -> str:
    """The ``model`` clients send by default: the string as the user wrote it (vLLM's rule:
    ``vllm serve /path/to/m`` serves ``/path/to/m``)."""
    return model


def resolve_model(model: str, node: str | None = None) -> str:
    """The local checkpoint directory for ``model`` on this node; ValueError naming the node."""
    where = node or socket.gethostname()
    if is_preset(model):
        from pd_cluster.checkpoints.maker import default_model_path
        return str(default_model_path(model))
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path)
    if is_repo_id(model):
        return _from_hub(model, where)
    raise ValueError(f"model: {model!r} not found on node {where} (expected a checkpoint "
                     f"directory present on every engine's node, a Hugging Face repo id, or a "
                     f"built-in preset)")


def _check_cached_when_offline(repo_id: str) -> None:
    import os
    if os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes", "on"):
        return
    from huggingface_hub import constants, try_to_load_from_cache
    if not isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        raise ValueError(f"model: {repo_id!r} is not in the Hugging Face cache "
                         f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set; download it "
                         f"(`huggingface-cli download {repo_id}`) or use a path")


def _from_hub(repo_id: str, where: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, allow_patterns=_CHECKPOINT_FILES)
    except LocalEntryNotFoundError:
        how = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
               else "the Hub could not be reached")
        raise ValueError(f"model: {repo_id!r} is not in the Hugging Face cache of node {where} "
                         f"({constants.HF_HUB_CACHE}) and {how}; download it on that node "
                         f"(`huggingface-cli download {repo_id}`) or use a path") from None
    except (HfHubHTTPError, OSError) as e:
        raise ValueError(f"model: cannot fetch {repo_id!r} on node {where}: {e}") from None
