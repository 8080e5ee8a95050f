"""Multi-node building blocks without a second machine: KV address selection per node, placement
config and feasibility, models from a Hugging Face cache offline, peer linking with retries."""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from connectors.pipes.addressing import select_address
from connectors.pipes.base import PipeConfig
from pd_cluster.serving.cluster.cluster_config import parse_config
from pd_cluster.serving.engine.engine_actor import on_this_node
from pd_cluster.serving.cluster.model_source import is_repo_id, resolve_model, served_name
from pd_cluster.serving.cluster.placement import check_feasible
from pd_cluster.serving.cluster.schema import ConfigError

# A multi-homed node: management network, fast network, IPv6 and loopback.
TABLE = {"lo": ["127.0.0.1", "::1"], "eth0": ["192.0.2.10"], "ib0": ["10.9.3.7"],
         "eth1": ["2001:db8::5"], "down0": []}


def pick(**rule: Any) -> str:
    return select_address(addresses=lambda: TABLE, **rule)


def test_address_by_interface_network_host_or_node_default() -> None:
    assert pick(interface="ib0") == "10.9.3.7"
    assert pick(cidr="10.9.0.0/16") == "10.9.3.7"
    assert pick(cidr="2001:db8::/32") == "2001:db8::5"
    assert pick(host="10.1.1.1") == "10.1.1.1"
    assert pick(default="192.0.2.10") == "192.0.2.10"  # Ray's node IP
    assert pick(interface="ib0", default="192.0.2.10") == "10.9.3.7"  # a rule wins
    with pytest.raises(ValueError, match=r"kv_transfer.interface: no interface 'eth9'.*ib0="):
        pick(interface="eth9")
    with pytest.raises(ValueError, match=r"kv_transfer.cidr: no address .* in 172.16.0.0/12"):
        pick(cidr="172.16.0.0/12")
    with pytest.raises(ValueError, match="has no IP address"):
        pick(interface="down0")


def test_engine_listens_on_its_own_node_unless_a_rule_is_given() -> None:
    kv = {"role": "consumer", "pipe": "zmq"}
    assert on_this_node(kv, "10.0.0.5")["host"] == "10.0.0.5"
    assert "host" not in on_this_node({**kv, "cidr": "10.0.0.0/8"}, "10.0.0.5")
    assert on_this_node({**kv, "host": "10.2.2.2"}, "10.0.0.5")["host"] == "10.2.2.2"


def test_pipe_listens_on_the_selected_address_and_port_range() -> None:
    from connectors.pipes.zmq_pipe import ZmqPipe
    pipe = ZmqPipe(PipeConfig(interface="lo", port_range=(41000, 41010)))
    try:
        addr = pipe.listen()
        host, port = addr.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1" and 41000 <= int(port) <= 41010
    finally:
        pipe.close()
    with pytest.raises(ValueError, match="port_range"):
        PipeConfig(port_range=(5, 2))


