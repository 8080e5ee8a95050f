"""An engine switches its KV role in place (issue 40, item 4), at TP 1 and TP 2 (Gloo ranks).

A P/D pair runs, drains, and swaps roles: the former consumer (TP 2) becomes the producer,
the former producer the consumer, weights and KV caches kept. Outputs equal the colocated
engine's before and after the swap, the new consumer advertises one endpoint per rank, the
former consumer refuses handshakes, and nothing (no block, no KV hold) is left.
"""
from __future__ import annotations

import pytest

from connectors.pipes.base import PipeError
from connectors.transfer_params import RecvKV
from pd_cluster.sampling_params import SamplingParams
from tests.pd_helpers import (colocated_tokens, drain, engine, prompts_of_lengths,
                               run_in_process, submit_pair)

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
IDLE = {"kv_staging_bytes": 0, "kv_receiving": 0, "kv_send_holds": 0}


def _round(p, d, prompts, tag: str) -> list[list[int]]:
    endpoint = d.kv_endpoint()
    for i, prompt in enumerate(prompts):
        submit_pair(p, d, f"{tag}{i}", prompt, PARAMS, endpoint)
    done = run_in_process(p, d)
    drain(p, d)
    p.check_no_leaks(), d.check_no_leaks()
    assert p.kv_holds() == IDLE and d.kv_holds() == IDLE
    assert d.stats()["kv_fallbacks"] == 0
    return [done[f"{tag}{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("d_size", [1, 2])
def test_swapped_roles_serve_exactly_without_reloading(tiny_model, d_size: int) -> None:
    model_dir = tiny_model(num_heads=4, num_kv_heads=2)
    prompts = prompts_of_lengths([5, 19, 40])
    want = colocated_tokens(model_dir, prompts, [PARAMS] * len(prompts), num_kv_blocks=64)
    args = dict(num_kv_blocks=64, collective_timeout=20.0, block_size=8)
    p = engine(model_dir, "producer", **args)
    d = engine(model_dir, "consumer", tensor_parallel_size=d_size, **args)
    try:
        assert _round(p, d, prompts, "a") == want
        old_endpoint = d.kv_endpoint()
        weights = id(d.runner.model)
        # A request in flight: no switch (the cluster drains first).
        d.add_request("busy", prompts[0], PARAMS, RecvKV())
        with pytest.raises(ValueError, match="drain it first"):
            d.set_kv_role("producer")
        d.abort_request(["busy"])
        drain(p, d)
        assert d.set_kv_role("producer") is None  # a producer advertises no endpoint
        endpoint = p.set_kv_role("consumer", 64)
        assert endpoint is not None and len(endpoint.split("|")) == 1
        assert id(d.runner.model) == weights
        # The former consumer's socket refuses every new handshake.
        p.disconnect_kv_peer(old_endpoint)
        with pytest.raises((PipeError, ValueError), match="not a KV consumer"):
            p.connect_kv_peer(old_endpoint.split("|")[0])
        assert _round(d, p, prompts, "b") == want  # now d produces (TP d_size), p consumes
        # And back: the TP engine listens again, one endpoint per rank.
        d.disconnect_kv_peer(endpoint)
        p.set_kv_role("producer")
        new = d.set_kv_role("consumer")
        assert new is not None and len(new.split("|")) == d_size
        assert _round(p, d, prompts, "c") == want
    finally:
        p.close()
        d.close()


def test_bad_role_names_the_field(tiny_model) -> None:
    e = engine(tiny_model(), "producer", num_kv_blocks=32)
    try:
        with pytest.raises(ValueError, match="^role: expected one of"):
            e.set_kv_role("sideways")
    finally:
        e.close()
