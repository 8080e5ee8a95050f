"""Facts about this host that decide whether a compiled artifact (inductor code, the C++
kernels) built elsewhere may run here: one rule for every cache key that needs them."""
from __future__ import annotations

import functools
import platform
from pathlib import Path

# /proc/cpuinfo names the instruction-set list "flags" on x86 and "Features" on aarch64
# (one line per core, identical on the CPUs we run on: the first is the set).
_FEATURE_FIELDS = ("flags", "features")


def _cpuinfo_field(names: tuple[str, ...]) -> str | None:
    """The first /proc/cpuinfo line's value whose name is one of ``names``; None where there
    is none or the file cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip().lower() in names:
                return value
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def _feature_line() -> str | None:
    """The instruction-set list of /proc/cpuinfo; None where it cannot be read."""
    return _cpuinfo_field(_FEATURE_FIELDS)


@functools.lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """The x86 vendor string (``GenuineIntel``, ``AuthenticAMD``); empty elsewhere or where
    /proc/cpuinfo cannot be read."""
    return (_cpuinfo_field(("vendor_id",)) or "").strip()


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set features (``avx512f``, ``amx_tile``, ...); empty where
    /proc/cpuinfo cannot be read."""
    line = _feature_line()
    return frozenset(line.split()) if line is not None else frozenset()


def cpu_features() -> str:
    """``machine: feature feature ...`` (sorted) for this CPU, on x86 and aarch64 alike; the
    processor string where /proc/cpuinfo is missing (a build for ``-march=native`` is only
    valid on a CPU with the same features)."""
    line = _feature_line()
    if line is not None:
        return f"{platform.machine()}: " + " ".join(sorted(line.split()))
    return f"{platform.machine()}: {platform.processor()}"
