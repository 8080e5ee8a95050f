"""scripts/bench_moe.py --smoke: runs, times every path on this device, and its outputs agree
with HF's MoE block (exit 1 otherwise)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_moe_smoke() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_moe.py"), "--smoke"],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    batches = [line for line in lines if line.startswith("batch")]
    assert len(batches) == 2 and all("hf_eager" in b and "ours_torch" in b for b in batches)
    assert "max relative difference from hf" in lines[-1] and lines[-1].endswith("(ok)")
