"""The kernel's other instruction-set paths, which ``-march=native`` on this machine never
builds: ``PD_CLUSTER_CPU_ISA=portable`` (no AVX-512: the portable path) and ``avx512`` (AVX-512
without BF16: the bf16 dot products' fallback). Each runs the kernel test modules
(tests/test_cpu_attention.py, every case against the torch reference, and the 1- and 4-thread
cases of tests/test_cpu_attention_threads.py) in a subprocess with the variable set: one
process loads one kernel library. Each variant has its own cached build
(cold: ~25 s of build on a loaded 2-core machine, then ~8 s of tests)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_build

pytestmark = pytest.mark.skipif(cpu_build.disabled_by_env(), reason="PD_CLUSTER_CPU_KERNELS=0")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
@pytest.mark.parametrize("isa", ["portable", "avx512"])
def test_kernel_tests_pass_on_isa(isa: str) -> None:
    if isa == "avx512" and not cpu_build.cpu_has_avx512():
        pytest.skip("this CPU lacks AVX-512 (avx512f): the avx512 build cannot run here")
    env = {**os.environ, cpu_build.ISA_ENV: isa}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
         str(ROOT / "tests" / "test_cpu_attention.py"),
         str(ROOT / "tests" / "test_cpu_attention_threads.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, f"{cpu_build.ISA_ENV}={isa}:\n{run.stdout[-6000:]}{run.stderr[-3000:]}"
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]


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
