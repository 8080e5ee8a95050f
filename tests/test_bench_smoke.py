"""Every benchmark still runs: each scripts/bench_*.py with ``--smoke`` (a tiny load, a few
seconds), as a user runs it, so an interface change cannot break one unnoticed. The figures are
meaningless here; only that the script runs to its last line. The runs go two at a time, beside
test_bench_goodput/proxy/vs_vllm's (tests/script_runs.py).

bench_serving.py --smoke runs in tests/test_gpu_check_cpu.py (against the launched cluster);
bench_proxy.py and bench_offline.py have their own tests.
"""
from __future__ import annotations

import pytest

from pd_cluster.serving.cluster.testing import REPO_ROOT
from tests.script_runs import ScriptRuns

pytestmark = pytest.mark.timeout(600)  # each benchmark script runs as a subprocess

SMOKES = [  # (script, the start of its last line)
    ("bench_kernels.py", "decode_attention_bw_fraction="),  # CPU: the Triton interpreter
    ("bench_pipe.py", "8Mi "),
    ("bench_kv_transfer.py", "kv_transfer_efficiency="),
    ("bench_multiturn.py", "ttft_p50_speedup="),  # 1P1D twice: baseline and prefix-aware
    ("bench_attention.py", "cpu_attention_offline_ratio_vs_torch="),  # both CPU backends
    ("bench_linear.py", "linear_gemm_fraction_eager="),  # eager and compiled, tiny model
    ("bench_linear_kernels.py", "linear_kernels_speedup_vs_torch"),  # CPU GEMM kernels
    ("bench_grammar_backends.py", "vocab"),  # xgrammar vs llguidance vs outlines-core
    ("bench_structured.py", "batch="),  # TPOT with and without a JSON schema
    ("bench_offload.py", "cached_share_host="),  # colocated: off, host, host+disk KV tiers
    ("bench_planner.py", "planner_goodput_vs_best_fixed="),  # simulator only, 8 slots
    ("bench_spec_decode.py", "spec_speedup_grounded_b1="),  # ngram, draft_model; offline, 1P1D
    ("bench_kv_bytes.py", "gpt_oss_ship_ratio_"),  # window shipping and FP8 KV, tiny P/D pair
]


@pytest.mark.parametrize("script, last_line", [  # two at a time (tests/script_runs.py)
    pytest.param(script, last, marks=pytest.mark.script_run(script, [f"scripts/{script}",
                                                                     "--smoke"]))
    for script, last in SMOKES])
def test_bench_smoke(script: str, last_line: str, script_runs: ScriptRuns,
                     request: pytest.FixtureRequest) -> None:
    run = script_runs.result(request.node)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert run.stdout.strip().splitlines()[-1].lstrip().startswith(last_line), out
    if script == "bench_kv_transfer.py":  # every pipe's part ran (issue 42)
        assert "shm_efficiency=" in run.stdout, out
        assert "shm_efficiency_churned_grant=" in run.stdout, out
        assert "shm_ceiling_with_mac=" in run.stdout or "no ceiling" in run.stdout, out
        assert "nixl_efficiency=" in run.stdout or "nixl rows skipped" in run.stdout, out


def test_every_benchmark_has_a_smoke_test() -> None:
    """A new scripts/bench_*.py needs a --smoke run in some test (named in that test file)."""
    tests = {p.name: p.read_text() for p in (REPO_ROOT / "tests").glob("test_*.py")}
    missing = [b.name for b in sorted((REPO_ROOT / "scripts").glob("bench_*.py"))
               if not any(b.name in text and "--smoke" in text for text in tests.values())]
    assert not missing, f"benchmarks without a --smoke test: {missing}"
