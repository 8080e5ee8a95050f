"""The shm pipe (kv_transfer.pipe: shm) on a real P/D pair in one process: the decode engine's
cache lives in a 0600 file under /dev/shm, the producer copies each layer's blocks into the
granted ones. Exact against the colocated engine for full, sliding and latent layers; a
corrupted block, a producer that never writes, a write outside the grant all end in the exact
answer by recompute (fail closed), with every block released; the file goes with the engine,
and a producer refuses a file that is not private."""
from __future__ import annotations

import os
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from connectors.pipes.base import HandshakeError
from connectors.pipes.shm_arena import shm_folder
from pd_cluster import SamplingParams
from pd_cluster.checkpoints.maker import PRESETS, make_model
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from tests.conftest import random_prompt
from tests.pd_helpers import colocated_tokens, drain, kv_config, run_in_process, submit_pair

if not os.path.isdir("/dev/shm"):
    pytest.skip("no /dev/shm on this host", allow_module_level=True)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(model: str, role: str, timeout: float = 10.0, **args: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, block_size=8, kv_transfer={
        **kv_config(role, timeout), "pipe": "shm"}, **args))


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
    layers; prompts around block and chunk edges. The KV crosses as copies into the shared
    cache (the socket carries control messages only); the link shows as shm in the stats
    `pd-cluster status` and /metrics read; the file is gone once the consumer closed."""
    root = tmp_path_factory.mktemp("shm")
    model = (_mla_model(root) if family == "mla"
             else str(make_model(root / family, **PRESETS[family])))
    prompts = [random_prompt(n, seed=n) for n in (4, 15, 16, 33, 70)]
    with _pair(model) as (p, d):
        path = d.runner.connector.pipe._shared.path
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
        got = _run(p, d, prompts, "x")
        assert d.stats()["kv_fallbacks"] == 0
        sent, received = p.stats()["kv_bytes_sent"], d.stats()["kv_bytes_received"]
        assert sent == received > 0
        pipe_stats = p.runner.connector.pipe.stats()
        assert pipe_stats["shm_bytes_written"] == sent
        assert pipe_stats["sent"] < 10 * len(prompts) * d.runner.kv_spec.num_layers  # control
        assert set(p.stats()["kv_links"].values()) == {"shm"}
        assert p.stats()["kv_pipe"] == "shm"
    assert not path.exists()
    assert got == colocated_tokens(model, prompts, [GREEDY] * len(prompts), block_size=8)


@pytest.fixture(scope="module")
def tiny(tiny_model) -> tuple[str, dict[str, list[int]]]:
    model = tiny_model()
    prompts = {k: random_prompt(n, seed=7 * n) for k, n in
               (("flip", 37), ("mute", 41), ("stray", 29))}
    ref = colocated_tokens(model, list(prompts.values()), [GREEDY] * 3, block_size=8)
    return model, {k: (prompts[k], r) for k, r in zip(prompts, ref)}


def test_a_corrupted_block_fails_closed(tiny) -> None:
    """A byte of a written block changes after the copy, before the consumer checks the
    write's MAC: the request is recomputed (exact), the blocks are freed on both sides."""
    model, cases = tiny
    with _pair(model) as (p, d):
        pipe, flipped = p.runner.connector.pipe, []
        real = pipe._notify

        def notify(peer: str, header: dict) -> Future:
            if not flipped:  # the first write: flip a bit of its first block, layer 0
                rid = next(iter(d.runner.connector.receiver._active))
                block = d.runner.connector.receiver._active[rid].spec.block_ids[0]
                d.runner.connector.kv_caches[0][0, block].view(-1).view(torch.uint8)[3] ^= 1
                flipped.append(rid)
            return real(peer, header)
        pipe._notify = notify
        prompt, want = cases["flip"]
        assert _run(p, d, [prompt], "flip") == [want]
        assert flipped
        assert d.stats()["kv_fallbacks"] == 1
        assert d.runner.connector.stats()["kv_digest_failures"] == 1


def test_a_producer_that_never_writes_times_out_and_recomputes(tiny) -> None:
    """The producer says its writes completed but nothing reached the consumer: after the
    FIN the consumer waits a bounded grace, then recomputes; both sides release every block."""
    model, cases = tiny
    with _pair(model, timeout=2.0) as (p, d):
        def silent(*_args: Any) -> Future:
            f: Future = Future()
            f.set_result(None)
            return f
        p.runner.connector.pipe.write_blocks = silent
        prompt, want = cases["mute"]
        assert _run(p, d, [prompt], "mute") == [want]
        assert d.stats()["kv_fallbacks"] == 1


def test_a_write_outside_the_grant_is_refused(tiny) -> None:
    """A producer whose grant is shorter than its blocks does not write past it: the write is
    refused before it starts, the request is recomputed; block ids past the mapped cache are
    refused by the pipe itself."""
    model, cases = tiny
    with _pair(model) as (p, d):
        grants = p.runner.connector.grants
        real = grants.record
        grants.record = lambda ep, rid, first, ids, groups=(), layers=(): real(
            ep, rid, first, ids[:1], [g[:1] for g in groups], layers)  # each group's too
        prompt, want = cases["stray"]
        assert _run(p, d, [prompt], "stray") == [want]
        assert d.stats()["kv_fallbacks"] == 1
        one_block = sum(c[:, 0].nbytes for c in p.runner.connector.kv_caches)
        pipe = p.runner.connector.pipe
        assert pipe.stats()["shm_bytes_written"] == one_block
        past = pipe._remotes[d.kv_endpoint()].layout.layers[0].num_blocks
        with pytest.raises(ValueError, match="out of range"):
            pipe.write_blocks(d.kv_endpoint(), 0, p.runner.kv_caches[0], [0], [past], b"")


def test_a_file_others_may_read_is_refused(tiny) -> None:
    """The producer maps only a private file: one whose mode lets the group in is refused at
    the handshake, with the path in the reason."""
    model, _ = tiny
    with _pair(model) as (p, d):
        path = d.runner.connector.pipe._shared.path
        assert path.parent == shm_folder("/dev/shm")
        os.chmod(path, 0o640)
        with pytest.raises(HandshakeError, match="expected ours and 0600"):
            p.runner.connector.pipe.connect(d.kv_endpoint(), p.runner.connector.hello)