@pytest.mark.parametrize("section, key", [
    ({"kv_transfer": {"host": "10.0.0.1", "cidr": "10.0.0.0/8"}}, "kv_transfer.cidr: set only"),
    ({"kv_transfer": {"cidr": "10.0.0.0/33"}}, "kv_transfer.cidr:"),
    ({"kv_transfer": {"port_range": [9000]}}, "kv_transfer.port_range:"),
    ({"kv_transfer": {"unreachable": "ignore"}}, "kv_transfer.unreachable: must be one of"),
    ({"decode": {"strategy": "diagonal"}}, "decode.strategy: must be one of"),
    ({"decode": {"node_labels": {"zone": 3}}}, "decode.node_labels.zone: expected a string"),
    ({"prefill": {"resources": {"GPU": 1}}}, "prefill.resources.GPU: use num_cpus"),
    ({"prefill": {"resources": {"fast_nic": 0}}}, "prefill.resources.fast_nic: must be a number"),
    ({"prefill": {"num_cpus": 0, "strategy": "spread"}}, "prefill.strategy: a placement group"),
    ({"decode": {"node_lables": {}}}, "decode.node_lables: unknown key"),
])
def test_placement_and_address_errors_name_the_key(section: dict, key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(section)
    assert str(exc.value).startswith(key), str(exc.value)


def _node(ip: str, cpus: float, labels: dict[str, str], **extra: float) -> dict[str, Any]:
    return {"Alive": True, "NodeManagerAddress": ip, "Resources": {"CPU": cpus, **extra},
            "Labels": {"ray.io/node-id": "x", **labels}}


def test_feasibility_names_the_role_and_what_nodes_offer() -> None:
    nodes = [_node("10.0.0.1", 4, {"tier": "prefill"}),
             _node("10.0.0.2", 4, {"tier": "decode"}, fast_nic=1)]
    cfg = parse_config({"prefill": {"node_labels": {"tier": "prefill"}},
                        "decode": {"node_labels": {"tier": "decode"},
                                   "resources": {"fast_nic": 1}}})
    check_feasible(cfg, nodes)  # fits
    bad = parse_config({"decode": {"node_labels": {"tier": "gpu"}}})
    with pytest.raises(ValueError, match=r"decode: no live node .*labels \{'tier': 'gpu'\}"
                                         r".*10.0.0.2"):
        check_feasible(bad, nodes)
    spread = parse_config({"decode": {"replicas": 2, "strategy": "strict_spread",
                                      "resources": {"fast_nic": 1}}})
    with pytest.raises(ValueError, match="on 2 distinct nodes"):
        check_feasible(spread, nodes)


def _fake_hf_cache(cache: Path, repo_id: str, checkpoint: str) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/}."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    shutil.copytree(checkpoint, repo / "snapshots" / rev)
    return repo / "snapshots" / rev


