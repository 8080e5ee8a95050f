"""`pd-cluster profile`: measure the cost table on this machine with in-process engines (a
producer and a consumer linked by the KV pipe the config names), one grid cell after another.

Prefill: one prompt per length on P, timed over P's steps; its KV bytes from P's
``kv_bytes_sent``; the transfer tail (P's prefill done -> D's first output) per length.
Decode: for each context length, one prompt of that length is prefilled once; then ``batch``
requests sharing it as a cached prefix (each one distinct last token, so only that token is
prefilled) decode together and the median of a few steps is the step time. Shared prefix
blocks are read by every request as distinct ones would be, so the step cost is that of
``batch`` distinct contexts without the prefill time or KV memory they would take."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from connectors import secret
from connectors.transfer_params import RecvKV, SendKV
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.planner.profile_table import (DecodePoint, PrefillPoint, Profile, ProfileKey,
                                             TransferPoint)
from pd_cluster.sampling_params import SamplingParams

_STEP_BOUND_S = 120.0  # any one measurement: a stuck pipe is an error, not a hang


@dataclass
class ProfileGrid:
    """Where to measure. ``tiny()``: the test grid (seconds on the built-in model)."""
    prompt_lengths: list[int] = field(default_factory=lambda: [128, 256, 512, 1024, 2048])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16, 32])
    context_lengths: list[int] = field(default_factory=lambda: [128, 512, 2048])
    decode_steps: int = 6  # steps timed per decode cell (median taken)

    @classmethod
    def tiny(cls) -> "ProfileGrid":
        return cls([16, 48], [1, 3], [16, 48], decode_steps=3)

    def check(self, max_model_len: int) -> None:
        for name in ("prompt_lengths", "batch_sizes", "context_lengths"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name}: expected positive integers, got {values}")
        longest = max(max(self.prompt_lengths), max(self.context_lengths) + self.decode_steps + 2)
        if longest > max_model_len:
            raise ValueError(f"grid: {longest} tokens exceed the model's context "
                             f"({max_model_len}); use shorter lengths")


@dataclass
class ProfileSetup:
    """The engines to measure: model path and engine arguments per role (from the config)."""
    model: str
    model_name: str
    engine_args: dict[str, Any]
    kv_transfer: dict[str, Any]
    prefill_threads: int = 1
    decode_threads: int = 1
    tensor_parallel_size: int = 1


def _engine(setup: ProfileSetup, role: str) -> LLMEngine:
    kv = {**setup.kv_transfer, "role": role}
    args = dict(setup.engine_args)
    if setup.tensor_parallel_size > 1:
        args["tensor_parallel_size"] = setup.tensor_parallel_size
    return LLMEngine(EngineConfig(model=setup.model, kv_transfer=kv, **args))


def _prompt(n: int, salt: int, vocab: int) -> list[int]:
    """Deterministic token ids away from the special ones (no EOS surprises: ignore_eos)."""
    return [4 + (salt * 7919 + j * 31) % (vocab - 4) for j in range(n)]


def _device_name(engine: LLMEngine, threads: int) -> str:
    dev = engine.runner.device
    if getattr(dev, "type", str(dev)) == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu x{threads}"


def _run_until(engines: list[LLMEngine], done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + _STEP_BOUND_S
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError("profile: an engine did not finish a grid cell in "
                               f"{_STEP_BOUND_S:.0f} s")
        for e in engines:
            e.step()


def measure_prefill(p: LLMEngine, d: LLMEngine, n: int, salt: int
                    ) -> tuple[PrefillPoint, TransferPoint]:
    """One prompt of n tokens through P (timed) then D (the transfer tail)."""
    endpoint = d.kv_endpoint()
    if not p.kv_peers():
        p.connect_kv_peer(endpoint)
    rid = f"profile-prefill-{n}-{salt}"
    prompt = _prompt(n, salt, p.vocab_size)
    sent0 = p.stats().get("kv_bytes_sent", 0)
    d.add_request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True), RecvKV())
    _run_until([d], lambda: rid in d.scheduler.remote_waiting)  # its receive posted first
    p.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                  SendKV(to=endpoint))
    p_busy = 0.0  # P's own step time until its output: D's idle steps do not count
    p_done = d_first = 0.0
    deadline = time.monotonic() + _STEP_BOUND_S
    while not d_first:
        if time.monotonic() > deadline:
            raise RuntimeError(f"profile: a {n}-token prompt did not reach D in time")
        t0 = time.perf_counter()
        outs = p.step()  # also after its output: P's next steps finish the send
        if not p_done:
            p_busy += time.perf_counter() - t0
            if any(o.finished for o in outs):
                p_done = time.perf_counter()
        if d.step() and p_done:
            d_first = time.perf_counter()
    _run_until([p, d], lambda: not (p.has_unfinished_requests() or d.has_unfinished_requests()))
    kv = p.stats().get("kv_bytes_sent", 0) - sent0
    return (PrefillPoint(tokens=n, seconds=p_busy, kv_bytes=int(kv)),
            TransferPoint(kv_bytes=int(kv), seconds=d_first - p_done))


def measure_decode(d: LLMEngine, batch: int, context: int, steps: int, salt: int) -> DecodePoint:
    """Median step time of ``batch`` requests of ``context`` tokens decoding together."""
    base = _prompt(context - 1, salt, d.vocab_size)
    warm = f"profile-warm-{context}-{salt}"
    d.add_request(warm, base + [5], SamplingParams(max_tokens=1, ignore_eos=True))
    _run_until([d], lambda: not d.has_unfinished_requests())
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    ids = [f"profile-dec-{batch}-{context}-{salt}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        d.add_request(rid, base + [6 + i % (d.vocab_size - 6)], params)
    started: set[str] = set()
    deadline = time.monotonic() + _STEP_BOUND_S
    while len(started) < batch:  # every request past its (one-token) prefill
        if time.monotonic() > deadline:
            raise RuntimeError("profile: decode batch did not start in time")
        started.update(o.request_id for o in d.step())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        d.step()
        times.append(time.perf_counter() - t0)
    _run_until([d], lambda: not d.has_unfinished_requests())
    return DecodePoint(batch=batch, context=context, seconds=statistics.median(times))


def run_profile(setup: ProfileSetup, grid: ProfileGrid,
                progress: Callable[[str], None] | None = None) -> Profile:
    """Measure every cell of ``grid``; ``progress(label)`` after each (a tqdm bar's update)."""
    tick = progress or (lambda label: None)
    if not secret.has_secret():  # both engines are ours: a fresh secret, as a launch makes
        secret.install(secret.new_secret())
    d = _engine(setup, "consumer")
    p = _engine(setup, "producer")
    try:
        grid.check(min(p.max_model_len, d.max_model_len))
        torch.set_num_threads(setup.prefill_threads)
        first = grid.prompt_lengths[0]
        measure_prefill(p, d, first, salt=10_000)  # warm-up: first-call costs, the handshake
        tick("warm-up")
        prefills, transfers = [], []
        for i, n in enumerate(grid.prompt_lengths):
            pp, tp = measure_prefill(p, d, n, salt=i)
            prefills.append(pp)
            transfers.append(tp)
            tick(f"prefill {n}")
        torch.set_num_threads(setup.decode_threads)
        decodes = []
        for j, ctx in enumerate(grid.context_lengths):
            for b in grid.batch_sizes:
                decodes.append(measure_decode(d, b, ctx, grid.decode_steps, salt=100 + j))
                tick(f"decode b={b} ctx={ctx}")
        p.check_no_leaks()
        d.check_no_leaks()
        cfg = d.config
        kv = setup.kv_transfer
        # the pipe the link took (auto: shm on one host, else zmq), as measured
        taken = ",".join(sorted(set((p.stats().get("kv_links") or {}).values())))
        key = ProfileKey(model=setup.model_name, dtype=str(d.runner.dtype).replace("torch.", ""),
                         tensor_parallel_size=setup.tensor_parallel_size,
                         device=_device_name(d, setup.decode_threads),
                         pipe=f"{taken or kv.get('pipe')}/{kv.get('transport', 'tcp')}")
        return Profile(key=key, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                       max_num_batched_tokens=cfg.max_num_batched_tokens, prefill=prefills,
                       decode=decodes, transfer=transfers)
    finally:
        p.close()
        d.close()


def grid_cells(grid: ProfileGrid) -> int:
    return 1 + len(grid.prompt_lengths) + len(grid.batch_sizes) * len(grid.context_lengths)
