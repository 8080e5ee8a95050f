"""KV cache groups through P/D (connectors/group_tables.py): both engines keep a block table
per layer kind, each layer ships from its group's table into the consumer's, a sliding group
only its window's blocks (the rest is the null block on D, never shipped, never written).

Windowed families (Gemma 3, gpt-oss: a sliding and a full group; Mistral with a window: one
sliding group) with prompts longer than every window, the producer prefilling in chunks: the
decode engine's cache is first filled with huge values (a read of a block nobody wrote shows),
its tokens equal HF's greedy ones, and it holds fewer bytes per request than one table for
every layer would. Then the shm pipe (writes in place into per-group grants), different TP
sizes, the decode engine's prefix hits, preemption on D and a migrated request. Leak checks
on both engines after each."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from connectors.group_tables import grant_groups_valid, layer_table
from connectors.granted_writes import Grants
from connectors.window_shipping import first_shipped_token
from pd_cluster import SamplingParams
from pd_cluster.checkpoints.maker import PRESETS, make_model
from pd_cluster.engine.block_manager import BlockManager
from pd_cluster.engine.kv_groups import NULL_BLOCK, KVCacheGroup
from pd_cluster.request import Request
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt
from tests.pd_helpers import colocated_tokens, drain, engine, run_in_process, submit_pair
from tests.test_moe_families import moe_model  # noqa: F401  (the gpt-oss checkpoint)

BS = 8
NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def test_a_decode_engine_takes_only_each_groups_window_of_a_remote_prompt() -> None:
    """The consumer's admission (no logits: the prompt's KV comes from P): a sliding group's
    entries before the first decode's window are the null block, and only the real need
    counts (9 blocks for 40 tokens and a window of 6, not 10)."""
    groups = (KVCacheGroup((1,)), KVCacheGroup((0,), 6))
    bm = BlockManager(num_blocks=10, block_size=4, groups=groups)
    r = Request("r", random_prompt(20, seed=2), SamplingParams(max_tokens=4))
    assert bm.can_allocate(r, needs_logits=False)
    bm.allocate(r, needs_logits=False)
    full, window = r.group_block_ids
    first = first_shipped_token(20, 6, 4) // 4  # the first decode (20) sees 15..20
    assert NULL_BLOCK not in full and len(full) == 5
    assert window[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in window[first:]
    assert bm.num_used_blocks == 5 + (5 - first)
    bm.free(r)
    bm.check_no_leaks()


def test_a_layer_reads_its_groups_table_and_a_peers_grant_is_checked() -> None:
    assert layer_table((1, 2), ((1, 2), (5, 6)), [1, 0], 0) == (5, 6)
    assert layer_table((1, 2), (), None, 0) == (1, 2)
    assert grant_groups_valid((1, 2), ((1, 2), (5, 6)), (1, 0))
    assert grant_groups_valid((1, 2), (), ())
    assert not grant_groups_valid((1, 2), ((1, 2), (5,)), (1, 0))  # a short group
    assert not grant_groups_valid((1, 2), ((1, 2),), (1, 0))  # a layer naming no group
    grants = Grants(10.0)
    grants.record("d", "r", 3, (7, 8), ((7, 8), (9, 4)), (0, 1))
    assert grants.get("d", "r", 1) == (3, (9, 4)) and grants.get("d", "r", 0) == (3, (7, 8))


def _family(name: str, tmp: Any, moe_model: Any) -> str:
    if name == "gpt_oss":
        return moe_model("gpt_oss")
    return str(make_model(tmp.mktemp("gpd") / name, **PRESETS[name]))


def _run(p: Any, d: Any, peak: dict[str, int]) -> dict[str, list[int]]:
    """run_in_process, noting D's peak blocks in use."""
    def note() -> None:
        peak["d"] = max(peak.get("d", 0), d.block_manager.num_used_blocks)
    return run_in_process(p, d, after_step=note)


