"""The launch record: what `launch` started, read by `status` and `stop` (one file per namespace).

Kept free of heavy imports so `pd-cluster status` answers in well under a second.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pd_cluster.paths import cache_root


def state_dir() -> Path:
    root = os.environ.get("PD_CLUSTER_STATE_DIR")
    if root:
        return Path(root)
    return cache_root() / "run"


@dataclass
class ClusterState:
    """Written by `launch`, read by `status` and `stop` (one file per namespace)."""
    namespace: str
    address: str | None
    url: str
    engines: list[str]
    detached: bool
    launcher_pid: int
    head_pid: int | None = None
    shutdown_timeout: float = 30.0  # s the proxy drains for (`stop` waits that long more)

    @staticmethod
    def path(namespace: str) -> Path:
        return state_dir() / f"{namespace}.json"

    def save(self) -> None:
        p = self.path(self.namespace)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        os.replace(tmp, p)

    @classmethod
    def load(cls, namespace: str) -> "ClusterState | None":
        try:
            return cls(**json.loads(cls.path(namespace).read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def remove(self) -> None:
        self.path(self.namespace).unlink(missing_ok=True)
