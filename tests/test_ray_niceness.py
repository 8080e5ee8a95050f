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


@pytest.mark.timeout(300)
def test_the_ray_we_start_runs_workers_at_our_priority(tmp_path) -> None:
    """`pd-cluster serve` / `launch` without an address start Ray themselves (ray_runtime.py):
    its workers must not be reniced, whatever the test session's own environment says."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent("""
        import os, pathlib, ray
        from pd_cluster.serving.cluster.ray_runtime import start_ray
        runtime = start_ray(None, "niceness", 1, None, False, pathlib.Path(%r))
        try:
            @ray.remote(num_cpus=0)
            def niceness():
                return os.nice(0)
            print("NICE", ray.get(niceness.remote(), timeout=120), os.nice(0))
        finally:
            runtime.disconnect()
    """ % str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=240)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("NICE ")), None)
    assert line is not None, out.stderr[-2000:]
    worker, driver = map(int, line.split()[1:])
    assert worker == driver
