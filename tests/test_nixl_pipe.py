"""The nixl pipe (kv_transfer.pipe: nixl) on a real P/D pair in one process, over NIXL's UCX
backend on CPU memory: the producer writes each layer's blocks into the consumer's granted
blocks. Exact against the colocated engine for full, sliding and latent layers; a corrupted
block, a producer that never writes, a write outside the grant all end in the exact answer by
recompute (fail closed), with every block released. Skipped, with the reason, where NIXL is
not installed (pip install torch==2.13.0 ".[nixl]")."""
from __future__ import annotations

from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from connectors.pipes.base import PipeError
from connectors.pipes.nixl_pipe import load_nixl
from connectors.pipes.nixl_worker import Write
from pd_cluster import SamplingParams
from pd_cluster.checkpoints.maker import PRESETS, make_model
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from tests.conftest import random_prompt
from tests.pd_helpers import colocated_tokens, drain, kv_config, run_in_process, submit_pair

try:
    load_nixl()
except PipeError as e:
    pytest.skip(str(e), allow_module_level=True)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(model: str, role: str, timeout: float = 10.0, **args: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, block_size=8, kv_transfer={
        **kv_config(role, timeout), "pipe": "nixl"}, **args))


@contextmanager
def _pair(model: str, timeout: float = 10.0, chunk: int = 12
          ) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    d = _engine(model, "consumer", timeout)
    p = _engine(model, "producer", timeout, max_num_batched_tokens=chunk)
    try:
        yield p, d
    finally:
        p.close(), d.close()


def _run(p: LLMEngine, d: LLMEngine, prompts: list[list[int]], tag: str) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        submit_pair(p, d, f"{tag}{i}", prompt, GREEDY, d.kv_endpoint())
    got = run_in_process(p, d, timeout=40.0)
    drain(p, d)
    p.check_no_leaks(), d.check_no_leaks()
    return [got[f"{tag}{i}"] for i in range(len(prompts))]


def _mla_model(root: Any) -> str:
    from tests.test_mla import _MLA, _SIZES, VARIANTS
    return str(make_model(root / "mla", **_SIZES,
                          config_overrides={**_MLA, **VARIANTS["qproj-halfrot"]}))


@pytest.mark.parametrize("family", ["tiny-qwen3", "tiny-gemma3", "mla"])
def test_written_kv_is_exact(tmp_path_factory, family: str) -> None:
    """Full (qwen3), sliding + global (gemma3) and latent (DeepSeek MLA: one part per block)
    layers; prompts around block and chunk edges (a chunk ending mid-block leaves that block
    to the next write)."""
    root = tmp_path_factory.mktemp("nixl")
    model = (_mla_model(root) if family == "mla"
             else str(make_model(root / family, **PRESETS[family])))
    prompts = [random_prompt(n, seed=n) for n in (4, 15, 16, 33, 70)]
    with _pair(model) as (p, d):
        got = _run(p, d, prompts, "x")
        assert d.stats()["kv_fallbacks"] == 0
        sent, received = p.stats()["kv_bytes_sent"], d.stats()["kv_bytes_received"]
        assert sent == received > 0
        pipe_stats = p.runner.connector.pipe.stats()
        assert pipe_stats["nixl_bytes_written"] == sent
        # each descriptor one block of a part or more (runs coalesced: test_nixl_coalesce)
        assert 0 < pipe_stats["nixl_descriptors"] <= sent // min(
            c[0, 0].nbytes for c in p.runner.connector.kv_caches)
        assert d.runner.connector.pipe.stats()["received"] > 0  # control messages only
    assert got == colocated_tokens(model, prompts, [GREEDY] * len(prompts), block_size=8)


@pytest.fixture(scope="module")
def tiny(tiny_model) -> tuple[str, dict[str, list[int]]]:
    model = tiny_model()
    prompts = {k: random_prompt(n, seed=7 * n) for k, n in
               (("flip", 37), ("mute", 41), ("stray", 29))}
    ref = colocated_tokens(model, list(prompts.values()), [GREEDY] * 3, block_size=8)
    return model, {k: (prompts[k], r) for k, r in zip(prompts, ref)}


