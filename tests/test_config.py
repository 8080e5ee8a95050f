"""Cluster YAML validation: every error names its key; every shipped config parses."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pd_cluster.serving.cluster.cluster_config import (ClusterConfig, load_config, parse_config,
                                                       parse_overrides)
from pd_cluster.serving.cluster.schema import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CLUSTER_CONFIGS = ["local.yaml", "local-2p2d.yaml", "local-colocated.yaml", "two-gpu.yaml",
                   "one-gpu.yaml", "multi-node.yaml"]


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_shipped_configs_parse(name: str) -> None:
    cfg = load_config(CONFIGS / name)
    specs = cfg.engine_specs()
    assert specs and len({s.name for s in specs}) == len(specs)
    for spec in specs:
        kv = spec.engine_args.get("kv_transfer")
        if cfg.mode == "colocated":
            assert kv is None
        else:
            assert kv["role"] == {"prefill": "producer", "decode": "consumer"}[spec.role]
    assert ClusterConfig.from_dict(cfg.to_dict()) == cfg  # round-trips through Ray as a dict


def test_shipped_config_shapes() -> None:
    local = load_config(CONFIGS / "local.yaml")
    assert (local.prefill.replicas, local.decode.replicas) == (1, 1)
    assert local.kv_transfer.pipe == "auto" and local.proxy.host == "127.0.0.1"
    assert [s.role for s in load_config(CONFIGS / "local-2p2d.yaml").engine_specs()] == [
        "prefill", "prefill", "decode", "decode"]
    colo = load_config(CONFIGS / "local-colocated.yaml")
    assert colo.required_cpus() == local.required_cpus()  # same resources: a fair baseline
    gpu = load_config(CONFIGS / "two-gpu.yaml")
    assert gpu.kv_transfer.pipe == "nccl" and gpu.required_gpus() == 2
    assert gpu.engine["dtype"] == "bfloat16"
    one = load_config(CONFIGS / "one-gpu.yaml")  # P and D share a GPU and split its memory
    assert one.kv_transfer.pipe == "zmq" and one.required_gpus() == 1
    assert one.engine["gpu_memory_utilization"] * 2 <= 1


def test_the_multi_node_config_carries_no_kv_address() -> None:
    """KV endpoints are found per node: a config for several machines names no host, only
    optional per-node rules (interface / cidr). (One-machine configs say loopback: issue 29,
    test_one_machine_configs_keep_the_kv_plane_on_loopback.)"""
    assert "host" not in load_config(CONFIGS / "multi-node.yaml").kv_transfer.pipe_config \
        .model_fields_set
    kv = yaml.safe_load((CONFIGS / "multi-node.yaml").read_text()).get("kv_transfer", {})
    assert "host" not in kv and "127.0.0.1" not in str(kv)


def test_onprem_cluster_file_pins_roles_with_labels() -> None:
    data = yaml.safe_load((CONFIGS / "ray-cluster-onprem.yaml").read_text())
    assert data["provider"]["type"] == "local"
    assert "PLACEHOLDER" in data["provider"]["head_ip"]
    multi = load_config(CONFIGS / "multi-node.yaml")
    head = " ".join(data["head_start_ray_commands"])
    worker = " ".join(data["worker_start_ray_commands"])
    for role, cmd in (("prefill", head), ("decode", worker)):
        (key, value), = multi.roles[role].node_labels.items()
        assert f'"{key}": "{value}"' in cmd
        assert "RAY_worker_niceness=0" in cmd  # engines at normal priority (ray_runtime.py)


def test_ray_up_cluster_file() -> None:
    data = yaml.safe_load((CONFIGS / "ray-cluster.yaml").read_text())
    assert {"cluster_name", "provider", "setup_commands", "available_node_types"} <= set(data)
    setup = " ".join(data["setup_commands"])
    assert "torch==" in setup and "pd-cluster" in setup
    assert "PLACEHOLDER" in yaml.safe_dump(data["provider"])  # clearly marked, not real
    for cmds in (data["head_start_ray_commands"], data["worker_start_ray_commands"]):
        assert "RAY_worker_niceness=0 ray start" in " ".join(cmds)


@pytest.mark.parametrize("data, key", [
    ({"prefill": {"replcas": 2}}, "prefill.replcas: unknown key"),
    ({"decode": {"replicas": 0}}, "decode.replicas: must be >= 1"),
    ({"decode": {"replicas": "two"}}, "decode.replicas: expected an integer"),
    ({"decode": {"replicas": True}}, "decode.replicas: expected an integer"),
    ({"proxy": {"port": "x"}}, "proxy.port: expected an integer"),
    ({"proxy": {"port": 70000}}, "proxy.port: must be in"),
    ({"proxy": {"routing": "random"}}, "proxy.routing: must be one of"),
    ({"proxy": {"request_timeout": 0}}, "proxy.request_timeout: must be > 0"),
    ({"proxy": {"hots": "0.0.0.0"}}, "proxy.hots: unknown key"),
    ({"proxy": {"token_transport": "ray"}}, "proxy.token_transport: removed"),
    ({"engine": {"blok_size": 16}}, "engine.blok_size: unknown key"),
    ({"engine": {"block_size": 3}}, "engine.block_size: must be a power of two"),
    ({"engine": {"model": "x"}}, "engine.model:"),
    ({"kv_transfer": {"pipe": "carrier-pigeon"}}, "kv_transfer.pipe: must be one of"),
    ({"kv_transfer": {"transport": "udp"}}, "kv_transfer.transport: must be one of"),
    ({"kv_transfer": {"kv_transfer_timeout": -1}}, "kv_transfer.kv_transfer_timeout: must be > 0"),
    ({"kv_transfer": {"options": {"bogus": 1}}}, "kv_transfer.options.bogus: unknown key"),
    ({"mode": "hybrid"}, "mode: must be one of"),
    ({"mode": "colocated", "prefill": {"replicas": 1}}, "prefill: not used with mode: colocated"),
    ({"mode": "disaggregated", "colocated": {"replicas": 2}}, "colocated: not used with mode: disaggregated"),
    ({"ray": {"num_cpus": "many"}}, "ray.num_cpus: expected a number"),
    ({"proxy": [1, 2]}, "proxy: expected a mapping"),
    ({"modle": "tiny-llama"}, "modle: unknown key"),
    ({"prefill": {"num_gpus": 0.5}, "decode": {"num_gpus": 0.5}},
     "engine.gpu_memory_utilization: 0.9 per engine x 2 engines per GPU"),
    ({"prefill": {"num_gpus": 0.25}, "engine": {"gpu_memory_utilization": 0.3}},
     "engine.gpu_memory_utilization: 0.3 per engine x 4 engines per GPU"),
])
def test_errors_name_the_key(data: dict, key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    assert str(exc.value).startswith(key), str(exc.value)


def test_shared_gpu_shares_that_fit_pass() -> None:
    shared = {"prefill": {"num_gpus": 0.5}, "decode": {"num_gpus": 0.5}}
    assert parse_config({**shared, "engine": {"gpu_memory_utilization": 0.45}})
    assert parse_config({**shared, "engine": {"num_kv_blocks": 512}})  # a fixed-size cache
    assert parse_config({"prefill": {"num_gpus": 1}, "decode": {"num_gpus": 1}})


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(bad)


def test_defaults_overrides_and_kv_pass_through() -> None:
    cfg = parse_config({"model": "/models/my-llama"},
                       parse_overrides(["proxy.port=0", "decode.replicas=3",
                                        "kv_transfer.options.max_staging_bytes=1024"]))
    assert cfg.model_name == "/models/my-llama" and cfg.proxy.port == 0  # as written
    specs = cfg.engine_specs()
    assert [s.name for s in specs] == ["prefill-0", "decode-0", "decode-1", "decode-2"]
    kv = specs[1].engine_args["kv_transfer"]
    # No address: each engine listens on its own node's address (filled in on that node).
    assert kv == {"role": "consumer", "pipe": "auto", "transport": "tcp",
                  "kv_transfer_timeout": 30.0, "max_staging_bytes": 1024}
    assert parse_config({}).model_name == "tiny-llama"  # preset names are served as-is
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_overrides(["proxy.port"])


def test_served_names_follow_vllm() -> None:
    """The model string as given is the served name (a path too, as `vllm serve /path`);
    served_model_name replaces it, a list giving aliases (the first is reported)."""
    assert parse_config({"model": "/models/my-llama"}).served_names == ["/models/my-llama"]
    assert parse_config({"model": "acme/llama-7b"}).served_names == ["acme/llama-7b"]
    cfg = parse_config({"model": "/m/x", "served_model_name": "chat"})
    assert cfg.served_names == ["chat"] and cfg.model_name == "chat"
    cfg = parse_config({"model": "/m/x", "served_model_name": ["chat", "/m/x"]})
    assert cfg.served_names == ["chat", "/m/x"] and cfg.model_name == "chat"
    for bad in ([], [""], " "):
        with pytest.raises(ConfigError, match="served_model_name: must be a non-empty name"):
            parse_config({"served_model_name": bad})


def test_one_machine_configs_keep_the_kv_plane_on_loopback() -> None:
    """README, "Security": the KV plane listens where the config says; configs for one machine
    say loopback, the multi-node one each node's address with keys on the API."""
    for name in ("local.yaml", "local-2p2d.yaml", "one-gpu.yaml", "two-gpu.yaml"):
        cfg = load_config(CONFIGS / name)
        assert cfg.kv_transfer.pipe_config.bind_host() == "127.0.0.1", name
        assert cfg.kv_transfer.pipe_config.security == "token", name
        assert cfg.proxy.host == "127.0.0.1", name
    multi = load_config(CONFIGS / "multi-node.yaml")
    assert multi.proxy.host == "0.0.0.0" and multi.proxy.api_key_env
