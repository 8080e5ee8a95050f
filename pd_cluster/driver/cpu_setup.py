"""CPU cores and runtime libraries for engine processes, set up the way CPU inference servers do.

Cores: an engine claims ``n`` cores of its node for its compute threads (torch's intra-op
threads run on the engine thread and the OpenMP threads it starts, which inherit its mask)
and pins the engine thread to them. Ray's ``num_cpus`` is only an account, so engines claim
real cores themselves: one ``flock``-ed file per core under ``<tmp>/pd-cluster-cores-<uid>``,
held for the process's life (the kernel drops it when the process dies), so one user's engines
on a node never pin onto the same core. The folder is this user's alone (0700, owner-checked)
and the lock files are opened without following symlinks and never truncated
(pd_cluster/private_files.py): on a shared machine another user can pre-create the folder or
plant a symlink in it. Pinning is an optimisation, so any error on the way (such a folder, a
full disk, an affinity the OS refuses) leaves the engine not pinned, with a warning; it never
stops the engine from starting. The node's ``reserve`` lowest cores are the serving path's
(proxy, Ray, the OS): decode and colocated engines take them last, prefill engines first. Where
an engine must share a core with serving (1P1D on 2 cores), P's does: a prefill is a burst of
throughput work that serving's short wake-ups hardly delay, while every wait in a decode step
is every running request's inter-token time; and the placement no longer depends on which
engine starts first. When fewer than ``n`` cores are free the engine does not
pin at all (two engines pinned to one core while another idles is worse than letting the OS
place them) and says so.

Libraries: where a node has them, tcmalloc and Intel's OpenMP runtime (libiomp5, which also
serves torch's GNU OpenMP calls) are LD_PRELOADed into engine processes (the env goes into the
Ray actor's runtime_env or a subprocess's env). Absent, the launcher says so once and goes on.
"""
from __future__ import annotations

import ctypes.util
import fcntl
import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pd_cluster.private_files import open_private, private_dir

logger = logging.getLogger(__name__)

_LOCK_DIR = "pd-cluster-cores-{uid}"  # per user: another user's locks are not ours to share
# Library file names, most preferred first; searched in the interpreter's prefix (pip wheels
# such as intel-openmp install there), then the dynamic linker's paths.
TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so",
            "libtcmalloc.so")
IOMP = ("libiomp5.so",)


@dataclass(frozen=True)
class CpuPolicy:
    """How engines use a node's CPUs (the cluster config's ``cpu`` section takes its
    defaults from here; stand-alone engine processes use it directly)."""
    pin_threads: bool = True
    reserve_cores: int = 1
    preload_libraries: bool = True


@dataclass
class CoreClaim:
    """Cores this process holds for its compute threads (empty: it pins nothing)."""
    cores: tuple[int, ...] = ()
    why_not: str = ""  # when empty: the reason, for the log
    _locks: list[IO[bytes]] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for f in self._locks:
            f.close()  # closing the file drops its flock
        self._locks.clear()


def node_cores() -> list[int]:
    """The cores this process may run on, ascending."""
    return sorted(os.sched_getaffinity(0))


def claim_order(cores: list[int], reserve: int, serving_first: bool = False) -> list[int]:
    """Cores in the order an engine claims them: the unreserved ones (highest first), then the
    ``reserve`` lowest (the serving path's), highest first; ``serving_first`` (a prefill
    engine): the reserved ones first, then the rest from the lowest up (away from the decode
    engines, which claim from the top)."""
    reserved, rest = cores[:reserve], cores[reserve:]
    if serving_first:
        return sorted(reserved, reverse=True) + sorted(rest)
    return sorted(rest, reverse=True) + sorted(reserved, reverse=True)


def lock_dir_default() -> Path:
    """This user's core-lock folder under the temp folder (``TMPDIR``)."""
    return Path(tempfile.gettempdir()) / _LOCK_DIR.format(uid=os.geteuid())


