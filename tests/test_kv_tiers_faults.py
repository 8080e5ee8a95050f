"""The KV tiers under faults (issue 32): a disk path that cannot be written and a host tier
larger than the node's available memory (start-up errors naming the field), a disk directory
removed at run time and a full disk (misses; dropped, counted writes reported to routing;
never an exception in the step, never a partial file), engines of a cluster in disk
directories of their own, a disk miss in the middle of a prefix match while the pool is
tight; and in whole engines: preemption of requests that restored from host, several
requests restoring one prefix in the same step, a client abort of a request whose restore
ran, a decode engine's KV fallback after it restored part of the prompt from its own tier,
and a step that raises while restoring. Outputs are checked against HF (greedy fp32) and
every engine ends with a leak check (device blocks and host slots)."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.engine.block_manager import BlockManager
from pd_cluster.engine.kv_tiers.disk import HEADER, DiskTier
from pd_cluster.engine.kv_tiers.manager import TierManager
from pd_cluster.request import Request
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt

BS = 8
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # tiny default model: layers x K,V x tokens x heads x dim x fp32
FILE_BYTES = HEADER.size + 4 * BS + BLOCK_BYTES
NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def tiered_llm(model: str, disk: Path | None = None, host_blocks: int = 64, pool: int = 16,
               **kw) -> LLM:
    extra = ({"kv_offloading_disk": {"path": str(disk), "size": 128 * FILE_BYTES / 2**30}}
             if disk is not None else {})
    return LLM(model=model, block_size=BS, num_kv_blocks=pool,
               kv_offloading_size=host_blocks * BLOCK_BYTES / 2**30, **extra, **kw)


def check(model: str, prompts: list[list[int]], outputs: list) -> None:
    for prompt, out in zip(prompts, outputs):
        assert_greedy_matches(model, prompt, out.outputs[0].token_ids,
                              hf_greedy(model, prompt, NEW))


def push_out(llm: LLM, model: str, seeds: tuple[int, ...] = (2, 3, 4)) -> None:
    """Fillers (60 tokens each) that evict what a 16-block device pool held."""
    prompts = [random_prompt(60, seed=s) for s in seeds]
    for p in prompts:
        check(model, [p], llm.generate([p], [GREEDY]))


def history(llm: LLM, model: str, seed: int = 1) -> list[int]:
    """Turn 1 (40 tokens) of a conversation; returns turn 2's prompt (history + 16 tokens)."""
    turn1 = random_prompt(40, seed=seed)
    out = llm.generate([turn1], [GREEDY])
    check(model, [turn1], out)
    return turn1 + list(out[0].outputs[0].token_ids) + random_prompt(16, seed=seed + 100)


# ---------------------------------------------------------------------------- the disk

def _tier(path: Path, capacity: int = 8) -> DiskTier:
    return DiskTier(str(path), capacity * (HEADER.size + 4 * BS + 64) / 2**30, b"F" * 16,
                    BS, payload_bytes=64)


def test_an_unwritable_disk_path_is_a_start_up_error_naming_the_field(tiny_model,
                                                                      tmp_path) -> None:
    # /proc/self exists but takes no files (even for root, who ignores directory modes)
    with pytest.raises(ValueError, match=r"kv_offloading_disk\.path: cannot use '/proc/self'"):
        _tier(Path("/proc/self"))
    afile = tmp_path / "a-file"
    afile.write_text("x")
    with pytest.raises(ValueError, match=r"kv_offloading_disk\.path"):
        tiered_llm(tiny_model(), disk=afile / "kv")


def test_a_host_tier_the_node_cannot_hold_is_a_start_up_error(tiny_model) -> None:
    from pd_cluster.engine.kv_tiers.setup import available_host_bytes
    available = available_host_bytes()
    if available is None:
        pytest.skip("no MemAvailable in /proc/meminfo on this system")
    with pytest.raises(ValueError, match=r"kv_offloading_size: .* GiB available"):
        LLM(model=tiny_model(), block_size=BS, num_kv_blocks=16,
            kv_offloading_size=2 * available / 2**30)


