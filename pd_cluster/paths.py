"""Where pd-cluster keeps what it makes once and reuses across runs (one place for the rule)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$PD_CLUSTER_CACHE``, else ``~/.cache/pd_cluster``: generated checkpoints (models/),
    launch records, the compiled-model cache (inductor/), the CPU kernels (kernels/)."""
    return Path(os.environ.get("PD_CLUSTER_CACHE") or Path.home() / ".cache" / "pd_cluster"
                ).expanduser()
