"""An engine killed while its requests restore their histories from the KV tiers (issue 32).

1P1D on Ray, tiny device pools (histories are evicted between turns), a small host tier
spilling to a disk tier (a directory per engine). Six conversations come back at once with long
replies; once the decode engine has restored blocks from its tiers and streams are under way,
its process is SIGKILLed. Every request still completes (migrated or retried, as the failure
rules say) with the offline engine's tokens; the restarted decode engine indexes its previous
incarnation's disk files and restores the next turn's histories from them (verified: that turn
is exact again); nothing is left held anywhere (device blocks, host slots).
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
from typing import Any

import httpx
import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.serving.cluster.cluster_config import resolve_model
from pd_cluster.serving.cluster.testing import (cluster_status, leak_reports, wait_idle,
                                                wait_until)
from tests.launch_helpers import launched_cluster, stream_completion

MODEL = "tiny-llama"
BLOCK_BYTES = 4 * 2 * 16 * 2 * 32 * 4  # tiny-llama: layers x K,V x tokens x kv heads x dim x fp32
CONVERSATIONS = 6

pytestmark = pytest.mark.timeout(900)  # a Ray cluster's start-up counts in the first test


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    disk = str(tmp_path_factory.mktemp("kv-disk"))
    yield from launched_cluster(
        tmp_path_factory, "local", "tierkill",
        engine={"num_kv_blocks": 24, "max_model_len": 384,
                "kv_offloading_size": 16 * BLOCK_BYTES / 2**30,  # 16 blocks: spills to disk
                "kv_offloading_disk": {"path": disk, "size": 0.05}},
        kv_transfer={"kv_transfer_timeout": 5.0},
        # always through P: both engines restore (P its prefill's history, D its own)
        proxy={"request_timeout": 120.0, "health_check_timeout": 5.0,
               "disaggregation": "always", "cache_events_interval": 0.1})


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=resolve_model(MODEL), num_kv_blocks=256, max_model_len=384)


def _greedy(offline: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in offline.generate(prompts, [params] * len(prompts))]


def _turn(url: str, prompts: list[list[int]], max_tokens: int, expected: list[list[int]]
          ) -> list[list[int]]:
    async def run() -> list[tuple[str, list[int], str | None]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            return await asyncio.gather(*(stream_completion(http, MODEL, p, max_tokens)
                                           for p in prompts))
    results = asyncio.run(run())
    for i, ((outcome, ids, err), ref) in enumerate(zip(results, expected)):
        assert outcome == "ok" and ids == ref, (i, outcome, err)
    return [ids for _, ids, _ in results]


def _engine(url: str, name: str) -> dict[str, Any]:
    return next(e for e in cluster_status(url)["engines"] if e["name"] == name)


def _restored(stats: dict[str, Any]) -> int:
    """Blocks the engine restored from its lower tiers (host hits and disk hits)."""
    return stats.get("kv_offload_hit_blocks_host", 0) + stats.get("kv_offload_hit_blocks_disk", 0)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


def test_decode_killed_mid_restore_loses_nothing_and_holds_nothing(cluster, offline) -> None:
    import ray

    rng = random.Random(11)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, 500) for _ in range(n)]

    # Turn 1 of every conversation, then fillers that push every history out of both
    # engines' 24-block device pools (into the host tier, the oldest on to disk).
    prompts = [tokens(48) for _ in range(CONVERSATIONS)]
    replies = _turn(cluster.url, prompts, 16, _greedy(offline, prompts, 16))
    fillers = [tokens(104) for _ in range(4)]
    _turn(cluster.url, fillers, 8, _greedy(offline, fillers, 8))
    turn2 = [p + r + tokens(16) for p, r in zip(prompts, replies)]
    expected2 = _greedy(offline, turn2, 160)  # 15 blocks each: D runs them one or two at once

    d0 = _engine(cluster.url, "decode-0")
    old_pid, restored_before = d0["pid"], _restored(d0["stats"])
    migrations_before = _metric(cluster.url, "pd_migrations_total")

    async def run() -> list[tuple[str, list[int], str | None]]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as http:
            first = asyncio.Event()
            tasks = [asyncio.create_task(stream_completion(http, MODEL, p, 160, first))
                     for p in turn2]
            await asyncio.wait_for(first.wait(), 120)  # D is streaming a returning turn

            def restoring() -> bool:
                # the engine's own stats (a step old at most, not the last health check's)
                st = ray.get(cluster.engines["decode-0"].stats.remote(), timeout=10)
                more = st["num_running"] + st["num_waiting"] + st["num_waiting_for_remote_kv"]
                return _restored(st) > restored_before and more > 1
            # D restored history blocks from its tiers, and has more returning turns to run
            await asyncio.to_thread(wait_until, restoring, 60, "decode-0 restoring from its "
                                    "KV tiers with more turns to come", 0.02)
            assert not all(t.done() for t in tasks), "every turn ended before the kill"
            os.kill(old_pid, signal.SIGKILL)  # Ray restarts it (max_restarts)
            return await asyncio.wait_for(asyncio.gather(*tasks), 240)

    for i, ((outcome, ids, err), ref) in enumerate(zip(asyncio.run(run()), expected2)):
        assert outcome == "ok" and ids == ref, (i, outcome, err)
    assert _metric(cluster.url, "pd_migrations_total") > migrations_before

    def restarted() -> dict[str, Any] | None:
        d = _engine(cluster.url, "decode-0")
        return d if d["healthy"] and d["pid"] != old_pid and d["restarts"] >= 1 else None
    d0 = wait_until(restarted, 120, "decode-0 restarted by Ray and healthy again", 0.5)
    # The new incarnation indexed the files its predecessor left in its disk directory;
    # whatever it restores from them is verified (turn 3 is exact).
    assert d0["stats"]["kv_offload_disk_blocks_used"] > 0
    assert _restored(d0["stats"]) == 0

    # Turn 3 of every conversation through the surviving P and the restarted D, exact ...
    turn3 = [p + ids + tokens(16) for p, ids in zip(turn2, expected2)]
    _turn(cluster.url, turn3, 16, _greedy(offline, turn3, 16))
    # ... restoring the histories from its predecessor's files (its host tier started empty)
    assert _engine(cluster.url, "decode-0")["stats"]["kv_offload_hit_blocks_disk"] > 0

    st = wait_idle(cluster.url, timeout=60)  # P's blocks for the dead D free after the timeout
    assert all(e["stats"]["kv_blocks_used"] == 0 for e in st["engines"])
    assert leak_reports(cluster) == {}