@pytest.mark.parametrize("name", ["tiny-gemma3", "gpt_oss", "tiny-mistral-window"])
def test_groups_through_pd_are_hf_exact_and_hold_less(tmp_path_factory, moe_model,  # noqa: F811
                                                      name: str) -> None:
    model = _family(name, tmp_path_factory, moe_model)
    cfg = json.loads(Path(model, "config.json").read_text())
    window = cfg["sliding_window"]
    prompts = [random_prompt(n, seed=n) for n in (45, 70)]  # longer than every window
    assert all(len(q) > window + 2 * BS for q in prompts)
    args = dict(block_size=BS, num_kv_blocks=64)
    p = engine(model, "producer", max_num_batched_tokens=12, **args)
    d = engine(model, "consumer", **args)
    try:
        assert d.runner.kv_spec.kv_groups[-1].window == window  # groups are on through P/D
        for cache in d.runner.kv_caches:
            cache.fill_(1e4)
        spec = d.runner.kv_spec
        for rid, prompt in (("a", prompts[0]), ("b", prompts[1]),
                            ("again", prompts[1] + random_prompt(9, seed=3))):
            peak: dict[str, int] = {}
            submit_pair(p, d, rid, prompt, GREEDY, d.kv_endpoint())
            got = _run(p, d, peak)[rid]
            drain(p, d)
            assert d.stats()["kv_fallbacks"] == 0
            assert_greedy_matches(model, prompt, got, hf_greedy(model, prompt, NEW))
            # Bytes held on D at the peak against one table of every layer's pages.
            single = -(-(len(prompt) + NEW) // BS) * spec.token_bytes * BS
            assert peak["d"] * spec.block_bytes < single
            p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()


def test_groups_through_the_shm_pipe_write_each_groups_grant(tmp_path_factory) -> None:
    """Writes in place: D grants each group's blocks (HOLD), P writes a layer into its
    group's; D's shared cache holds each shared tensor once (several layers use it)."""
    model = str(make_model(tmp_path_factory.mktemp("gshm") / "g", **PRESETS["tiny-gemma3"]))
    prompts = [random_prompt(n, seed=n) for n in (45, 70)]
    args = dict(block_size=BS, num_kv_blocks=64, pipe="shm")
    p = engine(model, "producer", max_num_batched_tokens=12, **args)
    d = engine(model, "consumer", **args)
    try:
        for i, prompt in enumerate(prompts + [prompts[1] + random_prompt(9, seed=3)]):
            submit_pair(p, d, f"r{i}", prompt, GREEDY, d.kv_endpoint())
            got = _run(p, d, {})[f"r{i}"]
            drain(p, d)
            assert_greedy_matches(model, prompt, got, hf_greedy(model, prompt, NEW))
        assert d.stats()["kv_fallbacks"] == 0 and d.stats()["kv_digest_failures"] == 0
        assert p.runner.connector.pipe.stats()["shm_writes"] > 0
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()


def test_groups_on_d_through_preemption_and_migration(tmp_path_factory) -> None:
    """D too small for both requests' decodes: one is preempted (recomputed there, with its
    groups); then a request resumed on D from another engine's output (a migration)."""
    model = str(make_model(tmp_path_factory.mktemp("gpre") / "g", **PRESETS["tiny-gemma3"]))
    prompts = [random_prompt(n, seed=n) for n in (40, 45)]
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    p = engine(model, "producer", block_size=BS, num_kv_blocks=64)
    d = engine(model, "consumer", block_size=BS, num_kv_blocks=20, max_num_batched_tokens=16)
    try:
        for i, prompt in enumerate(prompts):
            submit_pair(p, d, f"r{i}", prompt, long, d.kv_endpoint())
        done = _run(p, d, {})
        drain(p, d)
        assert d.scheduler.num_preemptions > 0
        want = [hf_greedy(model, prompt, 24) for prompt in prompts]
        for prompt, got, hf in zip(prompts, (done["r0"], done["r1"]), want):
            assert_greedy_matches(model, prompt, got, hf)
        want = [done["r0"], done["r1"]]
        p.check_no_leaks(), d.check_no_leaks()
        d.add_request("m", prompts[0], long, resume_token_ids=want[0][:7])
        rest: list[int] = []
        while d.has_unfinished_requests():
            for out in d.step():
                rest += out.outputs[0].delta_token_ids
        assert want[0][:7] + rest == want[0]
        d.check_no_leaks()
    finally:
        p.close(), d.close()
