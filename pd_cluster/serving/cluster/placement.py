"""Where each engine runs, decided by Ray from the role's placement config.

- ``resources`` and ``num_cpus``/``num_gpus`` become the actor's Ray resource demand;
- ``node_labels`` become a Ray label selector (nodes started with ``ray start --labels``);
- ``strategy`` puts the role's replicas in one placement group (SPREAD, PACK, STRICT_*),
  whose bundles carry the labels; engines restart inside their bundle, and Ray moves a bundle
  whose node died once a matching node is available.
Before anything starts, a role that no live node could ever host is a launch error naming
the role, what it needs and what the nodes offer (instead of engines pending forever).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from pd_cluster.serving.cluster.cluster_config import ClusterConfig, RoleConfig
from pd_cluster.driver.messages import EngineSpec

logger = logging.getLogger(__name__)

_PG_READY_TIMEOUT = 120.0  # s


def check_feasible(config: ClusterConfig, nodes: list[dict[str, Any]]) -> None:
    """ValueError unless every role fits on live nodes (``ray.nodes()`` rows)."""
    alive = [n for n in nodes if n.get("Alive")]
    problems = []
    for role, rc in config.roles.items():
        fitting = [n for n in alive if _fits(rc, n)]
        need = 1 if rc.strategy != "strict_spread" else rc.replicas
        if len(fitting) < need:
            labels = f" with labels {rc.node_labels}" if rc.node_labels else ""
            many = f" on {need} distinct nodes" if need > 1 else ""
            problems.append(f"{role}: no live node can host an engine needing "
                            f"{rc.demand() or 'nothing'}{labels}{many}")
    if problems:
        offer = "; ".join(f"{n.get('NodeManagerAddress')} {_resources(n)} labels "
                          f"{_user_labels(n)}" for n in alive) or "none"
        raise ValueError(f"placement: {'; '.join(problems)} (nodes: {offer})")


def _fits(rc: RoleConfig, node: dict[str, Any]) -> bool:
    total = node.get("Resources", {})
    labels = node.get("Labels", {}) or {}
    return (all(total.get(k, 0.0) >= v for k, v in rc.demand().items())
            and all(labels.get(k) == v for k, v in rc.node_labels.items()))


def _resources(node: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in node.get("Resources", {}).items()
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")}


def _user_labels(node: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in (node.get("Labels") or {}).items() if not k.startswith("ray.io/")}


class Placement:
    """Ray actor options for every engine; owns the placement groups it creates."""

    def __init__(self, config: ClusterConfig, detached: bool,
                 engine_env: dict[str, str] | None = None):
        """``engine_env``: environment variables every engine process starts with (the
        allocator and OpenMP preloads, driver/cpu_setup.py)."""
        self.config = config
        self.detached = detached
        self.engine_env = dict(engine_env or {})
        self.groups: dict[str, Any] = {}  # role -> placement group

    def reserve(self, timeout: float = _PG_READY_TIMEOUT) -> None:
        """Create one placement group per role with a strategy and wait until Ray placed it."""
        from ray.util.placement_group import placement_group

        for role, rc in self.config.roles.items():
            if not rc.strategy:
                continue
            bundles = [rc.demand() for _ in range(rc.replicas)]
            selectors = [dict(rc.node_labels) for _ in range(rc.replicas)] \
                if rc.node_labels else None
            self.groups[role] = placement_group(
                bundles, strategy=rc.strategy.upper(), bundle_label_selector=selectors,
                name=f"{self.config.ray.namespace}-{role}",
                lifetime="detached" if self.detached else None)
        import ray
        deadline = time.monotonic() + timeout
        for role, pg in self.groups.items():
            try:
                ray.get(pg.ready(), timeout=max(deadline - time.monotonic(), 0.1))
            except ray.exceptions.GetTimeoutError:
                rc = self.config.roles[role]
                raise TimeoutError(
                    f"placement: Ray could not place {rc.replicas} {role} engine(s) "
                    f"({rc.strategy}, each {rc.demand()}, labels {rc.node_labels or 'any'}) "
                    f"within {timeout:.0f}s; free resources or relax {role}.strategy") from None

    def options(self, spec: EngineSpec, index: int) -> dict[str, Any]:
        """Ray ``.options()`` for the ``index``-th engine of its role."""
        rc = self.config.roles[spec.role]
        tp = rc.tensor_parallel_size  # the actor holds every rank's share (ranks: its children)
        opts: dict[str, Any] = {"num_cpus": rc.num_cpus * tp, "num_gpus": rc.num_gpus * tp}
        if rc.resources:
            opts["resources"] = dict(rc.resources)
        if self.engine_env and rc.num_gpus == 0:
            opts["runtime_env"] = {"env_vars": dict(self.engine_env)}
        pg = self.groups.get(spec.role)
        if pg is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=index)
        elif rc.node_labels:
            opts["label_selector"] = dict(rc.node_labels)
        return opts

    def release(self) -> None:
        remove_groups(self.groups.values())
        self.groups = {}


def remove_groups(groups: Any) -> None:
    from ray.util.placement_group import remove_placement_group
    for pg in groups:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - already gone with its cluster
            pass


def named_groups(namespace: str, roles: Any) -> list[Any]:
    """The detached placement groups a launch in ``namespace`` created (for `stop`)."""
    from ray.util import get_placement_group
    out = []
    for role in roles:
        try:
            out.append(get_placement_group(f"{namespace}-{role}"))
        except ValueError:  # none by that name
            pass
    return out
