"""A two-node Ray cluster on one machine: the head in this network namespace, a worker in a
new one joined by a veth pair, each node with an address of its own.

Addresses come from 198.18.0.0/15 (reserved for network tests) and exist only on the veth
pair created here; nothing is sent anywhere else. Every process started here is stopped by
PID (never `ray stop`), and the namespace is deleted, also when a test fails.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pd_cluster.serving.cluster.ray_runtime import free_port

HEAD_LABEL = {"pd-test-node": "head"}
WORKER_LABEL = {"pd-test-node": "worker"}
# Fast node-death detection so the test sees a lost node in seconds, not ~30 s.
# No token auth: every process of this test cluster (nodes, launcher) runs with this env.
_RAY_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
            "RAY_health_check_timeout_ms": "1000", "RAY_AUTH_MODE": "disabled"}


def why_unavailable() -> str | None:
    """None when this machine can run the test, else the reason to skip."""
    if sys.platform != "linux":
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (ip netns, veth)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` command"
    probe = f"pdprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class TwoNodes:
    def __init__(self, cpus_per_node: int = 2):
        tag = os.getpid() % 10000
        self.netns = f"pdt{tag}"
        self.veth_head, self.veth_worker = f"pdh{tag}", f"pdw{tag}"
        third = 100 + tag % 150
        self.head_ip, self.worker_ip = f"198.18.{third}.1", f"198.18.{third}.2"
        self.cpus = cpus_per_node
        self.port = free_port()
        self.address = f"{self.head_ip}:{self.port}"
        self.tmp = Path(tempfile.mkdtemp(prefix="pd-two-nodes-"))
        self.head: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self.env = {**os.environ, **_RAY_ENV}
        self.env.pop("RAY_ADDRESS", None)
        self.client_env = {"RAY_AUTH_MODE": _RAY_ENV["RAY_AUTH_MODE"]}  # for drivers

    # ---- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "TwoNodes":
        try:
            self._make_network()
            self.head = self._ray(["--head", f"--port={self.port}", "--include-dashboard=false",
                                   f"--dashboard-agent-listen-port={free_port()}"],
                                  self.head_ip, HEAD_LABEL, "head")
            self._wait_port(self.head_ip, self.port, 90.0)
            self.start_worker()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_worker(self, timeout: float = 90.0) -> None:
        self.worker = self._ray([f"--address={self.address}"], self.worker_ip, WORKER_LABEL,
                                "worker", netns=self.netns)
        self.wait_nodes(2, timeout)

    def kill_worker(self) -> None:
        """The worker machine dies: SIGKILL every process in its namespace."""
        for pid in self._netns_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.worker is not None:
            self.worker.wait(timeout=10)

    def close(self) -> None:
        if self._has_netns():
            self.kill_worker()
        if self.head is not None and self.head.poll() is None:
            os.killpg(self.head.pid, signal.SIGTERM)  # `ray start --block` stops its node
            try:
                # (it outlasted 30 s in every measured run, ending in the SIGKILL below: 30 s
                # of each test's teardown; what it leaves, _kill_leftovers and rmtree remove)
                self.head.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.head.pid, signal.SIGKILL)
                self.head.wait(timeout=10)
        self._kill_leftovers()
        if self._has_netns():
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.veth_head], capture_output=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- helpers -----------------------------------------------------------------------------
    def _make_network(self) -> None:
        for cmd in (f"ip netns add {self.netns}",
                    f"ip link add {self.veth_head} type veth peer name {self.veth_worker}",
                    f"ip link set {self.veth_worker} netns {self.netns}",
                    f"ip addr add {self.head_ip}/24 dev {self.veth_head}",
                    f"ip link set {self.veth_head} up",
                    f"ip netns exec {self.netns} ip addr add {self.worker_ip}/24 dev "
                    f"{self.veth_worker}",
                    f"ip netns exec {self.netns} ip link set {self.veth_worker} up",
                    f"ip netns exec {self.netns} ip link set lo up"):
            subprocess.run(cmd.split(), check=True, capture_output=True, text=True)

    def _ray(self, args: list[str], ip: str, labels: dict[str, str], name: str,
             netns: str | None = None) -> subprocess.Popen:
        ray = str(Path(sys.executable).with_name("ray"))
        cmd = [ray, "start", "--block", f"--node-ip-address={ip}", f"--num-cpus={self.cpus}",
               f"--labels={json.dumps(labels)}", f"--temp-dir={self.tmp / name}",
               "--disable-usage-stats", *args]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        log = open(self.tmp / f"{name}.log", "ab")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_nodes(self, count: int, timeout: float) -> None:
        """Until ``count`` nodes are alive (asked in a subprocess: this one may hold a Ray)."""
        code = ("import ray,sys,time;ray.init(address=sys.argv[1],log_to_driver=False);"
                "d=time.monotonic()+float(sys.argv[3])\n"
                "while sum(n['Alive'] for n in ray.nodes())<int(sys.argv[2]):\n"
                " assert time.monotonic()<d,'nodes did not join';time.sleep(0.5)")
        done = subprocess.run([sys.executable, "-c", code, self.address, str(count),
                               str(timeout)], env=self.env, capture_output=True, text=True,
                              timeout=timeout + 60)
        if done.returncode != 0:
            raise RuntimeError(f"{count} Ray nodes not alive: {done.stderr[-2000:]}\n"
                               f"{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.tmp.glob("*.log")))

    @staticmethod
    def _wait_port(host: str, port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex((host, port)) == 0:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"Ray head did not listen on {host}:{port} in {timeout:.0f}s")

    def _has_netns(self) -> bool:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return any(line.split()[0] == self.netns for line in out.splitlines() if line.strip())

    def _netns_pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True,
                             text=True).stdout
        return [int(p) for p in out.split()]

    def _kill_leftovers(self) -> None:
        """Any Ray process still using our temp dir (a daemon that outlived its parent)."""
        mark = str(self.tmp).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if mark in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
