"""Decode-side prefix reuse: the decode engine serves what its own prefix cache holds and the
prefill engine ships only the rest (in-process P/D pairs; exact against a colocated engine
that runs the same turns; zero blocks held after each)."""
from __future__ import annotations

import time

import pytest

from connectors.transfer_params import RecvKV, SendKV
from pd_cluster import LLM, SamplingParams
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.request import Request
from tests.pd_helpers import (drain, engine, producer_params, prompts_of_lengths,
                              run_in_process)

BS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from pd_cluster.checkpoints.maker import make_model
    return str(make_model(tmp_path_factory.mktemp("reuse") / "m", arch="llama", num_layers=3))


def _block_bytes(e: LLMEngine) -> int:
    """Bytes one block of every layer takes on the wire (K and V)."""
    return sum(c[:, 0].nbytes for c in e.runner.kv_caches)


def _submit(p: LLMEngine, d: LLMEngine, rid: str, prompt: list[int],
            params: SamplingParams = GREEDY) -> None:
    p.connect_kv_peer(d.kv_endpoint())
    d.add_request(rid, prompt, params, RecvKV())
    # expect_held=None: every block waits for D's answer, so the bytes are exact.
    p.add_request(rid, prompt, producer_params(params),
                  SendKV(to=d.kv_endpoint(), expect_held=None))


def _first_turn(p: LLMEngine, d: LLMEngine, ref: "Turns | None" = None,
                new_tokens: int = 13) -> tuple[list[int], list[int], list[int]]:
    """Turn 1 (37 tokens) through the pair; returns (its prompt, its output, turn 2's prompt:
    the history plus ``new_tokens``). D then holds 5 full blocks (37 + 9 decoded tokens)."""
    turn1 = prompts_of_lengths([37])[0]
    _submit(p, d, "t1", turn1)
    out1 = run_in_process(p, d)["t1"]
    if ref is not None:
        assert out1 == ref(turn1)
    return turn1, out1, turn1 + out1 + prompts_of_lengths([new_tokens], vocab=300)[0]


def _delta(e: LLMEngine, before: dict, key: str) -> int:
    return e.stats()[key] - before[key]


class Turns:
    """A colocated engine that runs the same prompts in the same order (the reference)."""

    def __init__(self, model: str):
        self.llm = LLM(model=model, block_size=BS)

    def __call__(self, prompt: list[int]) -> list[int]:
        return self.llm.generate([prompt], [GREEDY])[0].outputs[0].token_ids


