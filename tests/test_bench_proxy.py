"""scripts/bench_proxy.py --smoke runs the token path (two stream intervals) against the null
engine and prints its figures last; the null engine keeps LLMEngine's request interface (the benchmark crashed
when that interface grew and the fake did not)."""
from __future__ import annotations

import inspect
import re

import pytest

from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.serving.engine.null_engine import NullEngine
from tests.script_runs import ScriptRuns


def test_null_engine_takes_what_llm_engine_takes() -> None:
    for name in ("add_request", "abort_request", "step", "has_unfinished_requests"):
        real = list(inspect.signature(getattr(LLMEngine, name)).parameters.values())
        fake = list(inspect.signature(getattr(NullEngine, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in fake] == \
            [(p.name, p.kind, p.default) for p in real], name


@pytest.mark.timeout(400)  # its run's own bound: 300 s
@pytest.mark.script_run("bench_proxy.py", ["scripts/bench_proxy.py", "--smoke"], timeout=300)
def test_bench_proxy_smoke_measures_the_token_path(script_runs: ScriptRuns,
                                                   request: pytest.FixtureRequest) -> None:
    run = script_runs.result(request.node)  # two at a time with the other benchmarks' smokes
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    out = run.stdout[-3000:]
    for path in ("stream", "stream/4"):  # a row per path and level, paced and unpaced
        assert sum(bool(re.match(rf"\s*{path}\s+[14]\s+\d+", ln)) for ln in lines) == 4, out

    def figure(pattern: str) -> float:
        found = [m for ln in lines if (m := re.fullmatch(pattern, ln))]
        assert len(found) == 1, f"{pattern!r} once in:\n{out}"
        return float(found[0].group(1))
    assert figure(r"stream_tokens_per_s_ratio_stream_4_over_stream=(\d+\.\d\d)") > 0
    assert figure(r"proxy_overhead_ms_p50=(\d+\.\d\d) .*") > 0
    assert figure(r"stream_tokens_per_s_over_published=(\d+\.\d\d)") > 0
