"""Every process of a CPU test runs on the CPU, even where device "auto" would pick CUDA.

The resolution is code, not hardware: here torch reports two CUDA devices in the test process
and, through a ``sitecustomize`` hook on PYTHONPATH, in every Python process it starts (a
tensor-parallel worker, an engine subprocess). The hook also logs each process's resolved
device. A process that resolved CUDA would log it (and fail: there is no GPU to run on).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pd_cluster.config import DEVICE_ENV, EngineConfig
from pd_cluster.engine.engine_process import EngineProcess
from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

_HOOK = '''
import os
if os.environ.get("FAKE_CUDA_LOG"):
    import torch
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 2
    from pd_cluster.config import EngineConfig
    _resolve = EngineConfig.torch_device.fget

    def _logged(self):
        device = _resolve(self)
        with open(os.environ["FAKE_CUDA_LOG"], "a") as log:
            log.write(f"{os.getpid()} {self.device} {device}\\n")
        return device
    EngineConfig.torch_device = property(_logged)
'''


@pytest.fixture
def fake_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """CUDA "available" here and in every child process; returns the children's device log."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_HOOK)
    log = tmp_path / "devices.log"
    log.touch()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.setenv("FAKE_CUDA_LOG", str(log))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    return log


def _child_devices(log: Path) -> dict[int, set[str]]:
    """pid -> the devices that process resolved (each line: pid, configured, resolved)."""
    seen: dict[int, set[str]] = {}
    for line in log.read_text().splitlines():
        pid, _configured, resolved = line.split()
        seen.setdefault(int(pid), set()).add(resolved)
    return seen


def test_auto_would_pick_cuda_here_but_the_test_device_wins(fake_cuda, monkeypatch) -> None:
    config = EngineConfig(model="m")
    assert config.torch_device == torch.device("cpu")
    assert config.torch_dtype == torch.float32
    monkeypatch.delenv(DEVICE_ENV)  # the simulation is real: without the override, CUDA
    assert config.torch_device == torch.device("cuda")
    assert config.torch_dtype == torch.bfloat16
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(ValueError, match=DEVICE_ENV):
        config.torch_device  # noqa: B018


def test_tensor_parallel_worker_runs_on_the_test_device(tiny_model, fake_cuda) -> None:
    model_dir = tiny_model()
    llm = LLM(model=model_dir, tensor_parallel_size=2, num_kv_blocks=32, collective_timeout=20.0)
    try:
        assert llm.engine.runner.device == torch.device("cpu")
        prompt = random_prompt(9, seed=1)
        out = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
        assert_greedy_matches(model_dir, prompt, out, hf_greedy(model_dir, prompt, 6))
        llm.engine.check_no_leaks()
        worker = llm.engine.executor.workers.procs[0].pid
    finally:
        llm.close()
    assert _child_devices(fake_cuda).get(worker) == {"cpu"}  # the hook ran there: cpu


def test_engine_subprocess_runs_on_the_test_device(tiny_model, fake_cuda) -> None:
    model_dir = tiny_model()
    proc = EngineProcess(EngineConfig(model=model_dir, num_kv_blocks=32))
    try:
        proc.wait_ready()
        prompt = random_prompt(9, seed=2)
        proc.add_request("r", prompt, GREEDY)
        got = proc.wait_finished(["r"], timeout=120)["r"]["token_ids"]
        assert_greedy_matches(model_dir, prompt, got, hf_greedy(model_dir, prompt, 6))
        proc.call("check_no_leaks")  # raises on a held block or request
        child = proc.proc.pid
    finally:
        proc.shutdown()
    assert _child_devices(fake_cuda).get(child) == {"cpu"}


@pytest.mark.cuda  # runs without a GPU: it checks only what "auto" resolves to in such a test
def test_auto_means_cuda_in_a_test_marked_for_gpus() -> None:
    assert os.environ[DEVICE_ENV] == "cuda"  # inherited by every process the test starts
    assert EngineConfig(model="m").torch_device == torch.device("cuda")
