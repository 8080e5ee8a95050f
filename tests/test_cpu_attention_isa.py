"""The kernel's other instruction-set paths, which ``-march=native`` on this machine never
builds: ``PD_CLUSTER_CPU_ISA=portable`` (no AVX-512: the portable path) and ``avx512`` (AVX-512
without BF16: the bf16 dot products' fallback). Each runs the kernel test modules
(tests/test_cpu_attention.py, every case against the torch reference, and the 1- and 4-thread
cases of tests/test_cpu_attention_threads.py, and the GHASH kernel's tags against OpenSSL's,
tests/test_ghash_copy.py) in a subprocess with the variable set: one
process loads one kernel library. Each variant has its own cached build
(cold: ~25 s of build on a loaded 2-core machine, then ~8 s of tests). The variants' runs
are independent processes (each its own build folder and lock), so they run side by side: the
tests' torch runs on one thread, the second core would idle otherwise."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernels import cpu_build

pytestmark = pytest.mark.skipif(cpu_build.disabled_by_env(), reason="PD_CLUSTER_CPU_KERNELS=0")

ROOT = Path(__file__).resolve().parent.parent


ISA_VARIANTS = ["portable", "avx512"]


def _runnable(isa: str) -> bool:
    return isa != "avx512" or cpu_build.cpu_has_avx512()


@pytest.fixture(scope="module")
def isa_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Any, Path]]]:
    """Every runnable variant's kernel tests, started at once: isa -> (process, output path
    stem: .out, .err). Output goes to files (pipes left unread could fill and stall a child)."""
    out_dir = tmp_path_factory.mktemp("isa")
    runs: dict[str, tuple[Any, Path]] = {}
    try:
        for isa in filter(_runnable, ISA_VARIANTS):
            out = out_dir / isa
            with open(f"{out}.out", "w") as stdout, open(f"{out}.err", "w") as stderr:
                runs[isa] = (subprocess.Popen(  # the child keeps its own descriptors
                    [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                     str(ROOT / "tests" / "test_cpu_attention.py"),
                     str(ROOT / "tests" / "test_cpu_attention_threads.py"),
                     str(ROOT / "tests" / "test_ghash_copy.py")],
                    cwd=ROOT, env={**os.environ, cpu_build.ISA_ENV: isa}, stdout=stdout,
                    stderr=stderr, text=True), out)
        yield runs
    finally:
        for proc, _ in runs.values():  # a test that failed early leaves nothing running
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.mark.timeout(600)  # both variants' runs start in the first test's set-up
@pytest.mark.parametrize("isa", ISA_VARIANTS)
def test_kernel_tests_pass_on_isa(isa: str, isa_runs: dict[str, tuple[Any, Path]]) -> None:
    if not _runnable(isa):
        pytest.skip("this CPU lacks AVX-512 (avx512f): the avx512 build cannot run here")
    proc, out = isa_runs[isa]
    proc.wait(timeout=540)
    stdout, stderr = Path(f"{out}.out").read_text(), Path(f"{out}.err").read_text()
    assert proc.returncode == 0, f"{cpu_build.ISA_ENV}={isa}:\n{stdout[-6000:]}{stderr[-3000:]}"
    assert " passed" in stdout and "skipped" not in stdout, stdout[-2000:]


def test_unknown_isa_is_an_error_naming_the_variable(monkeypatch) -> None:
    monkeypatch.setenv(cpu_build.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="PD_CLUSTER_CPU_ISA='avx9000'.*native, avx512, portable"):
        cpu_build.isa()
    monkeypatch.setattr(cpu_build, "_state", {})
    with pytest.raises(ValueError, match="PD_CLUSTER_CPU_ISA"):
        cpu_build.load_cpu_kernels()  # the user's typo: raised, never a silent fallback


def test_each_isa_has_its_own_build() -> None:
    isas = ["native", "portable"] + (["avx512"] if cpu_build.cpu_has_avx512() else [])
    names = {cpu_build.build_name(i) for i in isas}
    assert len(names) == len(isas)
    assert cpu_build.build_name() == cpu_build.build_name("native")  # the default
    assert "-march=native" in cpu_build.cflags("native")
    assert not any("avx512" in f and "no-" not in f for f in cpu_build.cflags("portable"))


def test_avx512_on_a_cpu_without_it_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(cpu_build, "cpu_has_avx512", lambda: False)
    with pytest.raises(RuntimeError, match="PD_CLUSTER_CPU_ISA=avx512 needs .* AVX-512"):
        cpu_build.cflags("avx512")
