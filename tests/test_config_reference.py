"""docs/configuration.md is generated from the config models and must be current; every flag
of `pd-cluster serve` is a key it documents."""
from __future__ import annotations

import re

from pd_cluster.serving.cluster.config_reference import DOC_PATH, MISSING, REGENERATE, render
from pd_cluster.serving.cluster.testing import REPO_ROOT


def test_configuration_doc_is_current() -> None:
    text = render()
    assert (REPO_ROOT / DOC_PATH).read_text() == text, (
        f"{DOC_PATH} is out of date with the config models: run `{REGENERATE}`")


def test_every_key_is_documented() -> None:
    rows = [ln for ln in render().splitlines() if ln.startswith("| `")]
    missing = [ln.split("|")[1].strip() for ln in rows if MISSING in ln]
    assert not missing, (f"config keys with no comment or description: {missing}; add a "
                         f"comment on the field's line (or just above), then `{REGENERATE}`")


def test_reference_lists_every_section_and_key() -> None:
    from pd_cluster.config import EngineArgs
    from pd_cluster.serving.cluster.config_sections import ProxyConfig
    keys = set(re.findall(r"^\| `([\w.]+)`", render(), re.M))
    assert {"model", "served_model_name", "mode", "prefill.replicas", "prefill.num_cpus",
            "kv_transfer.pipe", "kv_transfer.transport", "ray.namespace"} <= keys
    assert "## `prefill`, `decode`, `colocated`" in render()  # one table for the three roles
    def documented(key: str) -> bool:  # itself, or its sub-keys for a nested section
        return key in keys or any(k.startswith(key + ".") for k in keys)
    assert all(documented(f"proxy.{k}") for k in ProxyConfig.model_fields)
    assert all(documented(f"engine.{k}") for k in EngineArgs.model_fields
               if k != "tensor_parallel_size")
    assert "kv_transfer.role" not in keys and "engine.tensor_parallel_size" not in keys
    assert "`colocated.replicas` defaults to `2`." in render()


def test_every_serve_flag_is_a_documented_key() -> None:
    from pd_cluster.serving.cluster.serve_flags import FLAGS
    keys = set(re.findall(r"^\| `([\w.]+)`", render(), re.M))
    flags = {re.sub(r"^(decode|colocated)\.", "prefill.", f.key) for f in FLAGS}  # one table
    documented = {f for f in flags if f in keys or any(k.startswith(f + ".") for k in keys)}
    assert flags == documented, flags - documented
