"""Builds (once per machine, cached on disk) and loads the CPU C++ kernels in ``kernels/cpu/``.

The build is keyed by everything that makes its binary valid: the sources, torch's version
and ABI, the compiler and its flags, and this CPU's instruction set (``-march=native``), so a
cache shared between machines or torch upgrades never loads a stale or illegal binary. It
lives in ``$PD_CLUSTER_KERNEL_CACHE`` (default ``kernels/`` under the project cache,
``pd_cluster.paths.cache_root()``); a fresh
build costs ~10 s of one core. ``PD_CLUSTER_CPU_KERNELS=0`` skips it. A failed build is
logged as a warning with the compiler's error, once per process, and reported to the caller
(who falls back to the torch reference or, when the kernel was asked for by name, raises).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).resolve().parent / "cpu" / name
            for name in ("paged_attention.cpp", "onednn_linear.cpp")]
# Headers the sources include: part of the build key, not compiled on their own.
_HEADERS = sorted((Path(__file__).resolve().parent / "cpu").glob("*.h"))
_CFLAGS = ["-O3", "-march=native", "-fopenmp-simd"]
_BUILD_TIMEOUT_S = 600.0  # a build waiting on another process's gives up after this
_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "error": str (this process's one attempt)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler_version() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cxx}: {e}"


def build_key() -> str:
    h = hashlib.sha256()
    for src in [*_SOURCES, *_HEADERS]:
        h.update(src.read_bytes())
    for part in (torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), sys.version,
                 platform.machine(), " ".join(_CFLAGS), _compiler_version(), _cpu_flags()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    root = os.environ.get("PD_CLUSTER_KERNEL_CACHE")
    if root:
        return Path(root)
    from pd_cluster.paths import cache_root  # the one rule for the project's cache
    return cache_root() / "kernels"


def load_cpu_kernels() -> bool:
    """True when ``torch.ops.pd_cluster_cpu`` is loaded (built now or found in the cache)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return bool(_state["ok"])


def load_error() -> str:
    """Why the kernels are unavailable in this process ('' if they loaded or were not tried)."""
    return str(_state.get("error", ""))


def disabled_by_env() -> bool:
    """``PD_CLUSTER_CPU_KERNELS=0``: the one way to run without the kernel on purpose."""
    return os.environ.get("PD_CLUSTER_CPU_KERNELS", "1").lower() in ("0", "false", "off", "no")


def _load() -> bool:
    if disabled_by_env():
        _state["error"] = "disabled by PD_CLUSTER_CPU_KERNELS=0"
        return False
    key = build_key()
    name = f"pd_cluster_cpu_{key}"
    build = cache_dir() / name
    try:
        from torch.utils import cpp_extension
        build.mkdir(parents=True, exist_ok=True)
        with _build_lock(build):
            # Under our lock no other process is building here, so torch's own lock file is a
            # leftover of a build that was killed: torch would wait on it forever.
            (build / "lock").unlink(missing_ok=True)
            cpp_extension.load(name, [str(s) for s in _SOURCES], extra_cflags=_CFLAGS,
                               build_directory=str(build), is_python_module=False,
                               verbose=False)
        # It writes ``out`` and returns nothing: its fake (tracing) form does nothing, so a
        # compiled graph may keep it as an opaque call.
        torch.library.register_fake("pd_cluster_cpu::paged_attention")(lambda *args: None)
        torch.library.register_fake("pd_cluster_cpu::onednn_linear")(
            lambda x, packed, bias, out_features: x.new_empty((*x.shape[:-1], out_features)))
    except Exception as e:  # a compiler error, a missing toolchain, a bad cache dir
        _state["error"] = f"{type(e).__name__}: {e}"
        logger.warning("CPU attention kernel unavailable (build in %s failed), falling back to "
                       "the slower torch attention (and compiled steps' packed linears to a "
                       "Python op): %s", build, _state["error"])
        return False
    return True



@contextlib.contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """An flock beside the build directory, waited on with a bound (the OS releases it when
    its holder dies, unlike torch's lock file)."""
    import fcntl
    fd = os.open(build.parent / f"{build.name}.flock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + _BUILD_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building {build} for over "
                                       f"{_BUILD_TIMEOUT_S:.0f} s") from None
                time.sleep(0.2)  # another process is building: poll its lock
        yield
    finally:
        os.close(fd)  # closing releases the flock
