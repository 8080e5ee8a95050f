"""The cluster secret: made once per launch, handed to every process of the cluster through Ray
(actor arguments, never the YAML, the launch record or a log), and proven on every channel
between them (connectors/pipes/auth.py: the KV handshake; the proxy's sessions).

Inside a process it lives in the environment variable ``PD_CLUSTER_SECRET``: the engine's own
subprocesses (tensor-parallel ranks, an engine process) inherit it, where a command line would
show it to every local user. Only this module reads or writes it.
"""
from __future__ import annotations

import os
import secrets

ENV = "PD_CLUSTER_SECRET"
_MIN_BYTES = 16


def new_secret() -> str:
    """A fresh secret: 32 random bytes, hex."""
    return secrets.token_hex(32)


def install(secret: str) -> None:
    """Make ``secret`` this process's (and its future children's) cluster secret."""
    if len(secret.encode()) < _MIN_BYTES:
        raise ValueError(f"cluster secret: at least {_MIN_BYTES} bytes")
    os.environ[ENV] = secret


def cluster_secret() -> bytes:
    """This process's cluster secret. ValueError says how to get one: a channel that must be
    authenticated never runs without it."""
    value = os.environ.get(ENV, "")
    if len(value.encode()) < _MIN_BYTES:
        raise ValueError(f"no cluster secret in this process (${ENV}, set by `pd-cluster "
                         f"launch` for every engine); kv_transfer.security: none turns the "
                         f"KV handshake's proof off")
    return value.encode()


def has_secret() -> bool:
    return len(os.environ.get(ENV, "").encode()) >= _MIN_BYTES