@pytest.mark.parametrize("new_tokens", [13, 17])  # turn 2: 60 tokens (not aligned), 64
def test_turn_two_ships_only_the_blocks_decode_lacks(model, new_tokens):
    p, d = engine(model, "producer", block_size=BS), engine(model, "consumer", block_size=BS)
    ref = Turns(model)
    _, _, turn2 = _first_turn(p, d, ref, new_tokens)
    before_p, before_d = p.stats(), d.stats()
    _submit(p, d, "t2", turn2)
    assert run_in_process(p, d)["t2"] == ref(turn2)
    shipped = (-(-len(turn2) // BS) - 5) * _block_bytes(d)
    assert _delta(d, before_d, "kv_bytes_received") == shipped
    assert _delta(p, before_p, "kv_bytes_sent") == shipped
    assert _delta(d, before_d, "kv_prefix_hit_tokens") == 5 * BS
    assert d.stats()["kv_fallbacks"] == 0
    p.check_no_leaks(), d.check_no_leaks()
    p.close(), d.close()


@pytest.mark.parametrize("length,blocks_shipped", [(40, 0), (43, 1)])
def test_full_hit(model, length, blocks_shipped):
    """Every full prompt block cached on D: an aligned prompt ships nothing (P sends the FIN
    with token 1 only); otherwise only the partial tail block."""
    p, d = engine(model, "producer", block_size=BS), engine(model, "consumer", block_size=BS)
    ref = Turns(model)
    turn1, out1, _ = _first_turn(p, d, ref)
    again = (turn1 + out1)[:length]
    before_p, before_d = p.stats(), d.stats()
    _submit(p, d, "t2", again)
    assert run_in_process(p, d)["t2"] == ref(again)
    assert _delta(d, before_d, "kv_bytes_received") == blocks_shipped * _block_bytes(d)
    assert _delta(p, before_p, "kv_bytes_sent") == blocks_shipped * _block_bytes(d)
    assert _delta(d, before_d, "kv_prefix_hit_tokens") == 5 * BS
    p.check_no_leaks(), d.check_no_leaks()
    p.close(), d.close()


def test_matched_blocks_are_pinned_against_eviction(model):
    """Between D's match and the KV's arrival, a burst that takes every free block evicts
    unpinned cached blocks but never the request's hits."""
    p = engine(model, "producer", block_size=BS)
    d = engine(model, "consumer", block_size=BS, num_kv_blocks=24)
    ref = Turns(model)
    _, _, turn2 = _first_turn(p, d)
    _submit(p, d, "t2", turn2)
    d.step()  # D admits t2: 5 hit blocks pinned, the request parked
    parked = d.scheduler.remote_waiting["t2"]
    hits = parked.block_ids[:5]
    hashes = [d.block_manager.blocks[b].block_hash for b in hits]
    bm = d.block_manager
    burst = Request("burst", list(range(1, 1 + bm.num_free_blocks * BS)), GREEDY)
    bm.allocate(burst, use_prefix_cache=False)  # every free block: cached ones evicted
    assert bm.num_free_blocks == 0
    assert [bm.blocks[b].block_hash for b in hits] == hashes  # still there, still findable
    bm.free(burst)
    assert run_in_process(p, d)["t2"] == ref(turn2)
    p.check_no_leaks(), d.check_no_leaks()
    p.close(), d.close()


def _pd(model: str, timeout: float, **d_args) -> tuple[LLMEngine, LLMEngine]:
    kv = {"kv_transfer_timeout": timeout, "lease_seconds": timeout}
    p = LLMEngine(EngineConfig(model=model, block_size=BS,
                               kv_transfer={"role": "producer", **kv}))
    d = LLMEngine(EngineConfig(model=model, block_size=BS,
                               kv_transfer={"role": "consumer", **kv}, **d_args))
    return p, d


def _step_until_idle(e: LLMEngine, timeout: float = 20.0) -> dict[str, list[int]]:
    done, deadline = {}, time.monotonic() + timeout
    while e.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not go idle in time"
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_producer_killed_mid_transfer_of_a_partial_prefix(model):
    """P dies after it started on turn 2: D gives up after its timeout and computes the
    prompt itself, from its own cache, exactly; nothing leaks on D."""
    p, d = _pd(model, timeout=1.0)
    ref = Turns(model)
    _, _, turn2 = _first_turn(p, d)
    _submit(p, d, "t2", turn2)
    d.step()  # parked, hits pinned
    p.step()  # P computes and starts shipping ... then dies
    p.close()
    assert _step_until_idle(d)["t2"] == ref(turn2)
    assert d.stats()["kv_fallbacks"] == 1
    assert d.stats()["prefix_cache_hit_blocks"] >= 5 + 5  # the fallback reused D's cache
    d.check_no_leaks()
    d.close()


def test_decode_killed_mid_transfer_of_a_partial_prefix(model):
    """D dies after it admitted turn 2: P's sends fail or go unanswered, and P frees every
    block within its bounds."""
    p, d = _pd(model, timeout=1.0)
    _, _, turn2 = _first_turn(p, d)
    _submit(p, d, "t2", turn2)
    d.step()  # D answers P's offer once P makes it; then dies
    p.step()
    d.close()
    _step_until_idle(p)
    p.check_no_leaks()
    p.close()


@pytest.mark.parametrize("expect_held", [0, 40])  # 0: the default
def test_blocks_past_the_expected_hold_go_at_once(model, expect_held):
    """SendKV.expect_held (the proxy's view of D's cache): blocks past it are sent without
    waiting for D's answer; D drops any it holds, so what it writes stays exact."""
    p, d = engine(model, "producer", block_size=BS), engine(model, "consumer", block_size=BS)
    ref = Turns(model)
    _, _, turn2 = _first_turn(p, d, ref)
    before_p, before_d = p.stats(), d.stats()
    p.connect_kv_peer(d.kv_endpoint())
    d.add_request("t2", turn2, GREEDY, RecvKV())
    p.add_request("t2", turn2, producer_params(GREEDY),
                  SendKV(to=d.kv_endpoint(), expect_held=expect_held))
    assert run_in_process(p, d)["t2"] == ref(turn2)
    shipped = (-(-len(turn2) // BS) - 5) * _block_bytes(d)
    sent = _delta(p, before_p, "kv_bytes_sent")
    assert _delta(d, before_d, "kv_bytes_received") == shipped
    assert sent - shipped == _delta(d, before_d, "kv_bytes_skipped")  # dropped, not written
    assert sent == shipped if expect_held == 40 else shipped <= sent
    p.check_no_leaks(), d.check_no_leaks()
    p.close(), d.close()


def test_reuse_off_ships_the_whole_prompt(model):
    """RecvKV(reuse_prefix=False): today's behaviour, every prompt block shipped."""
    p, d = engine(model, "producer", block_size=BS), engine(model, "consumer", block_size=BS)
    _, _, turn2 = _first_turn(p, d)
    before = d.stats()
    p.connect_kv_peer(d.kv_endpoint())
    d.add_request("t2", turn2, GREEDY, RecvKV(reuse_prefix=False))
    p.add_request("t2", turn2, producer_params(GREEDY), SendKV(to=d.kv_endpoint()))
    run_in_process(p, d)
    assert _delta(d, before, "kv_bytes_received") == -(-len(turn2) // BS) * _block_bytes(d)
    assert _delta(d, before, "kv_prefix_hit_tokens") == 0
    p.check_no_leaks(), d.check_no_leaks()
    p.close(), d.close()


@pytest.mark.parametrize("p_size, d_size", [(2, 1), (1, 2)])
def test_reuse_across_tensor_parallel_sizes(model, p_size, d_size):
    """Tensor-parallel producer or consumer (Gloo): D's rank 0 matches its prefix cache, every
    consumer rank reuses the same blocks, P ships each rank its heads of the rest only."""
    tp = dict(block_size=BS, collective_timeout=20.0)
    p = engine(model, "producer", tensor_parallel_size=p_size, **tp)
    d = engine(model, "consumer", tensor_parallel_size=d_size, **tp)
    try:
        ref = Turns(model)
        before_p, before_d = p.stats(), d.stats()
        _, _, turn2 = _first_turn(p, d, ref)  # 37 tokens: 5 blocks shipped
        turn1_bytes = _delta(d, before_d, "kv_bytes_received")
        assert turn1_bytes > 0 and _delta(p, before_p, "kv_bytes_sent") == turn1_bytes
        before_p, before_d = p.stats(), d.stats()
        _submit(p, d, "t2", turn2)
        assert run_in_process(p, d)["t2"] == ref(turn2)
        lacked = -(-len(turn2) // BS) - 5  # 5 full blocks held on D after turn 1
        assert _delta(d, before_d, "kv_bytes_received") * 5 == turn1_bytes * lacked
        assert _delta(p, before_p, "kv_bytes_sent") * 5 == turn1_bytes * lacked
        assert _delta(d, before_d, "kv_prefix_hit_tokens") == 5 * BS
        assert d.stats()["kv_fallbacks"] == 0
        drain(p, d)
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()