def test_a_full_disk_drops_the_write_counts_it_and_leaves_no_partial_file(tmp_path) -> None:
    tier = _tier(tmp_path)
    full = {"on": True}

    def write_bytes(path: Path, data: bytes) -> None:
        if full["on"]:
            path.write_bytes(data[:len(data) // 2])  # part of it went, then the disk was full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        path.write_bytes(data)
    tier._write_bytes = write_bytes
    try:
        tok = (7,) * BS
        tier.admit(7, tok)
        tier.write(7, tok, b"\x07" * 64)
        assert tier.wait_idle(10.0)
        assert tier.write_errors == 1 and tier.saved_blocks == 0
        assert list(tmp_path.iterdir()) == []  # no partial temporary file left
        assert not tier.has(7, tok) and tier.hashes() == []  # a miss, not a failed read
        assert tier.stats()["kv_offload_disk_write_errors"] == 1
        full["on"] = False  # space again: the next write of the block lands
        tier.admit(7, tok)
        tier.write(7, tok, b"\x07" * 64)
        assert tier.wait_idle(10.0)
        assert tier.has(7, tok) and tier.read(7, tok) == bytearray(b"\x07" * 64)
    finally:
        tier.close()


def test_a_failed_write_leaves_the_routers_view_of_the_lower_tiers(tmp_path) -> None:
    """The proxy routes by the lower tiers' events: a block whose disk write failed (and that
    the host tier no longer holds) is reported gone."""
    disk = _tier(tmp_path)
    tiers = TierManager(1, block_bytes=64, disk=disk)
    events: list[tuple[bool, int]] = []
    tiers.on_event = lambda stored, h: events.append((stored, h))

    def write_bytes(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    disk._write_bytes = write_bytes
    try:
        tiers.on_evict(0, 1, (1,) * BS)  # hash 1 saved to the host slot
        tiers.take_ops()
        tiers.on_evict(1, 2, (2,) * BS)  # hash 2 takes the slot: hash 1 spills to disk
        ops = tiers.take_ops()
        assert [s.block_hash for s in ops.spills] == [1]
        disk.write(1, (1,) * BS, b"\x01" * 64)  # what the step does with the spill: it fails
        assert disk.wait_idle(10.0)
        assert not tiers.has(1, (1,) * BS)
        assert events == [(True, 1), (True, 2), (False, 1)]
        assert tiers.lower_cached_hashes() == [2]
    finally:
        disk.close()


def test_each_engine_of_a_cluster_has_its_own_disk_directory(tmp_path) -> None:
    from pd_cluster.serving.cluster.cluster_config import parse_config
    cfg = parse_config({"prefill": {"replicas": 2}, "engine": {
        "kv_offloading_size": 0.01, "kv_offloading_disk": {"path": str(tmp_path), "size": 1}}})
    paths = {s.name: s.engine_args["kv_offloading_disk"]["path"] for s in cfg.engine_specs()}
    assert paths == {n: str(tmp_path / n) for n in ("prefill-0", "prefill-1", "decode-0")}
    assert cfg.engine["kv_offloading_disk"]["path"] == str(tmp_path)  # the section unchanged


def test_temporary_files_of_dead_writers_are_removed_at_start(tmp_path) -> None:
    dead = tmp_path / f"{5:016x}.999999999.tmp"  # no such pid
    live = tmp_path / f"{6:016x}.{os.getpid()}.tmp"  # a live writer sharing the directory
    old = tmp_path / f"{7:016x}.tmp"  # the earlier naming
    for f in (dead, live, old):
        f.write_bytes(b"partial")
    _tier(tmp_path).close()
    assert sorted(tmp_path.iterdir()) == [live]


def test_disk_directory_removed_at_run_time_gives_misses_then_recovers(tiny_model,
                                                                       tmp_path) -> None:
    model = tiny_model()
    llm = tiered_llm(model, disk=tmp_path / "kv", host_blocks=8)
    try:
        turn2 = history(llm, model)
        push_out(llm, model)  # the history went to disk (8 host slots)
        disk = llm.engine.block_manager.tiers.disk
        assert disk.wait_idle(30.0) and disk.saved_blocks > 0
        shutil.rmtree(tmp_path / "kv")
        out = llm.generate([turn2], [GREEDY])  # no exception: what was on disk is a miss
        check(model, [turn2], out)
        assert llm.engine.stats()["kv_offload_disk_misses"] >= 1
        push_out(llm, model, seeds=(5, 6, 7))  # the writer makes the directory again
        assert disk.wait_idle(30.0) and (tmp_path / "kv").is_dir()
        before = llm.engine.stats()["kv_offload_hit_blocks_disk"]
        out = llm.generate([turn2], [GREEDY])
        check(model, [turn2], out)
        assert llm.engine.stats()["kv_offload_hit_blocks_disk"] > before
        llm.engine.check_no_leaks()
    finally:
        llm.close()


def test_a_disk_miss_mid_match_never_takes_more_blocks_than_admission_counted(
        tmp_path) -> None:
    """Blocks [host, disk, device held by another request]: the disk block is a miss in
    allocate() (no host slot for it this step), so the held device hit after it cannot be
    used either. Admission counted that worst case: no allocation from an empty pool."""
    tiers = TierManager(1, block_bytes=64, disk=_tier(tmp_path))
    bm = BlockManager(7, BS, tiers=tiers)
    params = SamplingParams(max_tokens=1)
    prompt = random_prompt(3 * BS + 1, seed=9)

    def req(rid: str, tokens: list[int]) -> Request:
        return Request(rid, tokens, params)

    def compute(r: Request) -> None:
        bm.allocate(r)
        r.num_computed_tokens = r.num_tokens
    try:
        # x and r arrive together and share 2 blocks: x registers them, r only its third
        x, r = req("x", prompt[:2 * BS + 1]), req("r", prompt)
        compute(x)
        compute(r)
        bm.cache_full_blocks(x)
        bm.cache_full_blocks(r)
        bm.free(x)  # x's blocks are the only free ones: 2 of them hashed
        f = req("f", random_prompt(2 * BS, seed=10))
        bm.allocate(f)  # evicts x's block 1 (to host) and its partial block
        tiers.take_ops()
        g = req("g", random_prompt(BS - 1, seed=11))
        bm.allocate(g)  # evicts x's block 0: to host, pushing block 1 on to disk
        tiers.take_ops()
        bm.free(f)
        bm.free(g)
        assert bm.num_free_blocks == 3
        q = req("q", prompt)  # block 0 on host, 1 on disk (and 1 host slot), 2 held by r
        assert not bm.can_allocate(q)
        bm.free(r)
        assert bm.can_allocate(q)
        assert bm.allocate(q) == BS  # block 0 restored; the disk block could not be had
        tiers.take_ops()
        bm.free(q)
        bm.check_no_leaks()
    finally:
        tiers.disk.close()


# ---------------------------------------------------------------------------- whole engines

def test_requests_that_restored_from_host_are_preempted_and_come_back_exact(tiny_model) -> None:
    """Three returning turns (8 blocks of prompt each, 5 restored) growing by 40 tokens in a
    16-block pool: they preempt one another (recompute: their prefixes come back from the
    device cache or the host tier again) and still end exactly."""
    model = tiny_model()
    llm = tiered_llm(model)
    try:
        turns = [history(llm, model, seed=s) for s in (1, 2, 3)]
        push_out(llm, model)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        before = llm.engine.stats()
        outs = llm.generate(turns, [params] * 3)
        after = llm.engine.stats()
        assert after["num_preemptions"] > before["num_preemptions"]
        assert after["kv_offload_hit_blocks_host"] - before["kv_offload_hit_blocks_host"] >= 15
        for prompt, out in zip(turns, outs):
            assert_greedy_matches(model, prompt, out.outputs[0].token_ids,
                                  hf_greedy(model, prompt, 40))
        llm.engine.check_no_leaks()
    finally:
        llm.close()


def test_identical_requests_restore_one_prefix_in_the_same_step(tiny_model) -> None:
    """Two copies of a returning turn arrive together (what n > 1 choices are to an engine;
    8 blocks of prompt each: two fit the pool at once): each loads the same host slots into
    blocks of its own in one step; both equal HF."""
    model = tiny_model()
    llm = tiered_llm(model)
    try:
        turn2 = history(llm, model)
        push_out(llm, model)
        before = llm.engine.stats()["kv_offload_hit_blocks_host"]
        outs = llm.generate([turn2] * 2, [GREEDY] * 2)
        assert llm.engine.stats()["kv_offload_hit_blocks_host"] - before == 2 * 5
        assert all(o.num_cached_tokens == 5 * BS for o in outs)
        check(model, [turn2] * 2, outs)
        llm.engine.check_no_leaks()
    finally:
        llm.close()


def test_aborting_a_request_mid_restore_frees_blocks_and_host_slots(tiny_model) -> None:
    """Chunked prefill (8 tokens a step): a returning turn is aborted after the step that
    restored its history, mid-prefill. Its blocks and host slots are free, the host tier still
    holds the history, and the turn sent again restores it and equals HF."""
    model = tiny_model()
    llm = tiered_llm(model, max_num_batched_tokens=8)
    engine = llm.engine
    try:
        turn2 = history(llm, model)
        push_out(llm, model)
        engine.add_request("gone", turn2, GREEDY)
        before = engine.stats()["kv_offload_hit_blocks_host"]
        engine.step()  # admitted: 5 blocks restored, the first chunk computed
        assert engine.stats()["kv_offload_hit_blocks_host"] - before == 5
        assert not engine.scheduler.requests["gone"].is_finished
        engine.abort_request(["gone"])
        engine.check_no_leaks()
        out = llm.generate([turn2], [GREEDY])
        # the history (now on the device again) and the chunk computed before the abort
        assert out[0].num_cached_tokens == 6 * BS
        check(model, [turn2], out)
        engine.check_no_leaks()
    finally:
        llm.close()


def test_decode_falls_back_after_restoring_part_of_the_prompt(tiny_model) -> None:
    """A decode engine restores a returning turn's history from its host tier and waits for
    the rest from a producer that never sends it: after kv_transfer_timeout it prefills the
    prompt itself (a counted fallback) and the answer equals HF; nothing is left held."""
    from connectors.transfer_params import RecvKV
    from tests.pd_helpers import engine as pd_engine

    model = tiny_model()
    d = pd_engine(model, "consumer", timeout=1.0, block_size=BS, num_kv_blocks=16,
                  kv_offloading_size=64 * BLOCK_BYTES / 2**30)
    try:
        def run(rid: str, prompt: list[int], kv: RecvKV | None = None) -> list[int]:
            d.add_request(rid, prompt, GREEDY, kv)
            while d.has_unfinished_requests():  # bounded by kv_transfer_timeout
                for out in d.step():
                    if out.finished:
                        return list(out.outputs[0].token_ids)
            raise AssertionError(f"{rid} never finished")

        turn1 = random_prompt(40, seed=1)  # D computes turn 1 and the fillers by itself
        reply = run("t1", turn1)
        for i, seed in enumerate((2, 3, 4)):
            run(f"f{i}", random_prompt(60, seed=seed))
        turn2 = turn1 + reply + random_prompt(16, seed=101)
        before = d.stats()
        got = run("t2", turn2, RecvKV())
        after = d.stats()
        assert after["kv_fallbacks"] == before["kv_fallbacks"] + 1
        assert after["kv_offload_hit_blocks_host"] - before["kv_offload_hit_blocks_host"] >= 5
        assert_greedy_matches(model, turn2, got, hf_greedy(model, turn2, NEW))
        d.check_no_leaks()
    finally:
        d.close()


def test_a_step_that_fails_while_restoring_ends_its_requests_with_an_engine_error(
        tiny_model) -> None:
    """The restore's copies raise inside the step (the step's ops were already taken): the
    engine loop ends every active request with an engine error (the proxy retries or migrates
    them) and reports the engine fatal (the actor exits and Ray starts a fresh one: a host
    tier whose ops half ran is never used again)."""
    import gc
    import threading

    from pd_cluster.driver.engine_loop import EngineLoop
    from pd_cluster.driver.messages import ERROR_ENGINE, EngineRequest

    model = tiny_model()
    llm = tiered_llm(model)
    store = llm.engine.runner.tier_store
    try:
        turn2 = history(llm, model)
        push_out(llm, model)
        run_ops = store.execute

        def failing(ops):
            if ops is not None and ops.loads:
                raise RuntimeError("host tier copy failed")
            run_ops(ops)
        store.execute = failing
        deltas, fatal = [], threading.Event()
        loop = EngineLoop(llm.engine, deltas.extend, lambda e: fatal.set())
        loop.start()
        try:
            loop.submit(EngineRequest("t2", turn2, GREEDY))
            assert fatal.wait(30.0), "the engine loop never reported the failure"
        finally:
            loop.stop()
            gc.unfreeze()  # the loop froze this process's objects for the engine's lifetime
        [end] = [d for d in deltas if d.request_id == "t2"]
        assert end.finished and end.error_type == ERROR_ENGINE
        assert "host tier copy failed" in end.error
    finally:
        llm.close()
