"""Where an engine's checkpoint comes from, resolved on the engine's own node.

``model:`` in a cluster config is one of
- a built-in preset name (generated on first use on each node, deterministic),
- a local checkpoint directory (it must exist on every node that runs an engine),
- a Hugging Face repo id (``org/name``), found in or fetched into each node's Hugging Face cache
  (hub_fetch.py); on the launch node before anything starts, so a missing one is one line.
Errors name the node, so a launch on many machines says which one lacks the model.
"""
from __future__ import annotations

import difflib
import re
import socket
from pathlib import Path

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_preset(model: str) -> bool:
    from pd_cluster.checkpoints.presets import PRESETS
    return model in PRESETS


def check_model(model: str) -> str:
    """The one resolver of `serve`, `launch` (before Ray starts) and ``LLM(...)``: the local
    checkpoint directory ``model`` names (a preset, made on first use; a directory; a Hugging
    Face repo id, from the hub cache or downloaded now), or ValueError in one line."""
    from pd_cluster.checkpoints.presets import preset_names
    if is_preset(model):
        from pd_cluster.checkpoints.maker import default_model_path
        return str(default_model_path(model))
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {model!r} has no config.json (expected a Hugging Face "
                             f"checkpoint directory; `pd-cluster make-model --out DIR` writes one)")
        return str(path)
    if is_repo_id(model):
        from pd_cluster.serving.cluster.hub_fetch import fetch_repo
        return fetch_repo(model)
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
        from pd_cluster.serving.cluster.hub_fetch import fetch_repo
        return fetch_repo(model, f"node {where}")
    raise ValueError(f"model: {model!r} not found on node {where} (expected a checkpoint "
                     f"directory present on every engine's node, a Hugging Face repo id, or a "
                     f"built-in preset)")
