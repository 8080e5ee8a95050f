"""``attention_backend: auto`` on a CPU whose C++ kernels are not built yet, in an engine that
compiles in the background (engine.compile_mode): the engine serves with the torch reference
attention while a thread builds the kernels (the compiler runs in child processes, so the
thread holds no GIL while it waits), and switches to them between two steps.

The build is the one ``create_backend`` would run (kernels/cpu_build.py: cached, locked
against other engines building it, bounded); a failed build leaves the torch attention on, as
``auto`` does at start (its warning names the error).
"""
from __future__ import annotations

import logging
import threading

import torch

from pd_cluster.attention.base import AttentionBackend, create_backend
from pd_cluster.thread_priority import BUILD_NICE, lower_this_thread

logger = logging.getLogger(__name__)


def needs_build(name: str, device: torch.device) -> bool:
    """Whether ``create_backend(name, device)`` would build the C++ kernels first."""
    if name != "auto" or device.type != "cpu":
        return False
    from kernels.cpu_build import kernels_ready
    return not kernels_ready()


class BackgroundKernels:
    """The attention backend a step uses: torch's until the C++ kernels are built."""

    def __init__(self, device: torch.device) -> None:
        self.backend: AttentionBackend = create_backend("torch", device)
        self._device = device
        self._next: AttentionBackend | None = None
        self._thread = threading.Thread(target=self._build, name="kernel-build", daemon=True)
        self._thread.start()
        logger.info("building the CPU attention kernels in the background (torch attention "
                    "until they are ready) ...")

    def _build(self) -> None:
        try:
            # Nice is per thread on Linux, and the compilers this thread starts inherit it:
            # the engine's steps go first.
            lower_this_thread(BUILD_NICE)
            from kernels.cpu_build import load_cpu_kernels
            if load_cpu_kernels():  # warns itself when it fails
                self._next = create_backend("cpu", self._device)
        except Exception as e:  # noqa: BLE001 - the torch attention stays
            logger.warning("building the CPU kernels failed (%s: %s): torch attention stays",
                           type(e).__name__, e)

    def current(self) -> AttentionBackend:
        """The backend for the step about to run (the switch happens here, between steps)."""
        if self._next is not None and self.backend is not self._next:
            self.backend = self._next
            logger.info("switched to the C++ CPU attention kernels")
        return self.backend
