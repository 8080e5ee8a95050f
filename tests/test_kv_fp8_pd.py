"""An FP8 KV cache through P/D (in process, a tiny model): D's tokens equal the FP8 colocated
engine's token for token, the blocks shipped are FP8 with their scale rows (17/16 x 1 byte
per value, against fp32's 4), a scale altered in flight fails closed (recomputed exactly), and
a producer whose KV cache dtype differs is refused at the handshake with a clear reason. Leak
checks after each."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch

from connectors.pipes.base import HandshakeError
from pd_cluster import SamplingParams
from pd_cluster.engine.llm_engine import LLMEngine
from tests.pd_helpers import (colocated_tokens, drain, engine, pd_tokens, prompts_of_lengths,
                              run_in_process, submit_pair)
from tests.test_kv_fail_closed import _tampered

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = prompts_of_lengths([37, 53, 29])
FP8 = dict(kv_cache_dtype="fp8_e4m3")
BS = 8


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[list[int]]:
    """The FP8 colocated engine's tokens (prompts prefilled in one step, as P does)."""
    return colocated_tokens(tiny_model(), PROMPTS, [GREEDY] * len(PROMPTS), block_size=BS,
                            **FP8)


def test_fp8_through_pd_equals_fp8_colocated(tiny_model, expected) -> None:
    model = tiny_model()
    got = pd_tokens(model, PROMPTS[:2], [GREEDY] * 2, chunk=64, block_size=BS, **FP8)
    assert got == expected[:2]


def test_fp8_ships_a_quarter_of_fp32_plus_the_scale_rows(tiny_model) -> None:
    model = tiny_model()
    sent = {}
    for name, args in (("auto", {}), ("fp8", FP8)):
        d, p = engine(model, "consumer", block_size=BS, **args), engine(
            model, "producer", block_size=BS, **args)
        try:
            submit_pair(p, d, "r", PROMPTS[0], GREEDY, d.kv_endpoint())
            run_in_process(p, d)
            drain(p, d)
            assert d.stats()["kv_fallbacks"] == 0
            sent[name] = p.stats()["kv_bytes_sent"]
            p.check_no_leaks(), d.check_no_leaks()
        finally:
            p.close(), d.close()
    # fp32 (the CPU's auto) holds 4 bytes a value; FP8 1, and one scale row per 8-token block.
    assert sent["fp8"] * 4 * BS == sent["auto"] * (BS + 1)


@pytest.fixture(scope="module")
def pair(tiny_model) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    model = tiny_model()
    p = engine(model, "producer", 30.0, block_size=BS, **FP8)
    d = engine(model, "consumer", 30.0, block_size=BS, **FP8)
    yield p, d
    p.close(), d.close()


def test_a_scale_altered_in_flight_fails_closed_and_recomputes(pair, expected) -> None:
    p, d = pair
    altered: list[int] = []

    def alter_scale(header: dict, t: torch.Tensor) -> torch.Tensor:
        if altered or header["layer"] != 1:
            return t
        t = t.clone()
        # The first block's scale row (row BS), head 0: the fp32 scale's top byte.
        rows = t.view(torch.uint8)
        (rows[0, 0] if rows.dim() == 5 else rows[0])[BS, 0, 3] ^= 0x01
        altered.append(1)
        return t
    fallbacks = d.stats()["kv_fallbacks"]
    with _tampered(d, alter_scale):
        submit_pair(p, d, "scale", PROMPTS[2], GREEDY, d.kv_endpoint())
        got = run_in_process(p, d, timeout=25.0)["scale"]
        drain(p, d)
    assert altered and got == expected[2]
    assert d.stats()["kv_fallbacks"] == fallbacks + 1
    assert d.runner.connector.stats()["kv_integrity_failures"] >= 1
    p.check_no_leaks(), d.check_no_leaks()


def test_the_handshake_refuses_another_kv_cache_dtype(tiny_model) -> None:
    model = tiny_model()
    d = engine(model, "consumer", 5.0, block_size=BS)  # auto: the model's dtype
    p = engine(model, "producer", 5.0, block_size=BS, **FP8)
    try:
        with pytest.raises(HandshakeError, match="KV cache dtype mismatch: the prefill engine "
                                                 "stores its KV cache as 'fp8_e4m3'.*"
                                                 "engine.kv_cache_dtype"):
            p.connect_kv_peer(d.kv_endpoint())
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()
