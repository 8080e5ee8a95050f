"""Builds (once per machine, cached on disk) and loads the CPU C++ kernels in ``kernels/cpu/``.

The build is keyed by everything that makes its binary valid: the sources, torch's version
and ABI, the compiler and its flags, and this CPU's features (``pd_cluster.host_facts``, x86
and aarch64 alike), so a cache shared between machines or torch upgrades never loads a stale
or illegal binary. It lives in ``$PD_CLUSTER_KERNEL_CACHE`` (default ``kernels/`` under the
project cache, ``pd_cluster.paths.cache_root()``), a 0700 folder of this user's; a ``.so`` is
loaded only if it is ours and writable by us alone, and old builds are pruned
(``build_cache.py``). A fresh build costs ~10 s of one core. ``PD_CLUSTER_CPU_KERNELS=0``
skips it.

``PD_CLUSTER_CPU_ISA`` picks the instruction set: ``native`` (default, ``-march=native``),
``avx512`` (AVX-512 without its BF16 extension, as on Skylake-X: tests that path on newer
CPUs) or ``portable`` (no AVX-512: the portable kernel path). Each has its own build.

A failed build is logged as one warning with the compiler's error, once per process, and
reported to the caller (who falls back to the torch reference or, when the kernel was asked
for by name, raises) and in the engine's stats (``kernel_stats``).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from kernels import build_cache
from pd_cluster.host_facts import cpu_features
from pd_cluster.private_files import private_dir

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).resolve().parent / "cpu" / name
            for name in ("paged_attention.cpp", "onednn_linear.cpp", "ghash_copy.cpp",
                         "write_kv.cpp")]
# Headers the sources include: part of the build key, not compiled on their own.
_HEADERS = sorted((Path(__file__).resolve().parent / "cpu").glob("*.h"))
# -fopenmp: ATen's parallel_for is a header template that runs its loop on OpenMP threads only
# when the caller is compiled with OpenMP (else serially, on one core). The library then needs
# libgomp.so.1, which resolves to the copy torch has already loaded: one runtime, one pool,
# sized by torch.set_num_threads.
_BASE_CFLAGS = ["-O3", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
ISA_ENV = "PD_CLUSTER_CPU_ISA"
ISAS = ("native", "avx512", "portable")
_BUILD_TIMEOUT_S = 600.0  # a build waiting on another process's gives up after this
_lock = threading.Lock()
_background_lock = threading.Lock()
_background: list[threading.Thread] = []  # the one background build, once started
# This process's one attempt: "ok": bool, "error": str, "in_use": the fd holding its build.
_state: dict[str, Any] = {}


def isa() -> str:
    """``$PD_CLUSTER_CPU_ISA`` (default ``native``); ValueError naming it when unknown."""
    value = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if value not in ISAS:
        raise ValueError(f"{ISA_ENV}={value!r}: must be one of {', '.join(ISAS)}")
    return value


def cpu_has_avx512() -> bool:
    """Whether this CPU runs AVX-512 code (the ``avx512`` build's requirement)."""
    return platform.machine() in ("x86_64", "AMD64") and " avx512f" in f" {cpu_features()} "


def cflags(isa_name: str) -> list[str]:
    """The compiler flags of an ISA choice; RuntimeError when this CPU cannot run it."""
    machine = platform.machine()
    if isa_name == "native":
        return [*_BASE_CFLAGS, "-march=native"]
    if isa_name == "avx512":
        if not cpu_has_avx512():
            raise RuntimeError(f"{ISA_ENV}=avx512 needs an x86-64 CPU with AVX-512 (avx512f); "
                               f"this one ({machine}) has none")
        # Skylake-X's set: AVX-512 F/CD/BW/DQ/VL, no BF16 (the fallback of the bf16 dot path).
        return [*_BASE_CFLAGS, "-march=skylake-avx512", "-mno-avx512bf16"]
    # portable: a baseline with no AVX-512, so the kernel takes its portable path.
    arch = {"x86_64": "-march=x86-64-v2", "AMD64": "-march=x86-64-v2",
            "aarch64": "-march=armv8-a"}.get(machine)
    return [*_BASE_CFLAGS, *([arch] if arch else [])]


def _compiler_version() -> str:
    return _version_of(os.environ.get("CXX", "c++"))


@functools.lru_cache(maxsize=8)
def _version_of(cxx: str) -> str:
    # Cached: the build key is asked for on paths that must stay fast (loaded_without_waiting).
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cxx}: {e}"


