"""The compiled step made off the step loop (``engine.compile_mode: background``): the engine
serves eagerly from the moment its weights are loaded, and switches to the compiled graph
between two steps once it is ready (compiled_model.py: ``CompiledModel.offer``).

A thread of the engine does it: an artifact already on disk (a warm cache) is loaded there;
otherwise a child process (compile_child.py) loads the same model the same way and compiles it
into the on-disk artifact (compile_cache.py: the key is checked equal to the engine's), then
the thread loads it. A child, not a thread, compiles: tracing and inductor's code generation
are minutes of Python that would hold the engine's GIL (the steps' TPOT), a compile cannot be
interrupted in a thread, and a crash in a compiler stays in the child. The child runs on the
cores the engine's compile would have used (it inherits the engine's affinity and thread
count) at a lower priority (``CHILD_NICE``), so serving goes first and the compile takes the
rest; it is killed with its process group on ``stop`` (bounded), when its engine dies
(``worker._watch_parent``), or after ``CHILD_TIMEOUT``. Any failure leaves the engine eager,
with a warning.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)

CHILD_NICE = 10  # the compile yields the engine's cores to its steps (CFS weight ~1/10)
CHILD_TIMEOUT = 1800.0  # s: a compile still running then is given up (the engine stays eager)
_POLL = 0.1  # s between the thread's checks of the child and of a stop
_KILL_WAIT = 3.0  # s: SIGTERM, then SIGKILL


def child_command(config_json: str, rank: int, size: int, expect: str) -> list[str]:
    """The compile child's command line (its key must come out as ``expect``)."""
    return [sys.executable, "-m", "pd_cluster.engine.compile_child", "--config", config_json,
            "--rank", str(rank), "--size", str(size), "--threads", str(torch.get_num_threads()),
            "--nice", str(CHILD_NICE), "--expect", expect, "--parent", str(os.getpid())]


class BackgroundCompile:
    """Makes ``target``'s compiled graph in a thread (and a child process) and offers it."""

    def __init__(self, target: Any, config: Any, device: torch.device) -> None:
        self._target = target
        self._config_json = config.on_device(device).model_dump_json()
        self._device = device
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the child's handle: the thread's and stop()'s
        self.proc: subprocess.Popen | None = None
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="background-compile",
                                        daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """End the compile: the child (and its compilers) killed, the thread joined."""
        self._stop.set()
        self._kill()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the background compile did not end within %.0f s", timeout)

    # ---- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        target = self._target
        try:
            from pd_cluster.engine import artifact_store
            from pd_cluster.engine.compile_cache import (artifact_dir, remember_isa_probe,
                                                         skip_known_isa_probe)
            folder = artifact_dir()
            target.locate(self._device, folder)  # the key: seconds of Python, off the steps
            skip_known_isa_probe()
            with torch.inference_mode():  # as the steps' guard checks
                fn = target._load() if target.path.is_file() else None
                if fn is None and self._compile_in_child():
                    fn = target._load()
            if self._stop.is_set():
                return
            remember_isa_probe()
            artifact_store.prune_once(folder, artifact_store.limits_from_env())
            if self._stop.is_set():
                return
            if fn is None:
                raise RuntimeError(f"no usable artifact at {target.path}")
        except Exception as e:  # noqa: BLE001 - any failure: the engine stays eager
            if not self._stop.is_set():
                target.state = "failed"
                logger.warning("the background compile failed (%s: %s): the engine keeps "
                               "serving eagerly", type(e).__name__, e)
            return
        target.offer(fn, time.monotonic() - self.started)

    def _compile_in_child(self) -> bool:
        """Run the compile child to its end: whether it left the artifact."""
        tp = self._target.model.tp
        cmd = child_command(self._config_json, tp.rank, tp.size, str(self._target.path))
        logger.info("compiling the model in the background (serving eagerly until it is "
                    "ready) ...")
        with self._lock:
            if self._stop.is_set():
                return False
            # Its own process group (stop() kills inductor's compile workers and compilers too), in
            # the engine's session: a new one is a new autogroup, where its nice would not count.
            self.proc = subprocess.Popen(cmd, process_group=0, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + CHILD_TIMEOUT
        while self.proc.poll() is None:
            if self._stop.wait(_POLL):
                return False
            if time.monotonic() > deadline:
                self._kill()
                raise TimeoutError(f"the compile ran past {CHILD_TIMEOUT:.0f} s")
        self._kill()  # what its group left behind (compile workers)
        code = self.proc.returncode
        if code != 0:
            raise RuntimeError(f"the compile process exited with {code}"
                               + (" (its key differs from the engine's)" if code == 4 else ""))
        return True

    def _kill(self) -> None:
        with self._lock:
            proc = self.proc
            if proc is None:
                return
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break  # the group is gone
                try:
                    proc.wait(_KILL_WAIT)
                    if sig == signal.SIGTERM:
                        continue  # its group's stragglers get the SIGKILL
                except subprocess.TimeoutExpired:
                    continue
