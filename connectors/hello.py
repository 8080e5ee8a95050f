"""What a producer and a consumer rank compare at handshake time: the model, block size and
what every layer caches (its KV spec, see pd_cluster/engine/kv_spec.py), never the per-rank
head count: P and D may differ in TP size, see tp_topology.py (the model's total is compared)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

_COMPARED = ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "kv_specs")
# An engine_info without a KV cache dtype (a bare connector in tests and benchmarks): the
# model's dtype.
_DEFAULT_KV_DTYPE = "auto"


def model_fingerprint(model_dir: str) -> str:
    """Identifies the checkpoint across hosts: config plus the head of the weights."""
    h = hashlib.sha1(Path(model_dir, "config.json").read_bytes())
    for f in sorted(Path(model_dir).glob("*.safetensors"))[:1]:
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def _layer_specs(engine_info: dict[str, Any]) -> list[dict[str, Any]]:
    """Each layer's spec without its per-rank head count; an engine_info without specs (a
    bare connector in tests and benchmarks) is full attention in every layer."""
    specs = engine_info.get("kv_specs") or [
        {"kind": "full", "head_dim": engine_info["head_dim"],
         "dtype": str(engine_info["dtype"]).removeprefix("torch.")}] * engine_info["num_layers"]
    return [{k: v for k, v in s.items() if k != "num_kv_heads"} for s in specs]


def make_hello(engine_info: dict[str, Any]) -> dict[str, Any]:
    """This rank's hello: the compared keys (num_kv_heads: the model's total) and its TP size."""
    hello = {k: engine_info[k] for k in _COMPARED if k != "kv_specs"}
    hello["num_kv_heads"] = engine_info.get("total_kv_heads", engine_info["num_kv_heads"])
    hello["kv_specs"] = _layer_specs(engine_info)
    hello["tp_size"] = engine_info.get("tp_size", 1)
    hello["kv_cache_dtype"] = engine_info.get("kv_cache_dtype", _DEFAULT_KV_DTYPE)
    hello["spec_state"] = engine_info.get("spec_state")
    return hello


def _spec_mismatch(consumer: dict[str, Any], producer: dict[str, Any]) -> str | None:
    """A producer whose speculative proposer state (a draft model's KV, the MTP layer's KV
    and hidden state: executor.spec_state) is not this consumer's: P ships that state after
    the target's layers (connectors/draft_layers.py), and vLLM #54926 lost the draft KV
    silently on such a pair. ngram or off on both: no state, no check."""
    theirs = producer.get("spec_state")
    if theirs == consumer.get("spec_state"):
        return None
    if not isinstance(theirs, dict):
        what = "has no draft model or MTP layer"
    elif theirs.get("model_id") is None:  # mtp: the served checkpoint's own layer
        what = f"speculates with {theirs.get('method')!r:.40}"
    else:
        what = f"drafts with {theirs.get('method')!r:.40} model {theirs.get('model_id')!r:.40}"
    return (f"speculative config mismatch: the prefill engine {what}, unlike this decode "
            f"engine; set the same engine.speculative (method and model) on both")


def _spec_diffs(consumer: list[dict[str, Any]], producer: Any) -> list[str]:
    if not isinstance(producer, list) or len(producer) != len(consumer):
        layers = len(producer) if isinstance(producer, list) else "?"
        return [f"kv_specs (the prefill engine has {layers} layers)"]
    return [f"layer {i} KV spec (the prefill engine has {p!r:.200})"
            for i, (c, p) in enumerate(zip(consumer, producer)) if c != p][:3]


def hello_mismatch(consumer: dict[str, Any], producer: dict[str, Any]) -> str | None:
    """Why a producer cannot feed this consumer, or None. The reason goes back to the producer
    and into the consumer's log: it names the keys that differ and the producer's own values,
    never the consumer's (a peer learns nothing it did not send)."""
    theirs = producer.get("kv_cache_dtype", _DEFAULT_KV_DTYPE)
    if theirs != consumer.get("kv_cache_dtype", _DEFAULT_KV_DTYPE):
        # Its own sentence: blocks of another element type (and scale layout) cannot be
        # decoded on, and the fix is one config key on either side.
        return (f"KV cache dtype mismatch: the prefill engine stores its KV cache as "
                f"{theirs!r:.40} and this decode engine does not; set the same "
                f"engine.kv_cache_dtype (--kv-cache-dtype) on both")
    spec = _spec_mismatch(consumer, producer)
    if spec is not None:
        return spec
    diffs = [f"{k} (the prefill engine has {producer.get(k)!r:.200})" for k in _COMPARED
             if k != "kv_specs" and producer.get(k) != consumer[k]]
    if producer.get("kv_specs") != consumer["kv_specs"]:
        diffs += _spec_diffs(consumer["kv_specs"], producer.get("kv_specs"))
    if not diffs:
        return None
    return (f"KV layout mismatch: the prefill engine (TP{producer.get('tp_size', 1)!r:.20}) "
            f"and this decode engine differ in " + "; ".join(diffs))
