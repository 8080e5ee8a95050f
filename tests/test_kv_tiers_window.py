"""The KV tiers (host, and disk behind it) with a windowed model and its KV cache groups (issue
43): a history longer than the sliding window, evicted from the device pool, comes back from
the lower tier per group -- the full group's every block, the sliding group's window tail only
(each group's page of a block is its own tier entry: group_hits.tier_key) -- and the output
stays token-exact with HF (greedy fp32). Every engine ends with a leak check (the pool every
group shares, and the host slots)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.checkpoints.maker import PRESETS, make_model
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt

BS = 8
NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Sliding (window 16) and full layers: two KV cache groups where groups are on."""
    return str(make_model(tmp_path_factory.mktemp("tw") / "tiny-gemma3",
                          **PRESETS["tiny-gemma3"]))


def _generate(llm: LLM, model: str, prompt: list[int]) -> Any:
    out = llm.generate([prompt], [GREEDY])[0]
    assert_greedy_matches(model, prompt, out.outputs[0].token_ids, hf_greedy(model, prompt, NEW))
    return out


@pytest.mark.parametrize("tier,tp", [("host", 1), ("disk", 1), ("host", 2)])
def test_windowed_history_evicted_comes_back_from_the_tier_exactly(gemma3: str, tmp_path: Path,
                                                                    tier: str, tp: int) -> None:
    """At TP 2 each rank saves and loads its own heads' page of every group's block."""
    probe = LLM(model=gemma3, block_size=BS, num_kv_blocks=16, kv_offloading_size=1 / 1024)
    block_bytes = probe.engine.runner.kv_spec.block_bytes  # every head: one rank at TP 1
    probe.close()
    # disk: a host tier of 8 blocks: the history is pushed on to the disk tier
    host_blocks = 64 if tier == "host" else 8
    disk = {"path": str(tmp_path / "kv"), "size": 256 * (block_bytes + 4096) / 2**30} \
        if tier == "disk" else None
    llm = LLM(model=gemma3, block_size=BS, num_kv_blocks=20, tensor_parallel_size=tp,
              kv_offloading_size=host_blocks * block_bytes / 2**30, kv_offloading_disk=disk)
    try:
        groups = llm.engine.block_manager.groups
        assert [g.window for g in groups] == [None, 16]  # groups stay on with the tiers
        turn1 = random_prompt(40, seed=1)  # 40 > the window of 16
        out1 = _generate(llm, gemma3, turn1).outputs[0].token_ids
        for seed in (2, 3, 4):  # push turn 1's blocks out of the 20-block pool
            _generate(llm, gemma3, random_prompt(60, seed=seed))
        tiers = llm.engine.block_manager.tiers
        if tiers.disk is not None:
            assert tiers.disk.wait_idle(30.0)
        before = llm.engine.stats()
        turn2 = turn1 + out1 + random_prompt(16, seed=5)
        out = _generate(llm, gemma3, turn2)
        after = llm.engine.stats()
        # Turn 1 computed 40 + 5 tokens: 5 full blocks, evicted from the device since. The
        # hit serves 40 tokens: the full group's 5 blocks and the sliding group's blocks 3, 4
        # (the next query, at 40, sees tokens 25..40), all from the lower tiers.
        assert out.num_cached_tokens == 5 * BS
        hits = sum(after[f"kv_offload_hit_blocks_{t}"] - before[f"kv_offload_hit_blocks_{t}"]
                   for t in ("host", "disk"))
        assert hits == 5 + 2
        assert after[f"kv_offload_hit_blocks_{tier}"] > before[f"kv_offload_hit_blocks_{tier}"]
        assert after["prefix_cache_hit_blocks"] == before["prefix_cache_hit_blocks"]
        llm.engine.check_no_leaks()
    finally:
        llm.close()


def test_a_lost_lower_tier_block_cuts_the_hit_to_what_every_group_still_serves() -> None:
    """allocate() claims lower-tier blocks entry by entry; one lost at entry 4 (a corrupt disk
    file) ends the hit at the longest length whose window tail the sliding group holds."""
    from pd_cluster.engine.group_hits import cut_hits
    from pd_cluster.engine.kv_groups import NULL_BLOCK as N
    from pd_cluster.engine.kv_groups import KVCacheGroup
    groups = (KVCacheGroup((1,)), KVCacheGroup((0,), 16))
    full = [11, 12, 13, 14, None]
    m, tables = cut_hits(groups, [full, [N, N, 22, 23, None]], 4, BS)
    assert m == 4 and tables == [full[:4], [N, N, 22, 23]]  # the query at 32 sees 17..32
    m, tables = cut_hits(groups, [full, [N, N, N, 23, None]], 4, BS)
    assert m == 0 and tables == [[], []]  # no shorter hit has its window's blocks
