"""The wheel holds every file the installed package reads: each source, kernel source and
header (kernels/cpu/*.cpp, *.h: the C++ kernels are built from them on first use), and the
built-in model's assets. Built as a user builds it (``pip wheel``), from a copy of the
checkout's tracked files (a stale ``build/`` folder here cannot hide a missing one).
.ci/run installs the wheel in a fresh venv and runs scripts/wheel_smoke.py against it."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pd_cluster", "connectors", "kernels")
BUILD_FILES = ("pyproject.toml", "README.md")


def shipped_files() -> list[str]:
    """The checkout's files under the packages (tracked ones when this is a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "--", *PACKAGES], cwd=REPO, check=True,
                             capture_output=True, text=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = [str(p.relative_to(REPO)) for pkg in PACKAGES for p in (REPO / pkg).rglob("*")
               if p.is_file() and "__pycache__" not in p.parts]
    return sorted(out)


@pytest.mark.timeout(300)
def test_the_wheel_ships_every_package_file_and_kernel_header(tmp_path: Path) -> None:
    files = shipped_files()
    headers = [f for f in files if f.startswith("kernels/cpu/") and f.endswith(".h")]
    assert headers and any(f.endswith(".cpp") for f in files)
    src = tmp_path / "src"
    for name in [*files, *BUILD_FILES]:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                          str(tmp_path / "dist"), str(src)], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    wheel, = (tmp_path / "dist").glob("pd_cluster-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert [f for f in files if f not in names] == []
