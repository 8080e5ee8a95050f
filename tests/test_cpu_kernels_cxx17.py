"""The CPU kernels compile as C++17: torch 2.11 (our floor) builds extensions with -std=c++17,
torch 2.13 with -std=c++20, so a C++20-only construct passes CI and breaks users on 2.11 (found on
a GPU machine with torch 2.11: std::bit_cast in attention_common.h)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension

SOURCES = sorted((Path(__file__).resolve().parents[1] / "kernels" / "cpu").glob("*.cpp"))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_kernel_source_is_valid_cxx17(source: Path) -> None:
    import sysconfig

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    includes.append(f"-I{sysconfig.get_paths()['include']}")
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-fopenmp", "-march=native",
           "-DTORCH_EXTENSION_NAME=cxx17_check", *includes, str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