def test_hf_repo_id_resolves_offline_from_the_local_cache(tmp_path: Path, tiny_model: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = _fake_hf_cache(tmp_path / "hub", "acme/tiny-llama-test", tiny_model())
    assert is_repo_id("acme/tiny-llama-test") and not is_repo_id("/abs/path")
    assert served_name("acme/tiny-llama-test") == "acme/tiny-llama-test"
    assert Path(resolve_model("acme/tiny-llama-test")) == snapshot
    cfg = json.loads((snapshot / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    with pytest.raises(ValueError, match=r"'acme/missing' is not in the Hugging Face cache of "
                                         r"node n7 .*HF_HUB_OFFLINE"):
        resolve_model("acme/missing", node="n7")
    with pytest.raises(ValueError, match=r"model: '/no/such/dir' not found on node n7"):
        resolve_model("/no/such/dir", node="n7")


class _Engine:
    """A prefill or decode EngineState stand-in with a scripted connect_peers."""

    def __init__(self, name: str, role: str, endpoint: str | None = None, inc: str = "i0"):
        self.name, self.role, self.healthy = name, role, True
        self.kv_endpoint, self.incarnation, self.kv_peers = endpoint, inc, {}
        self.calls: list[tuple[dict, list]] = []
        self.fail_next = 0
        outer = self

        class _Remote:
            @staticmethod
            def remote(peers: dict, timeout: float, stale: list) -> Any:
                outer.calls.append((dict(peers), list(stale)))

                async def result() -> dict:
                    if outer.fail_next:
                        outer.fail_next -= 1
                        return {ep: "PipeTimeout: no handshake reply" for ep in peers}
                    return {ep: None for ep in peers}
                return result()
        self.handle = type("H", (), {"connect_peers": _Remote})()


def test_peer_linker_retries_with_backoff_and_relinks_restarted_consumers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pd_cluster.serving.routing import peer_linker
    from pd_cluster.serving.routing.peer_linker import PeerLinker
    clock = [100.0]
    monkeypatch.setattr(peer_linker.time, "monotonic", lambda: clock[0])
    p, d = _Engine("prefill-0", "prefill"), _Engine("decode-0", "decode", "tcp://d:1", "i0")
    linker = PeerLinker([p, d], timeout=1.0)

    async def round_() -> None:
        linker.sync()
        await asyncio.gather(*linker._tasks)

    async def scenario() -> None:
        p.fail_next = 2
        await round_()  # fails: retry after 0.5 s
        await round_()  # not due yet: no call
        assert len(p.calls) == 1 and not PeerLinker.linked(p, d)
        clock[0] += 0.6
        await round_()  # fails again: retry after 1 s
        clock[0] += 0.6
        await round_()
        assert len(p.calls) == 2
        clock[0] += 0.5
        await round_()  # succeeds
        assert len(p.calls) == 3 and PeerLinker.linked(p, d)
        await round_()
        assert len(p.calls) == 3  # linked: nothing to do
        d.kv_endpoint, d.incarnation = "tcp://d:2", "i1"  # D restarted elsewhere
        await round_()
        assert p.calls[-1] == ({"tcp://d:2": "i1"}, ["tcp://d:1"])  # old one forgotten
        assert p.kv_peers == {"tcp://d:2": "i1"} and PeerLinker.linked(p, d)
    asyncio.run(scenario())


def test_producer_relinks_after_consumer_restart(tiny_model: Any) -> None:
    """A consumer engine restarts at a new address: the producer handshakes with it again
    and KV flows; the old peer is forgotten."""
    from tests.pd_helpers import colocated_tokens, engine, prompts_of_lengths, run_in_process
    from tests.pd_helpers import submit_pair
    from pd_cluster import SamplingParams
    model = tiny_model()
    greedy = SamplingParams(temperature=0, max_tokens=4)
    p = engine(model, "producer", block_size=8)
    d1 = engine(model, "consumer", block_size=8)
    prompt = prompts_of_lengths([40])[0]
    p.connect_kv_peer(d1.kv_endpoint(), "i1")
    old = d1.kv_endpoint()
    d1.close()
    d2 = engine(model, "consumer", block_size=8)
    p.disconnect_kv_peer(old)
    p.connect_kv_peer(d2.kv_endpoint(), "i2")
    assert p.kv_peers() == {d2.kv_endpoint(): "i2"}
    submit_pair(p, d2, "r", prompt, greedy, d2.kv_endpoint())
    got = run_in_process(p, d2)
    assert got["r"] == colocated_tokens(model, [prompt], [greedy], block_size=8)[0]
    assert d2.stats()["kv_fallbacks"] == 0 and d2.stats()["kv_bytes_received"] > 0
    p.check_no_leaks(), d2.check_no_leaks()
    p.close(), d2.close()


@pytest.mark.timeout(900)  # may start this session's Ray instance
def test_launch_fails_naming_both_ends_of_an_unreachable_pair() -> None:
    """The launch-time reachability check: every P -> D pair, with both addresses and why."""
    import ray

    from pd_cluster.serving.cluster.launcher import link_engines
    from pd_cluster.serving.cluster.testing import ensure_ray
    ensure_ray()

    @ray.remote(num_cpus=0)
    class FakeProducer:
        def connect_peers(self, peers: dict, timeout: float) -> dict:
            return {ep: (None if ep.endswith(":1") else "PipeTimeout: no handshake reply from "
                         f"{ep} within 10.0s") for ep in peers}

    engines = {"prefill-0": FakeProducer.remote()}
    infos = {"prefill-0": {"role": "prefill", "node_ip": "10.0.0.1", "kv_endpoint": None},
             "decode-0": {"role": "decode", "node_ip": "10.0.0.2", "incarnation": "a",
                          "kv_endpoint": "tcp://10.0.0.2:1"},
             "decode-1": {"role": "decode", "node_ip": "10.0.0.3", "incarnation": "b",
                          "kv_endpoint": "tcp://10.0.0.3:2"}}
    with pytest.raises(RuntimeError) as exc:
        link_engines(engines, infos, parse_config({}), timeout=5.0)
    msg = str(exc.value)
    assert "prefill-0 (node 10.0.0.1) -> decode-1 at tcp://10.0.0.3:2: PipeTimeout" in msg
    assert "decode-0" not in msg and "kv_transfer.interface" in msg
    # unreachable: warn -> the launch goes on (the proxy keeps retrying that pair)
    link_engines(engines, infos, parse_config({"kv_transfer": {"unreachable": "warn"}}), 5.0)
    ray.kill(engines["prefill-0"])
