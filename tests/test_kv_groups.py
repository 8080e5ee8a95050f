"""Per-layer-kind block tables (KV cache groups, engine/kv_groups.py): the grouping rule, a
sliding group giving back blocks that left its window, vLLM's prefix-hit rule, and the engine
HF-exact through preemption while holding fewer blocks (more requests at one KV budget)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from pd_cluster.checkpoints.maker import PRESETS, make_model
from pd_cluster.engine import model_runner
from pd_cluster.engine.block_manager import BlockManager
from pd_cluster.engine.input_buffers import InputBuffers
from pd_cluster.engine.kv_groups import NULL_BLOCK, KVCacheGroup, make_groups
from pd_cluster.engine.kv_spec import FullAttentionSpec, SlidingWindowSpec
from pd_cluster.engine.step_input import StepInput
from pd_cluster.llm import LLM
from pd_cluster.request import Request
from pd_cluster.sampling_params import SamplingParams
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt

BS = 4
FULL = FullAttentionSpec(2, 16, torch.float32)


def sliding(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(2, 16, torch.float32, window)


def test_groups_follow_vllms_rule() -> None:
    """Gemma 3 (every sixth layer full, 48 layers): one full and five sliding groups of 8;
    gpt-oss (alternating): one of each; one kind: one group; pages of other shapes: the one
    group of every layer (they cannot share a tensor), as without groups."""
    gemma3 = [FULL if (i + 1) % 6 == 0 else sliding(1024) for i in range(48)]
    groups = make_groups(gemma3)
    assert len(groups) == 6 and all(len(g.layers) == 8 for g in groups)
    assert groups[0] == KVCacheGroup(tuple(range(5, 48, 6)), None)
    assert all(g.window == 1024 for g in groups[1:])
    assert make_groups([sliding(128), FULL] * 2) == (KVCacheGroup((1, 3)),
                                                     KVCacheGroup((0, 2), 128))
    assert make_groups([sliding(24)] * 3) == (KVCacheGroup((0, 1, 2), 24),)
    assert make_groups([FULL] * 3) == (KVCacheGroup((0, 1, 2)),)
    other = SlidingWindowSpec(4, 16, torch.float32, 8)
    assert make_groups([FULL, other]) == (KVCacheGroup((0, 1)),)
    assert make_groups(gemma3, enabled=False) == (KVCacheGroup(tuple(range(48))),)


def _req(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=64))


def _step(bm: BlockManager, r: Request, n: int) -> None:
    """Schedule and compute ``n`` tokens of ``r`` (the scheduler's calls)."""
    if r.num_computed_tokens:
        assert bm.can_append(r, n)
        bm.append_slots(r, n)
    r.num_computed_tokens += n
    bm.cache_full_blocks(r)


GROUPS = (KVCacheGroup((1,)), KVCacheGroup((0,), 6))  # one full layer, one window of 6


def test_sliding_group_releases_blocks_that_left_its_window() -> None:
    bm = BlockManager(num_blocks=32, block_size=BS, groups=GROUPS)
    r = _req(random_prompt(20, seed=1))
    assert bm.num_free_blocks == 31  # block 0 is the null block
    bm.allocate(r, max_new_tokens=8)  # the first chunk only: 8 tokens, 2 sliding blocks
    assert [len(t) for t in r.group_block_ids] == [5, 2]
    _step(bm, r, 8)
    _step(bm, r, 12)  # the prompt done; the next query (20) sees tokens 15..20
    full, window = r.group_block_ids
    assert len(full) == 5 and NULL_BLOCK not in full
    assert window[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in window[3:]
    for _ in range(6):  # decode: the window slides on
        r.output_token_ids.append(7)
        _step(bm, r, 1)
    assert window[:5] == [NULL_BLOCK] * 5 and len(window) == 7
    assert bm.num_used_blocks == 7 + 2
    bm.free(r)
    bm.check_no_leaks()


def test_a_prefix_hit_needs_each_sliding_groups_window_tail() -> None:
    """vLLM's rule: a hit is as long as the full group's match, shortened to where the
    sliding group still holds the blocks the next query's window reaches."""
    bm = BlockManager(num_blocks=64, block_size=BS, groups=GROUPS)
    prompt = random_prompt(24, seed=2)
    a = _req(prompt, "a")
    bm.allocate(a)
    _step(bm, a, 24)
    bm.free(a)  # every block cached, free
    b = _req(prompt + [5])
    assert bm.num_cached_tokens(b) == 24
    # The sliding group's block 3 is evicted: a hit at 24 (window from token 19, block 4)
    # still works; at 16 it would need block 3. Evict block 4 too: the longest hit whose
    # window's tail is held is 12 (window from token 7: blocks 1 and 2).
    evict = {a.block_hashes[i] for i in (3, 4)}
    for (k, h), block in list(bm.hash_to_block.items()):
        if k == 1 and h in evict:
            del bm.hash_to_block[(k, h)]
    assert bm.num_cached_tokens(b) == 12
    cached = bm.allocate(b)
    assert cached == 12
    full, window = b.group_block_ids
    assert window[:1] == [NULL_BLOCK] and NULL_BLOCK not in full
    _step(bm, b, 13)
    bm.free(b)
    bm.check_no_leaks()


def test_preemption_frees_every_group() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, groups=GROUPS)
    r = _req(random_prompt(10, seed=3))
    bm.allocate(r)
    _step(bm, r, 10)
    assert bm.num_used_blocks == 3 + 2
    bm.free(r)  # what the scheduler's preemption does
    assert r.group_block_ids == [] and bm.num_used_blocks == 0
    bm.check_no_leaks()


def test_input_buffers_carry_each_groups_tables_and_slots() -> None:
    """Each group's layers write and read through that group's table: one slot mapping and
    one table tensor per group, in one metadata per group."""
    step = StepInput(tokens=[1, 2], positions=[8, 9], query_start=[0, 2], seq_lens=[10],
                     block_tables=[[3, 4, 5]], num_decodes=0, prompt_lens=[10],
                     group_tables=[[[NULL_BLOCK, NULL_BLOCK, 7]]])
    buffers = InputBuffers(4, 2, 2, BS, torch.device("cpu"), num_groups=2)
    t = buffers.prepare(step)
    full, window = t.group_metas
    assert full is t.meta and full.slot_mapping.tolist() == [20, 21]
    assert window.slot_mapping.tolist() == [28, 29]
    assert window.block_tables.tolist() == [[0, 0, 7]]
    assert full.block_tables.tolist() == [[3, 4, 5]]


def test_a_request_is_refused_only_beyond_every_groups_worst_case() -> None:
    """A sliding group holds at most its window and a chunk: a request longer than the pool
    fits where only full-attention layers keep every block."""
    bm = BlockManager(num_blocks=16, block_size=BS, groups=GROUPS)
    # 40 tokens: the full group 10 blocks, the window (6) + a chunk of 4: 4 blocks at most
    assert bm.blocks_held_at_most(40, 4) == 10 + 4 <= bm.num_usable_blocks
    assert BlockManager(num_blocks=16, block_size=BS).blocks_held_at_most(80, 4) == 20


# ---- the engine ---------------------------------------------------------------------------
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("groups")
    return {name: str(make_model(root / name, **PRESETS[name]))
            for name in ("tiny-gemma3", "tiny-mistral-window")}


def _run(model_dir: str, prompts: list[list[int]], budget: int) -> tuple[LLM, dict[str, Any]]:
    """Every prompt at once through one engine of ``budget`` KV bytes; the peak number of
    requests running together and the outputs."""
    llm = LLM(model=model_dir, block_size=8, max_num_batched_tokens=32, max_num_seqs=32,
              kv_cache_memory=budget, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs, peak, peak_used = {}, 0, 0
    for _ in range(2000):  # bounded: far more steps than the work needs
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        peak = max(peak, len(engine.scheduler.running))
        peak_used = max(peak_used, engine.block_manager.num_used_blocks)
    engine.check_no_leaks()  # every group's blocks free
    return llm, {"outs": outs, "peak": peak, "preemptions": engine.scheduler.num_preemptions}


@pytest.mark.parametrize("name, blocks", [("tiny-gemma3", 26), ("tiny-mistral-window", 12)])
def test_engine_hf_exact_with_preemption_and_more_requests_at_one_budget(
        models: dict[str, str], name: str, blocks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts longer than every window (16, 24), chunked, at a KV budget that preempts:
    HF-exact with groups, and more requests run together than with every layer holding
    every block (the same budget, groups off)."""
    model_dir = models[name]
    prompts = [random_prompt(40 + 3 * i, seed=i) for i in range(8)]
    budget = blocks * 8 * 2 * 2 * 16 * 4 * 2  # blocks of 8 tokens of both layers (fp32)
    llm, grouped = _run(model_dir, prompts, budget)
    assert len(llm.engine.block_manager.groups) == (2 if name == "tiny-gemma3" else 1)
    assert grouped["preemptions"] > 0  # the budget is tight enough to preempt
    for i, p in enumerate(prompts):
        assert_greedy_matches(model_dir, p, grouped["outs"][str(i)],
                              hf_greedy(model_dir, p, MAX_TOKENS))
    monkeypatch.setattr(model_runner, "groups_enabled", lambda config: False)
    llm, whole = _run(model_dir, prompts, budget)
    assert len(llm.engine.block_manager.groups) == 1
    assert llm.engine.block_manager.groups[0].window is None
    assert grouped["peak"] > whole["peak"], (grouped, whole)
    assert whole["outs"] == grouped["outs"]
