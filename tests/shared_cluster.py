"""The one Ray cluster that the serving test modules share (test_serving_openai.py,
test_serving_api.py, test_structured_outputs.py): each launched its own, of nearly one config,
and a launch is 15-30 s of a 2-core machine. It is launched by its first user, leak-checked
after each user module (wait_idle, then every engine's check_no_leaks), and shut down after the
last user module's last test (conftest.py), or at the session's end when the run stops early.

Its config is the union of what those modules need: 1P2D (a decode engine is killed in
test_structured_outputs.py, its requests move to the other, and the cluster restarts it), every
request through P (tests assert the KV crossed), a small in-flight limit and no queue (the 429
test), JSON without free whitespace (a small model writes whitespace forever) and the hermes
tool parser. The structured-output and tool settings change nothing for plain requests.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pd_cluster.serving.cluster.testing import ensure_ray, leak_reports, local_config, wait_idle

MODEL = "tiny-llama"
MAX_INFLIGHT = 12  # the proxy's limit: test_serving_openai.py holds every slot, one more is 429
MAX_MODEL_LEN = 1024
SECTIONS: dict[str, dict[str, Any]] = dict(
    engine={"num_kv_blocks": 512, "max_model_len": MAX_MODEL_LEN,
            "structured_outputs": {"disable_any_whitespace": True}},
    decode={"replicas": 2, "num_cpus": 1, "num_gpus": 0},
    kv_transfer={"kv_transfer_timeout": 5.0},
    proxy={"max_inflight": MAX_INFLIGHT, "max_queue": 0,  # no queue: over the limit, 429 at once
           "request_timeout": 60.0, "disaggregation": "always",
           "enable_auto_tool_choice": True, "tool_call_parser": "hermes"})
FIXTURE = "serving_cluster"  # the session fixture's name (conftest.py)


class SharedCluster:
    """Launched on first use, in its own Ray namespace and state dir."""

    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.cluster: Any = None

    def get(self) -> Any:
        if self.cluster is None:
            from pd_cluster.serving.cluster.launcher import launch  # imports Ray: when used
            ensure_ray()
            with self._state_dir():
                self.cluster = launch(local_config("local", f"test-shared-{os.getpid()}",
                                                   **SECTIONS), progress=False)
        return self.cluster

    def check_no_leaks(self) -> None:
        """After a user module: idle, every KV block free, nothing held in any engine."""
        if self.cluster is None:
            return
        wait_idle(self.cluster.url, timeout=60)
        assert leak_reports(self.cluster) == {}

    def close(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            with self._state_dir():  # its launch record is removed there
                cluster.shutdown()

    @contextlib.contextmanager
    def _state_dir(self) -> Iterator[None]:
        """PD_CLUSTER_STATE_DIR set only while launching and stopping: the modules between
        the users keep their own."""
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PD_CLUSTER_STATE_DIR", str(self.state_dir))
            yield


def last_user_items(items: list[pytest.Item]) -> str | None:
    """The node id of the last test of the last module that uses the shared cluster: after its
    teardown (its module's fixtures, the leak check included) the cluster goes."""
    users = [i for i in items if FIXTURE in getattr(i, "fixturenames", ())]
    if not users:
        return None
    last_module = users[-1].module if hasattr(users[-1], "module") else None
    in_module = [i for i in items if getattr(i, "module", None) is last_module]
    return in_module[-1].nodeid
