"""The compiled step made in the background (engine.compile_mode: background, issue 39): the
engine serves eagerly from its first step, a child process compiles, and the engine switches
between two steps; requests running across the switch get the tokens of an all-eager and of an
all-compiled run (greedy). A compile that fails leaves the engine eager; a stop while it
compiles ends the compile (its process included) within a bound."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

import pytest

from pd_cluster.engine import background_compile
from pd_cluster.engine.compiled_model import CompiledModel
from pd_cluster.llm import LLM
from pd_cluster.sampling_params import SamplingParams
from tests.conftest import random_prompt

# one real compile (minutes on a shared 2-core machine), cold: a fresh compiled-code cache
pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("fresh_inductor_cache")]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
WAIT_S = 600.0  # bound on a compile (a cold one, on a loaded machine)


def background(model_dir: str) -> LLM:
    return LLM(model=model_dir, compile=True, compile_mode="background", block_size=8)


def compiled(llm: LLM) -> CompiledModel:
    model = llm.engine.runner.forward_model
    assert isinstance(model, CompiledModel)
    return model


def wait_for(condition: Any, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.05)


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_the_switch_is_exact_under_load(tiny_model, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pd_cluster.engine.compiled_model")
    model_dir = tiny_model(arch="llama", num_layers=1)
    prompts = [random_prompt(n, seed=n) for n in (5, 9, 14, 20)]
    eager = LLM(model=model_dir, compile=False, block_size=8)
    reference = tokens(eager.generate(prompts, GREEDY))
    eager.close()
    # Hold the compiled graph back until the requests are mid-decode, so they cross the switch.
    offered, release = threading.Event(), threading.Event()
    offer = CompiledModel.offer

    def held_offer(self: CompiledModel, fn: Any, seconds: float) -> None:
        offered.set()
        release.wait(WAIT_S)
        offer(self, fn, seconds)
    monkeypatch.setattr(CompiledModel, "offer", held_offer)
    llm = background(model_dir)
    engine, model = llm.engine, compiled(llm)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    outputs: dict[str, Any] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    for _ in range(4):  # prefills and first decodes, eager
        step()
    assert model.eager_steps >= 4 and not model.compiled_steps
    assert engine.stats()["compiled"] == 0 and engine.stats()["compile_state"] == "compiling"
    wait_for(offered.is_set, "the background compile")
    release.set()
    wait_for(lambda: model.ready, "the switch")
    assert not outputs  # every request is still running: each crosses the switch
    while engine.has_unfinished_requests():
        step()
    assert model.compiled_steps and engine.stats()["compiled"] == 1
    assert engine.stats()["compile_state"] == "compiled"
    assert "switched to the compiled step" in caplog.text
    assert tokens([outputs[f"r{i}"] for i in range(len(prompts))]) == reference
    steps = model.eager_steps
    assert tokens(llm.generate(prompts, GREEDY)) == reference  # all compiled
    assert model.eager_steps == steps
    engine.check_no_leaks()
    llm.close()


def test_a_failed_compile_leaves_the_engine_eager(
        tiny_model, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    model_dir = tiny_model(arch="llama", num_layers=2)  # no artifact of it on disk
    monkeypatch.setattr(background_compile, "child_command",
                        lambda *a: [sys.executable, "-c", "raise SystemExit(2)"])
    llm = background(model_dir)
    model = compiled(llm)
    wait_for(lambda: model.state == "failed", "the failed compile")
    assert "the background compile failed" in caplog.text
    prompts = [random_prompt(n, seed=n) for n in (4, 11)]
    assert all(len(t) == GREEDY.max_tokens for t in tokens(llm.generate(prompts, GREEDY)))
    assert model.eager_steps and not model.compiled_steps and not model.ready
    assert llm.engine.stats()["compiled"] == 0
    llm.engine.check_no_leaks()
    llm.close()


def test_a_stop_during_the_compile_ends_it(tiny_model, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    model_dir = tiny_model(arch="llama", num_layers=3)
    monkeypatch.setattr(background_compile, "child_command",  # a compile that never ends
                        lambda *a: [sys.executable, "-c", "import time; time.sleep(3600)"])
    llm = background(model_dir)
    job = compiled(llm)._background
    wait_for(lambda: job.proc is not None, "the compile process")
    llm.generate([random_prompt(6, seed=1)], GREEDY)  # served eagerly meanwhile
    llm.engine.check_no_leaks()
    llm.close()  # stop's bound: SIGTERM, SIGKILL, the thread joined
    assert not job.running
    assert job.proc.returncode is not None  # reaped: no orphan
    with pytest.raises(ProcessLookupError):
        os.kill(job.proc.pid, 0)
    assert compiled(llm).state == "compiling" and not compiled(llm).ready  # never switched


def test_the_kernel_build_switch_is_exact_under_load(tiny_model, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """attention_backend auto, C++ kernels not built yet: torch attention first, the C++ kernels
    from the step after their build; requests crossing the switch get the tokens of a run on
    the C++ kernels alone (and of one on torch attention alone)."""
    from kernels import cpu_build
    from pd_cluster.attention.cpu_backend import CpuAttentionBackend
    from pd_cluster.attention.torch_backend import TorchAttentionBackend
    caplog.set_level(logging.INFO, logger="pd_cluster.attention.background_kernels")
    model_dir = tiny_model(arch="llama", num_layers=2)
    prompts = [random_prompt(n, seed=n) for n in (5, 9, 14, 20)]
    runs = []
    for backend in ("cpu", "torch"):
        with LLM(model=model_dir, compile=False, block_size=8, attention_backend=backend) as one:
            runs.append(tokens(one.generate(prompts, GREEDY)))
    assert runs[0] == runs[1]
    # As on a fresh cache: the build runs in the background, held until requests are running.
    release = threading.Event()
    build = cpu_build.load_cpu_kernels
    monkeypatch.setattr(cpu_build, "kernels_ready", lambda: False)
    monkeypatch.setattr(cpu_build, "load_cpu_kernels", lambda: release.wait(WAIT_S) and build())
    llm = LLM(model=model_dir, compile=False, compile_mode="background", block_size=8)
    engine = llm.engine
    assert isinstance(engine.runner.backend, TorchAttentionBackend)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    outputs: dict[str, Any] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    for _ in range(4):  # prefills and first decodes on torch attention
        step()
    release.set()
    wait_for(lambda: engine.runner._kernels._next is not None, "the kernel build")
    assert not outputs  # every request crosses the switch
    while engine.has_unfinished_requests():
        step()
    assert isinstance(engine.runner.backend, CpuAttentionBackend)
    assert "switched to the C++ CPU attention kernels" in caplog.text
    assert tokens([outputs[f"r{i}"] for i in range(len(prompts))]) == runs[0]
    engine.check_no_leaks()
    llm.close()
