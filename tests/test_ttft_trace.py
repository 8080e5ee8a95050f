"""PD_TTFT_TRACE: events written per process and read back into per-phase times."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import ttft_phases  # noqa: E402


def test_mark_writes_only_when_switched_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pd_cluster import ttft_trace
    monkeypatch.delenv("PD_TTFT_TRACE", raising=False)
    off = importlib.reload(ttft_trace)
    off.mark("r0", "add")
    assert not off.enabled() and not list(tmp_path.iterdir())
    monkeypatch.setenv("PD_TTFT_TRACE", str(tmp_path))
    on = importlib.reload(ttft_trace)
    try:
        on.mark("r1", "add", side="W")
        on.mark("r1", "tok1")
        lines = [json.loads(x) for f in tmp_path.glob("*.jsonl")
                 for x in f.read_text().splitlines()]
        assert [(e["rid"], e["ev"]) for e in lines] == [("r1", "add"), ("r1", "tok1")]
        assert lines[0]["side"] == "W" and lines[1]["t"] >= lines[0]["t"]
    finally:
        monkeypatch.delenv("PD_TTFT_TRACE")
        importlib.reload(ttft_trace)


def test_phases_of_a_local_request(capsys: pytest.CaptureFixture[str]) -> None:
    assert ttft_phases.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "local: 1 requests" in out
    assert "prefill steps      p50      7.0" in out  # chunk at 3 ms, token 1 at 10 ms
    assert "delivered-estimate mean +1.0 ms" in out  # 11 ms delivered, 10 ms estimated