def build_key(isa_name: str | None = None) -> str:
    """The build's key under ``isa_name`` (default: ``$PD_CLUSTER_CPU_ISA``)."""
    isa_name = isa_name or isa()
    h = hashlib.sha256()
    for src in [*_SOURCES, *_HEADERS]:
        h.update(src.read_bytes())
    flags = cflags(isa_name) if isa_name != "avx512" or cpu_has_avx512() else [isa_name]
    for part in (torch.__version__, str(torch._C._GLIBCXX_USE_CXX11_ABI), sys.version,
                 isa_name, " ".join(flags), _compiler_version(), cpu_features()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def build_name(isa_name: str | None = None) -> str:
    """The build's folder and library name in ``cache_dir()``."""
    return f"{build_cache.PREFIX}{build_key(isa_name)}"


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


def kernels_ready() -> bool:
    """Whether ``load_cpu_kernels()`` answers without building: tried in this process,
    disabled, or this machine's build already in the cache (else it runs the compiler: tens
    of seconds, which an engine starting in the background does not wait for)."""
    if "ok" in _state or disabled_by_env():
        return True
    try:
        name = build_name()
        return (cache_dir() / name / f"{name}.so").is_file()
    except Exception:  # noqa: BLE001 - a bad setting or toolchain: load_cpu_kernels says it
        return True


def loaded_without_waiting() -> bool:
    """Whether the kernels are loaded now, loading them here only when that needs neither a
    build nor a wait on one. False while this process builds them (or they are off or
    failed): a path that must never stall (a KV send) takes its fallback now, asks again
    later, and switches once they are loaded, as the attention does. A build is started in
    the background when none has been (``build_in_background``)."""
    if "ok" in _state:
        return bool(_state["ok"])
    if disabled_by_env() or not _lock.acquire(blocking=False):
        return False  # off, or another thread of ours is building (or loading) them
    try:
        if "ok" not in _state:
            if not kernels_ready():
                build_in_background()
                return False
            _state["ok"] = _load()  # built already: a dlopen
        return bool(_state["ok"])
    finally:
        _lock.release()


def build_in_background() -> None:
    """Start building (and loading) the kernels on a niced daemon thread, once per process;
    a no-op once they were tried. Compilers run as child processes: the thread holds no GIL
    while they work."""
    with _background_lock:
        if "ok" in _state or _background:
            return
        thread = threading.Thread(target=_build_niced, name="cpu-kernel-build", daemon=True)
        _background.append(thread)
        thread.start()


def _build_niced() -> None:
    from pd_cluster.thread_priority import BUILD_NICE, lower_this_thread
    try:
        lower_this_thread(BUILD_NICE)
    except OSError:  # a priority we may not set: build at the engine's level
        pass
    load_cpu_kernels()  # warns itself when the build fails


def load_error() -> str:
    """Why the kernels are unavailable in this process ('' if they loaded or were not tried)."""
    return str(_state.get("error", ""))


def kernel_stats() -> dict[str, Any]:
    """For the engine's stats (``pd-cluster status``, /metrics): ``cpu_kernels`` is ``ok``,
    ``failed: <reason>``, or ``off`` (disabled, or never needed: a GPU engine, torch
    attention with no packed GEMM); ``cpu_kernels_loaded`` 1 or 0."""
    if _state.get("ok"):
        return {"cpu_kernels": "ok", "cpu_kernels_loaded": 1}
    if "ok" not in _state or disabled_by_env():
        return {"cpu_kernels": "off", "cpu_kernels_loaded": 0}
    return {"cpu_kernels": f"failed: {load_error()}", "cpu_kernels_loaded": 0}


def disabled_by_env() -> bool:
    """``PD_CLUSTER_CPU_KERNELS=0``: the one way to run without the kernel on purpose."""
    return os.environ.get("PD_CLUSTER_CPU_KERNELS", "1").lower() in ("0", "false", "off", "no")


def _load() -> bool:
    if disabled_by_env():
        _state["error"] = "disabled by PD_CLUSTER_CPU_KERNELS=0"
        return False
    isa_name = isa()  # an unknown value is the user's error: raised, not a fallback
    build = cache_dir()
    try:
        flags = cflags(isa_name)
        name = build_name(isa_name)
        build = private_dir(cache_dir()) / name
        _build_and_load(name, build, flags)
    except Exception as e:  # a compiler error, a missing toolchain, an unsafe cache dir
        _state["error"] = f"{type(e).__name__}: {e}"
        logger.warning("CPU kernels unavailable (%s, build in %s): attention_backend auto "
                       "uses the slower torch attention instead, and compiled steps' packed "
                       "linears a Python op", _state["error"], build)
        return False
    try:
        removed = build_cache.prune(build.parent, build.name)
        if removed:
            logger.info("CPU kernel cache: pruned %d old build(s) in %s", len(removed),
                        build.parent)
    except OSError as e:  # pruning is housekeeping: never a reason to fail a load
        logger.warning("CPU kernel cache: pruning %s failed: %s", build.parent, e)
    return True


def staged_sources(build: Path) -> list[Path]:
    """The sources and headers copied into ``build/src`` (unchanged files left as they are),
    the compiled ones returned: the build's commands then name the same paths from every
    checkout whose sources have this key, so ninja does not rebuild when another checkout
    (a second clone, a worktree, an installed wheel) loaded it last. Call under build_lock."""
    src = private_dir(build / "src")
    for f in [*_SOURCES, *_HEADERS]:
        dest, data = src / f.name, f.read_bytes()
        if not dest.is_file() or dest.read_bytes() != data:
            tmp = dest.with_name(dest.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dest)
    return [src / f.name for f in _SOURCES]


def _build_and_load(name: str, build: Path, flags: list[str]) -> None:
    from torch.utils import cpp_extension
    with build_cache.build_lock(build, _BUILD_TIMEOUT_S):
        build_cache.prepare(build)  # (re)made private; an unsafe .so removed
        # Under our lock no other process is building here, so torch's own lock file is a
        # leftover of a build that was killed: torch would wait on it forever.
        (build / "lock").unlink(missing_ok=True)
        cpp_extension.load(name, [str(s) for s in staged_sources(build)], extra_cflags=flags,
                           extra_ldflags=_LDFLAGS, build_directory=str(build),
                           is_python_module=False, verbose=False)
        build_cache.seal(build)
        _state["in_use"] = build_cache.hold_in_use(build)
    # It writes ``out`` and returns nothing: its fake (tracing) form does nothing, so a
    # compiled graph may keep it as an opaque call.
    torch.library.register_fake("pd_cluster_cpu::paged_attention")(lambda *args: None)
    torch.library.register_fake("pd_cluster_cpu::onednn_linear")(
        lambda x, packed, bias, out_features: x.new_empty((*x.shape[:-1], out_features)))
