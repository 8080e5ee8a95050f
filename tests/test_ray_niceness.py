"""The test session's Ray workers run at the session's own priority (tests/conftest.py sets
RAY_worker_niceness=0). Ray's default renices each worker by 15: against any un-niced process
on a shared 2-core machine an engine actor then gets ~1/30 of a core, and one cluster's
start-up in CI took 357 s instead of ~10 s (its proxy actor was as slow)."""
from __future__ import annotations

import os

import pytest


@pytest.mark.timeout(900)  # may start this session's Ray instance
def test_ray_workers_run_at_the_drivers_niceness() -> None:
    import ray

    from pd_cluster.serving.cluster.testing import ensure_ray
    ensure_ray()

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote(), timeout=120) == os.nice(0)
