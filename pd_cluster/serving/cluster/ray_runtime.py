"""Getting a Ray cluster to run on: connect to a named one, or start a local one.

- An address (``--address``, ``RAY_ADDRESS`` or the config's ``ray.address``): connect.
- None, foreground: ``ray.init`` starts an embedded local instance that dies with us.
- None, ``--detach``: a local head must outlive the launcher, so ``ray start --head --block``
  runs as its own session; stopping it is SIGTERM to that one process (never ``ray stop``,
  which would kill every Ray instance of this user on the machine).
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

_HEAD_START_TIMEOUT = 90.0


def serving_priority() -> None:
    """The Ray we start runs its workers at our priority, unless the user set
    ``RAY_worker_niceness``. Ray renices each worker by 15 by default, so on a shared host an
    engine actor gets ~1/30 of a core against any un-niced process: a cluster's start-up took
    357 s instead of ~10 s on a busy 2-core machine, and its tokens would come as slowly.
    A Ray started by ``ray up`` / ``ray start`` sets it in its start commands (configs/)."""
    os.environ.setdefault("RAY_worker_niceness", "0")


@dataclass
class RayRuntime:
    address: str | None  # GCS address others can connect to
    kind: str  # "existing" (already connected), "connected", "embedded" or "head"
    head_pid: int | None = None
    temp_dir: Path | None = None  # an embedded instance's own Ray temp dir (removed with it)

    def disconnect(self) -> None:
        """Leave the cluster; an embedded instance is shut down with it, its session folder
        too."""
        import ray
        if self.kind in ("connected", "embedded", "head"):
            ray.shutdown()
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_address(cli_address: str | None, config_address: str | None) -> str | None:
    return cli_address or os.environ.get("RAY_ADDRESS") or config_address or None


def start_ray(address: str | None, namespace: str, num_cpus: float, num_gpus: float | None,
              detach: bool, log_dir: Path, log_to_driver: bool = False) -> RayRuntime:
    """``log_to_driver``: actors' output (the proxy's access and stats lines) on our console."""
    import ray
    if ray.is_initialized():  # e.g. tests, or a notebook: use the caller's connection
        return RayRuntime(_gcs_address(), "existing")
    if address:
        connect(address, namespace, log_to_driver)
        return RayRuntime(_gcs_address(), "connected")
    serving_priority()  # read by the raylet we are about to start (inherits our environment)
    if not detach:
        # address="local": a new instance even if /tmp/ray names someone else's `ray start`.
        # Its session folder in a temp dir of ours, removed at shutdown: /tmp/ray (and its
        # session_latest, which `ray` commands follow) stays as the user's own Ray left it.
        if "RAY_AUTH_MODE" not in os.environ:
            # What Ray picks for a new local instance anyway, said explicitly: no warning
            # at every start (docs/deployment.md: `ray status` needs RAY_AUTH_MODE=token).
            _use_token_auth()
        temp_dir = Path(tempfile.mkdtemp(prefix="pd-cluster-ray-"))
        try:
            with _no_terminal_sigint():
                ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus,
                         namespace=namespace, include_dashboard=False,
                         log_to_driver=log_to_driver, _temp_dir=str(temp_dir))
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
        return RayRuntime(_gcs_address(), "embedded", temp_dir=temp_dir)
    port = free_port()
    if "RAY_AUTH_MODE" not in os.environ:
        _use_token_auth()  # what `ray start` uses by default; we must connect the same way
        _ensure_token()
    pid = start_head(port, num_cpus, num_gpus, log_dir / f"ray-head-{port}.log")
    addr = f"127.0.0.1:{port}"
    try:
        connect(addr, namespace)
    except BaseException:
        stop_head(pid, addr)
        raise
    return RayRuntime(addr, "head", pid)


@contextlib.contextmanager
def _no_terminal_sigint() -> Iterator[None]:
    """Ray's GCS and raylet start with SIGINT ignored (an ignored signal stays ignored across
    exec): Ctrl-C reaches the terminal's whole process group, and Ray dying with it would stop
    the engines before the proxy drains (api/shutdown.py). The launcher stops them itself."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def connect(address: str, namespace: str, log_to_driver: bool = False) -> None:
    """ray.init(address) with the same auth mode a local `ray start` head uses."""
    import ray
    # Ray 2.5x+ heads enable token auth by default, but a connecting driver only does when
    # told: use the local token if there is one and the mode is not set explicitly.
    if "RAY_AUTH_MODE" not in os.environ and (Path.home() / ".ray" / "auth_token").is_file():
        _use_token_auth()
    ray.init(address=address, namespace=namespace, log_to_driver=log_to_driver)