def test_a_corrupted_block_fails_closed(tiny) -> None:
    """A byte of a written block changes before the consumer checks the write's MAC: the
    request is recomputed (exact), the blocks are freed on both sides."""
    model, cases = tiny
    with _pair(model) as (p, d):
        worker, flipped = d.runner.connector.pipe._worker, []
        real = worker._on_notif

        def deliver(agent: str, msg: bytes) -> None:
            if not flipped:  # the first write: flip a bit of its first block, layer 0
                rid = next(iter(d.runner.connector.receiver._active))
                block = d.runner.connector.receiver._active[rid].spec.block_ids[0]
                d.runner.connector.kv_caches[0][0, block].view(-1).view(torch.uint8)[3] ^= 1
                flipped.append(rid)
            real(agent, msg)
        worker._on_notif = deliver
        prompt, want = cases["flip"]
        assert _run(p, d, [prompt], "flip") == [want]
        assert flipped
        assert d.stats()["kv_fallbacks"] == 1
        assert d.runner.connector.stats()["kv_digest_failures"] == 1


def test_a_producer_that_never_writes_times_out_and_recomputes(tiny) -> None:
    """The producer says its writes completed but nothing reached the consumer (no data, no
    notification): after the FIN the consumer waits a bounded grace, then recomputes; both
    sides release every block."""
    model, cases = tiny
    with _pair(model, timeout=2.0) as (p, d):
        pipe = p.runner.connector.pipe

        def silent(*_args: Any) -> Future:
            f: Future = Future()
            f.set_result(None)
            return f
        pipe.write_blocks = silent
        prompt, want = cases["mute"]
        assert _run(p, d, [prompt], "mute") == [want]
        assert d.stats()["kv_fallbacks"] == 1


def test_a_write_outside_the_grant_is_refused(tiny) -> None:
    """A producer whose grant is shorter than its blocks (a consumer that granted less) does
    not write past it: the write is refused before it leaves, the request is recomputed."""
    model, cases = tiny
    with _pair(model) as (p, d):
        grants = p.runner.connector.grants
        real = grants.record
        grants.record = lambda ep, rid, first, ids, groups=(), layers=(): real(
            ep, rid, first, ids[:1], [g[:1] for g in groups], layers)  # each group's too
        prompt, want = cases["stray"]
        assert _run(p, d, [prompt], "stray") == [want]
        assert d.stats()["kv_fallbacks"] == 1
        # the first chunk's whole block (inside the grant) went; nothing after it
        one_block = sum(c[:, 0].nbytes for c in p.runner.connector.kv_caches)
        assert p.runner.connector.pipe.stats()["nixl_bytes_written"] == one_block


def test_nixl_refuses_addresses_outside_the_registered_cache(tiny) -> None:
    """The consumer exposes its KV cache only: a descriptor past it is refused by NIXL
    itself, and block ids past the cache by the layout before NIXL sees them."""
    model, cases = tiny
    with _pair(model) as (p, d):
        p.connect_kv_peer(d.kv_endpoint())
        pipe = p.runner.connector.pipe
        endpoint = d.kv_endpoint()
        remote = pipe._remotes[endpoint]
        with pytest.raises(ValueError, match="out of range"):
            remote.layout.descs(0, [remote.layout.layers[0].num_blocks])
        past = remote.layout.descs(0, [0]).copy()
        past[:, 0] += remote.layout.layers[-1].addr + 10 ** 9  # beyond every layer
        future = pipe._worker.submit(Write(remote.agent, pipe._layout.descs(0, [0]), past,
                                           "DRAM", "DRAM", lambda: [], b"", remote.key,
                                           Future()))
        with pytest.raises(PipeError, match="not posted"):
            future.result(timeout=10)
