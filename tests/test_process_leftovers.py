"""What an aborted run leaves on the machine: an engine subprocess whose parent died exits
(no orphan engine), and the ipc socket file of a pipe whose process was killed is removed by
the next pipe that starts there (only files whose owner process is gone)."""
from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gone(pid: int) -> bool:
    """No such process, or a zombie (exited; its new parent has not reaped it yet)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return any(line.split()[1:2] == ["Z"] for line in status.splitlines()
               if line.startswith("State:"))


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class _Lines:
    """A subprocess's stdout lines, read on a thread: ``next(timeout)`` waits for the next."""

    def __init__(self, proc: subprocess.Popen):
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self._q.put(ln.strip()) for ln in proc.stdout],
                         daemon=True).start()

    def next(self, timeout: float) -> str:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output within {timeout}s") from None


def test_an_engine_process_exits_when_its_parent_dies(tiny_model) -> None:
    """A parent starts an engine process and is SIGKILLed while the engine waits for its next
    command (blocked in recv): the engine goes too."""
    script = textwrap.dedent(f"""
        import time
        from pd_cluster.config import EngineConfig
        from pd_cluster.engine.engine_process import EngineProcess
        engine = EngineProcess(EngineConfig(model={tiny_model()!r}, device="cpu"))
        print(engine.proc.pid, flush=True)
        engine.wait_ready()
        print("ready", flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE)
    lines, child = _Lines(parent), 0
    try:
        child = int(lines.next(120))
        assert lines.next(180) == "ready"
        parent.kill()
        parent.wait(timeout=30)
        assert _wait_gone(child, 30), f"engine process {child} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        if child and not _gone(child):
            os.kill(child, signal.SIGKILL)


def test_the_parent_watch_fires_only_when_the_parent_is_gone() -> None:
    """The watch's own rule, in a subprocess: its parent is alive (nothing happens), then it
    names a parent it does not have (as after a re-parenting): it exits."""
    code = ("import sys, time; from pd_cluster.engine.engine_process import exit_with_parent;"
            "exit_with_parent(int(sys.argv[1]), 0.05); time.sleep(1.0); print('alive', "
            "flush=True); exit_with_parent(-1, 0.05); time.sleep(60)")
    proc = subprocess.run([sys.executable, "-c", code, str(os.getpid())], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "alive" and proc.returncode == 1, proc.stderr[-2000:]


def test_a_killed_pipes_socket_file_is_swept_by_the_next_pipe(tmp_path: Path) -> None:
    from connectors.pipes.base import PipeConfig, create_pipe

    code = textwrap.dedent("""
        import sys, time
        from connectors.pipes.base import PipeConfig, create_pipe
        pipe = create_pipe("zmq", PipeConfig(transport="ipc", ipc_dir=sys.argv[1]))
        print(pipe.listen(), flush=True)
        time.sleep(600)
    """)
    killed = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE)
    try:
        stale = Path(_Lines(killed).next(120).removeprefix("ipc://"))
    finally:
        killed.kill()  # SIGKILL: no close() runs
        killed.wait(timeout=30)
    assert stale.exists() and stale.name.startswith(f"pd-pipe-{killed.pid}-")
    live = tmp_path / f"pd-pipe-{os.getpid()}-live.sock"  # a live process's: kept
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    holder.bind(str(live))
    pipe = create_pipe("zmq", PipeConfig(transport="ipc", ipc_dir=str(tmp_path)))
    try:
        mine = Path(pipe.listen().removeprefix("ipc://"))
        assert not stale.exists()
        assert live.exists() and mine.exists()
    finally:
        pipe.close()
        holder.close()
    assert not mine.exists()  # a pipe closed normally removes its own
