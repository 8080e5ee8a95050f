"""P/D with tensor-parallel engines of equal and different TP sizes (Gloo groups, ZMQ KV).

Each producer rank ships its own heads to the consumer ranks that own them (head slices when
the sizes differ; a replicated head sent once per consumer rank); a request counts as received
when every consumer rank has all its heads and every feeder's FIN. Outputs equal the colocated
TP1 engine's, KV bytes are received, no request falls back, nothing leaks.
"""
from __future__ import annotations

import pytest

from tests.pd_helpers import (colocated_tokens, drain, engine, prompts_of_lengths,
                               run_in_process, submit_pair)
from connectors.tp_topology import Route, num_feeders, routes_for
from pd_cluster.sampling_params import SamplingParams

LENGTHS = [5, 16, 33, 70]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("p_size, d_size, kv_heads", [(2, 1, 2), (1, 2, 2), (2, 2, 2),
                                                     (2, 2, 1)])
def test_pd_across_tp_sizes_equals_colocated(tiny_model, p_size: int, d_size: int,
                                             kv_heads: int) -> None:
    model_dir = tiny_model(arch="qwen2" if kv_heads == 1 else "llama", num_heads=4,
                           num_kv_heads=kv_heads)
    prompts = prompts_of_lengths(LENGTHS)
    want = colocated_tokens(model_dir, prompts, [PARAMS] * len(prompts), num_kv_blocks=64)
    args = dict(num_kv_blocks=64, collective_timeout=20.0, block_size=8)
    p = engine(model_dir, "producer", tensor_parallel_size=p_size, **args)
    d = engine(model_dir, "consumer", tensor_parallel_size=d_size, **args)
    try:
        endpoint = d.kv_endpoint()
        assert endpoint is not None and len(endpoint.split("|")) == d_size
        for i, prompt in enumerate(prompts):
            submit_pair(p, d, f"r{i}", prompt, PARAMS, endpoint)
        done = run_in_process(p, d)
        assert [done[f"r{i}"] for i in range(len(prompts))] == want
        stats = d.stats()
        assert stats["kv_fallbacks"] == 0
        per_token = 2 * 2 * kv_heads * 16 * 4  # layers x K/V x heads x head_dim x fp32
        # Every consumer rank got its heads of every prompt block (replicated ones per rank).
        blocks = sum(-(-n // 8) for n in LENGTHS)
        heads_per_rank = max(kv_heads // d_size, 1)
        want_bytes = blocks * 8 * per_token // kv_heads * heads_per_rank * d_size
        assert stats["kv_bytes_received"] == want_bytes
        assert p.stats()["kv_bytes_sent"] == want_bytes
        drain(p, d)
        p.check_no_leaks()
        d.check_no_leaks()
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("p_size, d_size, heads, want", [
    (1, 1, 2, {0: [Route(0, 0, 0, 2)]}),
    (2, 1, 2, {0: [Route(0, 0, 0, 1)], 1: [Route(0, 0, 1, 1)]}),
    (1, 2, 2, {0: [Route(0, 0, 0, 1), Route(1, 1, 0, 1)]}),
    (2, 2, 1, {0: [Route(0, 0, 0, 1)], 1: [Route(1, 0, 0, 1)]}),  # replicated: once per rank
    (4, 1, 2, {0: [Route(0, 0, 0, 1)], 1: [], 2: [Route(0, 0, 1, 1)], 3: []}),
    (2, 4, 4, {0: [Route(0, 0, 0, 1), Route(1, 1, 0, 1)],
               1: [Route(2, 0, 0, 1), Route(3, 1, 0, 1)]}),
])
def test_routes_give_each_consumer_rank_exactly_its_heads(p_size, d_size, heads, want) -> None:
    assert {r: routes_for(r, p_size, d_size, heads) for r in range(p_size)} == want
    for d_rank in range(d_size):
        feeders = {r for r in range(p_size) for x in want[r] if x.dst_rank == d_rank}
        assert num_feeders(d_rank, p_size, d_size, heads) == len(feeders)


def test_layouts_that_cannot_match_name_both_engines() -> None:
    with pytest.raises(ValueError, match="decode engine: tensor_parallel_size=3"):
        routes_for(0, 2, 3, 2)


def test_handshake_compares_total_heads_and_reveals_only_the_producers_values() -> None:
    from connectors.hello import hello_mismatch, make_hello
    info = dict(model_id="m", dtype="torch.float32", block_size=16, num_layers=2, head_dim=16)
    d_tp2 = make_hello({**info, "num_kv_heads": 1, "total_kv_heads": 2, "tp_size": 2})
    p_tp1 = make_hello({**info, "num_kv_heads": 2, "total_kv_heads": 2, "tp_size": 1})
    assert hello_mismatch(d_tp2, p_tp1) is None  # 1 head per rank vs 2: same model layout
    other = make_hello({**info, "num_kv_heads": 4, "tp_size": 1})
    msg = hello_mismatch(d_tp2, other)
    assert msg is not None and "prefill engine (TP1)" in msg
    assert "num_kv_heads (the prefill engine has 4)" in msg
    assert "2" not in msg.replace("TP1", "")  # the decode engine's own values stay unsaid
