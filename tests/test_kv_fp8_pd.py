"""An FP8 KV cache through P/D (in process, a tiny model): D's tokens equal the FP8 colocated
engine's token for token, the blocks shipped are FP8 with their scales (1 byte per value and 4
per block and head, against fp32's 4 per value), a scale altered in flight fails closed
(recomputed exactly), and a producer whose KV cache dtype differs is refused at the handshake
with a clear reason. Leak checks after each."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch

from connectors.pipes.base import HandshakeError
from pd_cluster import SamplingParams
from pd_cluster.engine.llm_engine import LLMEngine
from tests.pd_helpers import (colocated_tokens, drain, engine, pd_tokens, prompts_of_lengths,
                              run_in_process, submit_pair)
from kernels.kv_quant import row_bytes
from tests.test_kv_fail_closed import _tampered

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = prompts_of_lengths([37, 53, 29])
FP8 = dict(kv_cache_dtype="fp8_e4m3")
BS = 8
D = 16  # the tiny model's head dim


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[list[int]]:
    """The FP8 colocated engine's tokens (prompts prefilled in one step, as P does: a chunked
    prompt's later chunks would read their context from FP8, attention/fresh_prefill.py)."""
    return colocated_tokens(tiny_model(), PROMPTS, [GREEDY] * len(PROMPTS), block_size=BS,
                            **FP8)


def test_fp8_through_pd_equals_fp8_colocated(tiny_model, expected) -> None:
    model = tiny_model()
    got = pd_tokens(model, PROMPTS[:2], [GREEDY] * 2, chunk=128, block_size=BS, **FP8)
    assert got == expected[:2]


def test_fp8_ships_a_quarter_of_fp32_plus_the_scales(tiny_model) -> None:
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
    # fp32 (the CPU's auto) holds 4 bytes a value; FP8 1, and a 4-byte scale per block and head.
    assert sent["fp8"] * 4 * BS * D == sent["auto"] * row_bytes(BS, D) == sent["auto"] * (
        BS * D + 4)