def _use_token_auth() -> None:
    os.environ["RAY_AUTH_MODE"] = "token"
    try:  # Ray caches its config at import: refresh it (as ray.init does for a new cluster)
        from ray._raylet import Config
        Config.initialize("")
    except Exception:  # noqa: BLE001 - older Ray: no token auth, nothing to refresh
        pass


def _ensure_token() -> None:
    """A token-auth head refuses to start without a token: make one where `ray start` and
    our drivers look (~/.ray/auth_token) on a machine that never had one, as
    `ray get-auth-token --generate` does."""
    if (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
            or (Path.home() / ".ray" / "auth_token").is_file()):
        return
    done = subprocess.run([*_ray_cli(), "get-auth-token", "--generate"], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"could not create a Ray auth token (`ray get-auth-token --generate`"
                           f" exited with {done.returncode}: {done.stderr.strip()[-300:]})")


def _ray_cli() -> list[str]:
    ray = Path(sys.executable).with_name("ray")
    return [str(ray)] if ray.exists() else [sys.executable, "-m", "ray.scripts.scripts"]


def _gcs_address() -> str | None:
    import ray
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - informational only
        return None


def head_temp_dir(port: int) -> Path:
    """Our head's own Ray temp dir: its address file must not redirect other users' ray.init()."""
    return Path(tempfile.gettempdir()) / f"pd-cluster-ray-{port}"


def start_head(port: int, num_cpus: float, num_gpus: float | None, log_path: Path) -> int:
    """``ray start --head --block`` in its own session; returns its pid once GCS is up."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [*_ray_cli(), "start", "--head", "--block",
           f"--port={port}", f"--temp-dir={head_temp_dir(port)}",
           f"--num-cpus={int(max(1, round(num_cpus)))}",
           "--disable-usage-stats", "--include-dashboard=false", "--log-color=false",
           f"--dashboard-agent-listen-port={free_port()}"]
    if num_gpus is not None:
        cmd.append(f"--num-gpus={int(num_gpus)}")
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])  # workers must import pd_cluster too
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    deadline = time.monotonic() + _HEAD_START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with {proc.returncode}; see {log_path}")
        if b"Ray runtime started" in log_path.read_bytes() and _port_open(port):
            return proc.pid
        time.sleep(0.3)
    stop_head(proc.pid, f"127.0.0.1:{port}")
    raise RuntimeError(f"`ray start --head` did not come up in {_HEAD_START_TIMEOUT:.0f}s; "
                       f"see {log_path}")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_head(pid: int, address: str | None = None, timeout: float = 30.0) -> bool:
    """SIGTERM the `ray start --block` process (it tears its own head down), then SIGKILL;
    with the head's address, its temp dir goes too."""
    stopped = _terminate(pid, timeout)
    if stopped and address:
        shutil.rmtree(head_temp_dir(int(address.rsplit(":", 1)[1])), ignore_errors=True)
    return stopped


def _terminate(pid: int, timeout: float) -> bool:
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:  # reap it if it is our child; otherwise just watch it go
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return True
            except ChildProcessError:
                if not pid_alive(pid):
                    return True
            time.sleep(0.2)
    return not pid_alive(pid)
