"""scripts/chaos_soak.py --smoke: a 1P2D cluster under a mixed load while its engines are
paused, one is killed and clients hang up; its last line's figures must meet the soak's
target (every completed request exact, no unclear failure, no hang, no block leaked, only
the killed engine restarted). About 80 s here (the cluster's start included); it runs alone,
not beside other script runs: the pauses' timing is what it tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pd_cluster.serving.cluster.testing import REPO_ROOT

pytestmark = pytest.mark.timeout(600)  # a cluster in a subprocess (its own bound: 400 s)


def figures(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def test_chaos_soak_smoke_meets_its_target(tmp_path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "scripts/chaos_soak.py", "--smoke", "--log-dir",
                             str(tmp_path)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the cluster it launched
        out, _ = proc.communicate(timeout=30)
        pytest.fail("chaos_soak.py --smoke did not finish in 400 s:\n" + out[-6000:])
    last = out.strip().splitlines()[-1]
    f = figures(last)
    assert last.endswith("PASS") and proc.returncode == 0, out[-6000:]
    assert int(f["requests"]) > 50 and int(f["completed"]) > 0, last
    assert f["exact"] == f["completed"], last
    assert f["failed_unclear"] == f["hung"] == f["blocks_leaked"] == "0", last
    assert int(f["expected_restarts"]) >= 1 and f["restarts"] == f["expected_restarts"], last