@pytest.mark.parametrize("p_size, d_size", [(2, 1), (1, 2)])
def test_fp8_across_tp_sizes_equals_fp8_colocated(tiny_model, expected, p_size: int,
                                                  d_size: int) -> None:
    """P and D of different TP sizes: each consumer rank gets a head slice of every block, the
    heads' scales with them (they sit on the heads axis); D's tokens equal the TP1 FP8
    colocated engine's and every head of every block arrives once, scales included."""
    model = tiny_model()
    args = dict(collective_timeout=20.0, block_size=BS, num_kv_blocks=64, **FP8)
    p = engine(model, "producer", 20.0, tensor_parallel_size=p_size, **args)
    d = engine(model, "consumer", 20.0, tensor_parallel_size=d_size, **args)
    try:
        for i, prompt in enumerate(PROMPTS):
            submit_pair(p, d, f"r{i}", prompt, GREEDY, d.kv_endpoint())
        done = run_in_process(p, d)
        assert [done[f"r{i}"] for i in range(len(PROMPTS))] == expected
        assert d.stats()["kv_fallbacks"] == 0
        blocks = sum(-(-len(prompt) // BS) for prompt in PROMPTS)
        want = blocks * 2 * 2 * 2 * row_bytes(BS, D)  # layers x K,V x heads x (tokens, scale)
        assert d.stats()["kv_bytes_received"] == p.stats()["kv_bytes_sent"] == want
        drain(p, d)
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()


@pytest.fixture(scope="module")
def pair(tiny_model) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    model = tiny_model()
    p = engine(model, "producer", 30.0, block_size=BS, pipe="zmq", **FP8)  # ZMQ tampered
    d = engine(model, "consumer", 30.0, block_size=BS, pipe="zmq", **FP8)
    yield p, d
    p.close(), d.close()


def test_a_scale_altered_in_flight_fails_closed_and_recomputes(pair, expected) -> None:
    p, d = pair
    altered: list[int] = []

    def alter_scale(header: dict, t: torch.Tensor) -> torch.Tensor:
        if altered or header["layer"] != 1:
            return t
        t = t.clone()
        # The first block's head 0: its last byte is the top byte of its fp32 scale.
        rows = t.view(torch.uint8)
        (rows[0, 0] if rows.dim() == 5 else rows[0])[0, 0, -1] ^= 0x01
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


def test_stats_metrics_and_status_say_kv_bytes_per_token(tiny_model, monkeypatch,
                                                         capsys) -> None:
    import argparse
    from types import SimpleNamespace

    import httpx

    from pd_cluster.serving.cluster.cli_cluster import run_status
    from pd_cluster.serving.observability.metrics import ProxyMetrics
    per_token = {}
    for name, args in (("auto", {}), ("fp8_e4m3", FP8)):
        e = engine(tiny_model(), None, block_size=BS, num_kv_blocks=8, **args)
        try:
            s = e.stats()
            per_token[name] = s["kv_bytes_per_token"]
            assert s["kv_cache_dtype"] == name
            e.check_no_leaks()
        finally:
            e.close()
    # tiny model: 2 layers x K,V x 2 heads x 16 dims; fp32 4 bytes, FP8 1 and 4 per block+head
    assert per_token == {"auto": 512.0, "fp8_e4m3": 2 * 2 * 2 * (BS * D + 4) / BS} == {
        "auto": 512.0, "fp8_e4m3": 132.0}
    stats = {"kv_cache_dtype": "fp8_e4m3", "kv_bytes_per_token": 132.0}
    engines = [SimpleNamespace(name="decode-0", role="decode", healthy=True, inflight=0,
                               stats=stats)]
    text = ProxyMetrics(lambda: engines, "m").render().decode()
    assert 'pd_engine_kv_bytes_per_token{engine="decode-0",role="decode"} 132.0' in text
    body = {"mode": "disaggregated", "model": "tiny", "inflight": 0, "proxy": {},
            "engines": [{"name": "decode-0", "role": "decode", "healthy": True, "inflight": 0,
                         "restarts": 0, "pid": 7, "stats": stats}]}
    monkeypatch.setattr(httpx, "get", lambda *a, **kw: SimpleNamespace(status_code=200,
                                                                       json=lambda: body))
    assert run_status(argparse.Namespace(url="http://proxy", namespace="t", config=None,
                                         json=False)) == 0
    assert "decode-0 KV cache: fp8_e4m3, 132 bytes/token" in capsys.readouterr().out


def test_host_tier_keeps_fp8_blocks_with_their_scales(tiny_model) -> None:
    """History evicted from a small FP8 device pool comes back from the host tier as stored
    (scales included): the tokens equal an FP8 engine that kept it on the device."""
    from pd_cluster import LLM
    from tests.conftest import random_prompt
    model = tiny_model()
    block_bytes = 2 * 2 * 2 * row_bytes(BS, D)  # layers x K,V x heads x (tokens, scale)
    turn1 = random_prompt(40, seed=1)
    fillers = [random_prompt(60, seed=s) for s in (2, 3, 4)]
    outs = {}
    for name, args in (("tiers", dict(num_kv_blocks=16, kv_offloading_size=64 * block_bytes
                                      / 2**30)), ("device", dict(num_kv_blocks=64))):
        llm = LLM(model=model, block_size=BS, **FP8, **args)
        try:
            gen = lambda p: llm.generate([p], [GREEDY])[0]  # noqa: E731
            out1 = gen(turn1).outputs[0].token_ids
            for f in fillers:
                gen(f)
            turn2 = turn1 + out1 + random_prompt(16, seed=5)
            before = llm.engine.stats()
            out2 = gen(turn2)
            after = llm.engine.stats()
            held = (len(turn1) + len(out1) - 1) // BS  # full blocks of turn 1's computed KV
            assert out2.num_cached_tokens == held * BS
            if name == "tiers":
                assert (after["kv_offload_hit_blocks_host"]
                        - before["kv_offload_hit_blocks_host"]) == held
            outs[name] = out2.outputs[0].token_ids
            llm.engine.check_no_leaks()
        finally:
            llm.close()
    assert outs["tiers"] == outs["device"]


def test_checkpoint_kv_scales_are_the_static_scales(tiny_model, tmp_path) -> None:
    """A checkpoint's k_scale/v_scale (vLLM's names; one kv_scale for both) become the
    layer's static scales: every block an FP8 engine fills holds them."""
    import shutil

    from safetensors.torch import save_file

    from kernels.kv_quant import split
    from pd_cluster import LLM
    src = tiny_model()
    model = tmp_path / "scaled"
    shutil.copytree(src, model)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.05),
               "model.layers.0.self_attn.v_scale": torch.tensor(0.07),
               "model.layers.1.self_attn.kv_scale": torch.tensor([0.03])},
              str(model / "kv_scales.safetensors"))
    llm = LLM(model=str(model), block_size=BS, num_kv_blocks=16, **FP8)
    try:
        layers = llm.engine.runner.model.model.layers
        assert [layer.self_attn.kv_scales for layer in layers] == [
            (pytest.approx(0.05), pytest.approx(0.07)), (pytest.approx(0.03),) * 2]
        llm.generate([PROMPTS[2]], [GREEDY])
        layer = llm.engine.runner.kv_spec.layers[1]
        _, scales = split(llm.engine.runner.kv_caches[1], layer.head_dim)
        used = scales[0].flatten()[scales[0].flatten() != 0]
        assert used.numel() and torch.allclose(used, torch.tensor(0.03))
        llm.engine.check_no_leaks()
    finally:
        llm.close()
    with pytest.raises(ValueError, match="one positive number"):
        save_file({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)},
                  str(model / "kv_scales.safetensors"))
        LLM(model=str(model), block_size=BS, num_kv_blocks=16, **FP8)