def claim_cores(n: int, reserve: int = 1, lock_dir: Path | None = None,
                serving_first: bool = False) -> CoreClaim:
    """Claim ``n`` cores of this node for this process, or none (see the module doc): any
    error while claiming is logged as a warning and gives an empty claim, never raised."""
    if n < 1:
        raise ValueError(f"n: need at least one core, got {n}")
    if not hasattr(os, "sched_setaffinity"):
        return CoreClaim(why_not="this OS has no sched_setaffinity")
    held: list[IO[bytes]] = []
    try:
        return _claim(n, reserve, lock_dir or lock_dir_default(), serving_first, held)
    except Exception as e:  # noqa: BLE001 - pinning is optional: start unpinned, say why
        for f in held:
            f.close()
        why = f"core locks unusable ({type(e).__name__}: {e})"
        logger.warning("compute threads not pinned: %s", why)
        return CoreClaim(why_not=why)


def _claim(n: int, reserve: int, root: Path, serving_first: bool,
           held: list[IO[bytes]]) -> CoreClaim:
    """``claim_cores``' work; the locks it takes go into ``held`` (the caller closes them on
    an error)."""
    private_dir(root)
    cores: list[int] = []
    for core in claim_order(node_cores(), reserve, serving_first):
        # O_NOFOLLOW, no truncation, owner-checked: a planted symlink or file raises here.
        f = os.fdopen(open_private(root / f"core-{core}.lock"), "r+b", buffering=0)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        held.append(f)
        cores.append(core)
        if len(cores) == n:
            return CoreClaim(tuple(sorted(cores)), _locks=list(held))
    for f in held:
        f.close()
    held.clear()
    return CoreClaim(why_not=f"{n} core(s) wanted, {len(cores)} of this node's "
                             f"{len(node_cores())} free (others hold the rest)")


def pin_thread(cores: tuple[int, ...]) -> bool:
    """Pin the calling thread (and the threads it starts later, OpenMP's workers among them:
    a new thread inherits its creator's mask) to ``cores``. False, with a warning, where
    the OS refuses (e.g. a core taken away from this process since it was claimed)."""
    try:
        os.sched_setaffinity(0, cores)  # pid 0: the calling thread on Linux
    except OSError as e:
        logger.warning("compute threads not pinned to cores %s: %s", list(cores), e)
        return False
    return True


def find_library(names: tuple[str, ...]) -> str | None:
    """The first of ``names`` found in this interpreter's prefix or the linker's paths."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        for name in names:
            path = Path(prefix) / "lib" / name
            if path.is_file():
                return str(path)
    for name in names:
        stem = name[3:].split(".so")[0]  # libtcmalloc_minimal.so.4 -> tcmalloc_minimal
        found = ctypes.util.find_library(stem)
        if found:
            return found
    return None


def preload_env(current: str | None = None) -> tuple[dict[str, str], list[str]]:
    """(env vars that preload tcmalloc and libiomp5 where found, the libraries missing).

    The engine's threads are pinned by ``pin_thread``; Intel OpenMP is told not to pin them
    again and to spin only briefly after a parallel region (its default, 200 ms, would burn
    the cores the serving path runs on)."""
    libs = {"tcmalloc": find_library(TCMALLOC), "libiomp5": find_library(IOMP)}
    found = [p for p in libs.values() if p]
    missing = [name for name, p in libs.items() if not p]
    env: dict[str, str] = {}
    if found:
        kept = [p for p in (current or "").split(":") if p and p not in found]
        env["LD_PRELOAD"] = ":".join(found + kept)
    if libs["libiomp5"]:
        env.update(KMP_AFFINITY="disabled", KMP_BLOCKTIME="1")
    return env, missing


def loaded_libraries(pid: int | str = "self") -> set[str]:
    """File names of the shared libraries mapped into process ``pid`` (Linux)."""
    out = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            path = line.rsplit(" ", 1)[-1].strip()
            if ".so" in path:
                out.add(os.path.basename(path))
    return out
