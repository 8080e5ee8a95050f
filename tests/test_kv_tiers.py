"""The host KV tier in whole engines (tiny checkpoints, small device pools that evict): a
conversation's history evicted from the device comes back from the host tier (counted as
cached tokens and host hits) and the output stays token-exact with HF (greedy fp32) -- whole
prompts, chunked prefill, tensor parallel (Gloo), and a P/D pair where the decode engine
restores the history from its own tier and asks the producer only for the rest while the
producer restores rather than recomputes. Every engine ends with a leak check (KV blocks and
host slots)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from connectors.transfer_params import RecvKV, SendKV
from pd_cluster import LLM, SamplingParams
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt
from tests.pd_helpers import drain, engine, producer_params, run_in_process

BS = 8
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # tiny default model: layers x K,V x tokens x heads x dim x fp32
NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def gib(blocks: int) -> float:
    """kv_offloading_size (GiB, over an engine's ranks) that holds ``blocks`` blocks."""
    return blocks * BLOCK_BYTES / 2**30


def history_turns(llm_generate: Any, model: str) -> list[int]:
    """Turn 1 of conversation A (40 tokens), then three other conversations that push A out
    of a 16-block device pool (every output checked against HF); returns turn 2's prompt: A's
    history + 16 new tokens. ``llm_generate(prompt) -> RequestOutput``."""
    turn1 = random_prompt(40, seed=1)
    out1 = llm_generate(turn1).outputs[0].token_ids
    assert_greedy_matches(model, turn1, out1, hf_greedy(model, turn1, NEW))
    for seed in (2, 3, 4):
        filler = random_prompt(60, seed=seed)
        assert_greedy_matches(model, filler, llm_generate(filler).outputs[0].token_ids,
                              hf_greedy(model, filler, NEW))
    return turn1 + out1 + random_prompt(16, seed=5)


@pytest.mark.parametrize("chunk", [2048, 16])  # whole prompts; chunked prefill beside decodes
def test_history_evicted_from_device_is_restored_from_host(tiny_model, chunk: int) -> None:
    model = tiny_model()
    llm = LLM(model=model, block_size=BS, num_kv_blocks=16, max_num_batched_tokens=chunk,
              kv_offloading_size=gib(64))
    try:
        engine_ = llm.engine
        gen = lambda p: llm.generate([p], [GREEDY])[0]  # noqa: E731
        turn2 = history_turns(gen, model)
        before = engine_.stats()
        assert before["kv_offload_saved_blocks_host"] > 0
        out = gen(turn2)
        after = engine_.stats()
        # Turn 1 computed 40 + 7 tokens: 5 full blocks, evicted from the device since.
        assert out.num_cached_tokens == 5 * BS
        assert after["kv_offload_hit_blocks_host"] - before["kv_offload_hit_blocks_host"] == 5
        assert after["prefix_cache_hit_blocks"] == before["prefix_cache_hit_blocks"]
        assert (after["kv_offload_bytes_restored_host"]
                - before["kv_offload_bytes_restored_host"]) == 5 * BLOCK_BYTES
        assert after["kv_offload_restore_seconds"] > 0
        assert_greedy_matches(model, turn2, out.outputs[0].token_ids,
                              hf_greedy(model, turn2, NEW))
        engine_.check_no_leaks()
    finally:
        llm.close()


def test_many_requests_through_a_small_pool_equal_the_engine_without_tiers(tiny_model) -> None:
    """Shared prefixes, concurrent requests, a host tier smaller than the traffic (its own LRU
    evicts): outputs equal an engine without tiers, and the tier served some of it."""
    model = tiny_model()
    system = random_prompt(24, seed=9)
    prompts = [system + random_prompt(10 + 7 * i, seed=20 + i) for i in range(6)]
    prompts += [p + random_prompt(9, seed=40 + i) for i, p in enumerate(prompts[:4])]
    ref = LLM(model=model, block_size=BS).generate(prompts, [GREEDY] * len(prompts))
    llm = LLM(model=model, block_size=BS, num_kv_blocks=14, max_num_seqs=2,
              kv_offloading_size=gib(12))
    try:
        for rounds in range(2):
            got = llm.generate(prompts, [GREEDY] * len(prompts))
            assert [g.outputs[0].token_ids for g in got] == \
                [r.outputs[0].token_ids for r in ref]
        stats = llm.engine.stats()
        assert stats["kv_offload_hit_blocks_host"] > 0
        assert stats["kv_offload_evicted_blocks_host"] > 0
        assert stats["kv_offload_host_blocks_used"] == 12
        llm.engine.check_no_leaks()
    finally:
        llm.close()


def test_tensor_parallel_restores_every_ranks_heads(tiny_model) -> None:
    model = tiny_model()
    llm = LLM(model=model, block_size=BS, num_kv_blocks=16, tensor_parallel_size=2,
              collective_timeout=20.0, kv_offloading_size=gib(64))
    try:
        # The GiB are over both ranks; each holds its own head of all 64 blocks.
        assert llm.engine.runner.tier_store.block_bytes == BLOCK_BYTES // 2
        assert llm.engine.stats()["kv_offload_host_blocks_total"] == 64
        gen = lambda p: llm.generate([p], [GREEDY])[0]  # noqa: E731
        turn2 = history_turns(gen, model)
        out = gen(turn2)
        assert out.num_cached_tokens == 5 * BS
        assert_greedy_matches(model, turn2, out.outputs[0].token_ids,
                              hf_greedy(model, turn2, NEW))
        llm.engine.check_no_leaks()
    finally:
        workers = llm.engine.executor.workers
        llm.close()
        assert all(p.poll() is not None for p in workers.procs)


def test_pd_decode_restores_history_and_producer_restores_too(tiny_model) -> None:
    """Both engines have a host tier and a small pool. Turn 2: D's host tier holds the
    history (5 blocks): it loads them and receives only the rest; P's host tier holds them
    too: it restores them instead of recomputing (and still ships only what D lacks)."""
    model = tiny_model()
    args = dict(block_size=BS, num_kv_blocks=16, kv_offloading_size=gib(64))
    d, p = engine(model, "consumer", **args), engine(model, "producer", **args)
    try:
        def submit(rid: str, prompt: list[int]) -> list[int]:
            p.connect_kv_peer(d.kv_endpoint())
            d.add_request(rid, prompt, GREEDY, RecvKV())
            # expect_held=None: every block waits for D's answer, so the bytes are exact
            p.add_request(rid, prompt, producer_params(GREEDY),
                          SendKV(to=d.kv_endpoint(), expect_held=None))
            return run_in_process(p, d)[rid]

        class Out:  # the shape history_turns expects
            def __init__(self, ids: list[int]) -> None:
                self.outputs = [type("C", (), {"token_ids": ids})()]

        n = iter(range(100))
        turn2 = history_turns(lambda prompt: Out(submit(f"r{next(n)}", prompt)), model)
        before_d, before_p = d.stats(), p.stats()
        got = submit("turn2", turn2)
        assert_greedy_matches(model, turn2, got, hf_greedy(model, turn2, NEW))
        after_d, after_p = d.stats(), p.stats()
        delta = lambda a, b, k: a[k] - b[k]  # noqa: E731
        assert delta(after_d, before_d, "kv_offload_hit_blocks_host") == 5
        assert delta(after_d, before_d, "kv_bytes_received") == \
            (-(-len(turn2) // BS) - 5) * BLOCK_BYTES
        assert delta(after_p, before_p, "kv_offload_hit_blocks_host") == 5
        assert after_d["kv_fallbacks"] == 0
        drain(p, d)
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()


def test_config_errors_name_the_field(tiny_model) -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="kv_offloading_size"):
        LLMEngine(EngineConfig(model=model, block_size=BS, num_kv_blocks=16,
                               kv_offloading_size=BLOCK_BYTES / 2 / 2**30))
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineConfig(model=model, kv_offloading_size=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_disk"):
        EngineConfig(model=model, kv_offloading_disk={"path": "/tmp/x", "size": 1.0})
    with pytest.raises(ValueError, match="kv_offloading_disk"):
        EngineConfig(model=model, kv_offloading_size=1.0, tensor_parallel_size=2,
                     kv_offloading_disk={"path": "/tmp/x", "size": 1.0})
    llm = LLM(model=model, block_size=BS, num_kv_blocks=16)
    try:  # no tier configured: no tier keys
        assert not any(k.startswith("kv_offload") for k in llm.engine.stats())
    finally:
        llm.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs 1 CUDA GPU")
def test_cuda_host_tier_is_pinned_and_exact(tiny_model) -> None:
    """On CUDA the host slots are pinned and the copies non_blocking on the compute stream:
    the forward after a restore must still read the restored bytes (fp32, exact with HF)."""
    model = tiny_model()
    llm = LLM(model=model, device="cuda", dtype="float32", block_size=BS, num_kv_blocks=16,
              cuda_graphs=True, kv_offloading_size=gib(64))
    try:
        assert all(h.is_pinned() for h in llm.engine.runner.tier_store.host)
        gen = lambda p: llm.generate([p], [GREEDY])[0]  # noqa: E731
        turn2 = history_turns(gen, model)
        out = gen(turn2)
        assert out.num_cached_tokens == 5 * BS
        assert llm.engine.stats()["kv_offload_hit_blocks_host"] >= 5
        assert_greedy_matches(model, turn2, out.outputs[0].token_ids,
                              hf_greedy(model, turn2, NEW))
        llm.engine.check_no_leaks()
    finally:
        llm.close()
