"""What a producer and a consumer rank compare at handshake time (the KV layout, never the
per-rank head count: P and D may differ in TP size, see tp_topology.py)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

_COMPARED = ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")


def model_fingerprint(model_dir: str) -> str:
    """Identifies the checkpoint across hosts: config plus the head of the weights."""
    h = hashlib.sha1(Path(model_dir, "config.json").read_bytes())
    for f in sorted(Path(model_dir).glob("*.safetensors"))[:1]:
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def make_hello(engine_info: dict[str, Any]) -> dict[str, Any]:
    """This rank's hello: the compared keys (num_kv_heads: the model's total) and its TP size."""
    hello = {k: engine_info[k] for k in _COMPARED}
    hello["num_kv_heads"] = engine_info.get("total_kv_heads", engine_info["num_kv_heads"])
    hello["tp_size"] = engine_info.get("tp_size", 1)
    return hello


def hello_mismatch(consumer: dict[str, Any], producer: dict[str, Any]) -> str | None:
    """The reason a producer cannot feed this consumer, naming both engines, or None."""
    diffs = [f"{k}: ours={consumer[k]!r} theirs={producer.get(k)!r}" for k in _COMPARED
             if producer.get(k) != consumer[k]]
    if not diffs:
        return None
    return (f"KV layout mismatch between the prefill engine (TP{producer.get('tp_size', 1)}) "
            f"and the decode engine (TP{consumer.get('tp_size', 1)}): " + "; ".join(diffs))
