"""Where a compiled decoder is kept between processes, and what its key covers.

An artifact (``artifact_dir()``, inside inductor's cache dir) is one ``torch.compile(...).aot_compile`` result (dynamo's bytecode and guards
plus inductor's generated code, serialized), so a restart loads it without tracing the model
again. It is named by a key over everything that changes the graph: the module tree and its
parameters' names, shapes and dtypes (the model family, its config, quantization and this
rank's tensor-parallel slice), the rank and group size, the device (on a CPU: its features,
``host_facts.cpu_features``, and the intra-op thread count, which inductor bakes into its C++
as ``num_threads(N)``; or this GPU), whether the packed linears call the C++ GEMM op
(``cpu_gemm.packed_cpp``: a graph calling an op that did not load cannot run), the Python and
torch versions, the inductor and dynamo settings, and the source of the code that is traced
(``pd_cluster/models``, ``kernels``, this package's compile modules).
Weights are inputs of the graph, not part of it, so a checkpoint with the same shapes reuses
the artifact. A stale or unreadable artifact is rejected by its loader (``compiled_model.py``),
deleted and compiled again. The folders are this user's and private, and an artifact is read
only after an owner and mode check (``artifact_store.py``, which also prunes old ones).

It also remembers, per CPU, compiler and torch version, that inductor's instruction-set probe
passed (it builds and loads a test library per vector ISA, in child processes, on every start:
about a second), so later starts skip it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

import torch

from pd_cluster.engine.artifact_store import read_artifact, write_artifact
from pd_cluster.host_facts import cpu_features
from pd_cluster.paths import cache_root
from pd_cluster.private_files import UnsafePath, private_dir

logger = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parents[1]  # pd_cluster/
_TRACED_CODE = (_PACKAGE / "models", _PACKAGE.parent / "kernels", Path(__file__).parent)
_COMPILE_MODULES = ("compiled_model.py", "compile_cache.py")


def inductor_cache_dir() -> Path:
    """Inductor's on-disk caches (the kernels an artifact loads): ``TORCHINDUCTOR_CACHE_DIR``
    if the user chose one, else the project's cache dir (set for this process and its
    children, so tensor-parallel workers share it). Importing inductor sets the variable to
    its own default (a temp dir, lost on reboot): that one counts as not chosen. Inductor is
    imported only when the variable is set: an engine's start does not wait for that import
    (which a niced kernel-build thread may be holding, background_kernels.py)."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not path or os.path.abspath(path) == os.path.abspath(_inductor_default()):
        path = str(cache_root() / "inductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return Path(path)


def _inductor_default() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    return default_cache_dir()


def artifact_dir() -> Path:
    """Our artifacts, beside inductor's caches (one dir holds all compiled code), with both
    folders checked: this user's, not writable by others (made 0700). Raises UnsafePath: a
    pickle or an inductor ``.so`` read from a folder another user can write runs their code."""
    inductor = private_dir(inductor_cache_dir())
    return private_dir(inductor / "pd_cluster")


def _source_files() -> Iterable[Path]:
    models, kernels, engine = _TRACED_CODE
    yield from sorted(models.rglob("*.py"))
    yield from sorted(kernels.rglob("*.py"))
    for name in _COMPILE_MODULES:
        yield engine / name


def _code_digest() -> str:
    h = hashlib.sha256()
    for path in _source_files():
        h.update(str(path.relative_to(_PACKAGE.parent)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _device_facts(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"cuda {props.name} sm{props.major}{props.minor} {torch.version.cuda}"
    # Inductor's C++ runs ``#pragma omp parallel num_threads(N)`` with N the count at compile
    # time (or no parallel region at 1): an artifact compiled for other threads runs wrong-sized.
    return f"{device.type} {cpu_features()} threads {torch.get_num_threads()}"


def _gemm_op_facts(model: torch.nn.Module) -> str:
    """Which op the packed linears' graph calls: the C++-registered one (``packed_cpp``, set
    when kernels/cpu loaded) or the Python custom op. Not a tensor, so not in the fingerprint."""
    flags = {bool(m.packed_cpp) for m in model.modules()
             if getattr(m, "packed", None) is not None and hasattr(m, "packed_cpp")}
    return "gemm " + ",".join("cpp" if f else "python" for f in sorted(flags))


def _module_fingerprint(model: torch.nn.Module) -> str:
    """The module tree (classes, extra reprs) and every tensor it holds (parameters, buffers,
    plain attributes such as a prepacked weight): name, shape, strides, dtype and device,
    what the traced graph depends on (a transposed or packed weight layout included), without
    the weights' values."""
    tensors = []
    for prefix, module in model.named_modules():
        for name, t in vars(module).items():
            if name in ("_parameters", "_buffers"):
                continue
            if isinstance(t, torch.Tensor):
                tensors.append((f"{prefix}.{name}", t))
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                tensors.append((f"{prefix}.{name}", t))
    described = [(name, tuple(t.shape), t.stride() if t.layout == torch.strided else None,
                  str(t.dtype), t.device.type) for name, t in tensors]
    return repr(model) + json.dumps(described)


def _settings() -> str:
    """Inductor's and dynamo's settings (less the ISA probe's shortcut, which we set)."""
    from torch._dynamo import config as dynamo_config
    from torch._inductor import config as inductor_config
    inductor = inductor_config.save_config_portable()
    inductor.pop("cpp.vec_isa_ok", None)
    return json.dumps([inductor, dynamo_config.save_config_portable()], sort_keys=True,
                      default=lambda o: sorted(map(repr, o)) if isinstance(o, (set, frozenset))
                      else repr(o))


def artifact_key(model: torch.nn.Module, spec: Any, tp_rank: int, tp_size: int,
                 device: torch.device) -> str:
    """The name of ``model``'s compiled artifact (see the module's docstring)."""
    h = hashlib.sha256()
    for part in (_module_fingerprint(model), repr(spec), f"tp {tp_rank}/{tp_size}",
                 _device_facts(device), _gemm_op_facts(model), sys.version,
                 torch.__version__, _settings(), _code_digest()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


# ---- inductor's instruction-set probe ---------------------------------------------------------
def _isa_record() -> Path | None:
    """This machine's probe record (x86-64 Linux only, where inductor probes by building)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    from torch._inductor.cpp_builder import get_cpp_compiler
    try:
        compiler = subprocess.run([get_cpp_compiler(), "--version"], capture_output=True,
                                  text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError, RuntimeError):
        return None
    h = hashlib.sha256("\0".join((cpu_features(), compiler, torch.__version__)).encode())
    try:
        return artifact_dir() / f"vec-isa-{h.hexdigest()[:16]}.json"
    except UnsafePath:  # refused (and said so) where the artifact is looked up
        return None


def _claimed_isas() -> list[str]:
    """The vector ISAs inductor knows that this CPU's flags list (before any build probe)."""
    from torch._inductor.cpu_vec_isa import supported_vec_isa_list, x86_isa_checker
    flags = x86_isa_checker()
    return [str(isa) for isa in supported_vec_isa_list
            if all(flag in flags for flag in str(isa).split())]


def skip_known_isa_probe() -> None:
    """When an earlier start on this CPU, compiler and torch found every ISA the CPU claims
    usable, tell inductor so (``cpp.vec_isa_ok``): the probe would find the same."""
    record = _isa_record()
    if record is None:
        return
    try:
        data = read_artifact(record)  # checked like an artifact, its use recorded
        ok = data is not None and json.loads(data) == _claimed_isas()
    except (OSError, ValueError):  # UnsafePath included: the probe runs
        ok = False
    if ok:
        from torch._inductor import config as inductor_config
        inductor_config.cpp.vec_isa_ok = True


def remember_isa_probe() -> None:
    """After inductor probed (a compile or a load did): record it if every claimed ISA
    passed (otherwise the probe keeps running, and keeps deciding)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    record = _isa_record()
    if record is None or record.is_file() or inductor_config.cpp.vec_isa_ok is not None:
        return
    claimed = _claimed_isas()
    if [str(isa) for isa in valid_vec_isa_list()] == claimed:
        write_artifact(record, json.dumps(claimed).encode())


_CORRUPT_SO = re.compile(r"(/\S+\.so): (?:file too short|invalid ELF header)")


def drop_corrupt_kernel(error: BaseException) -> Path | None:
    """Remove the truncated kernel library in inductor's cache that ``error`` (an import of
    it failed) names, and return its path; None when it names none there. A compile killed
    while inductor wrote a .so (an engine stopped mid-compile) leaves it short, and inductor
    loads it again on every later compile of that graph instead of rebuilding it."""
    root = inductor_cache_dir().resolve()
    seen: BaseException | None = error
    while seen is not None:
        for found in _CORRUPT_SO.finditer(str(seen)):
            path = Path(found.group(1)).resolve()
            if root in path.parents and path.is_file():
                path.unlink()
                return path
        seen = seen.__cause__ or seen.__context__
    return None
