"""CUDA graphs for decode (engine.cuda_graphs, issues 28 and 38): on the CPU, the batch-size and
context-bucket ladders, the graph a step replays (a pure function), the capture loop's bound
and failure, and the capture agreed across two tensor-parallel ranks (a real Gloo group of two
processes, the captures faked); on a GPU, replays per bucket HF-exact and equal to launching op
by op, compiled and eager. Off by default until scripts/gpu_check.sh passes on a GPU."""
from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pd_cluster.config import EngineArgs
from pd_cluster.engine.cuda_graphs import (DecodeGraphs, batch_ladder, capture_order,
                                           capture_within, context_ladder, pick_graph,
                                           pool_bound)
from pd_cluster.llm import LLM
from pd_cluster.models.layers.tp import TPGroup
from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.cluster.config_reference import render
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt

MAX_TOKENS = 12


def test_off_by_default_and_the_reference_says_why() -> None:
    assert EngineArgs().cuda_graphs is False
    row = next(ln for ln in render().splitlines() if ln.startswith("| `engine.cuda_graphs`"))
    assert "`false`" in row and "gpu_check.sh" in row, row


def test_ladder_covers_every_batch_size_up_to_the_limit() -> None:
    assert batch_ladder(1) == [1]
    assert batch_ladder(6) == [1, 2, 4, 6]
    ladder = batch_ladder(200)
    assert ladder[:5] == [1, 2, 4, 8, 16] and ladder[-1] == 200
    assert all(b - a <= 16 for a, b in zip(ladder, ladder[1:]))


def test_context_buckets_are_powers_of_two_up_to_the_model_length() -> None:
    assert context_ladder(2048) == [256, 512, 1024, 2048]
    assert context_ladder(3000) == [256, 512, 1024, 2048, 3000]
    assert context_ladder(100) == [100]
    assert context_ladder(256) == [256]
    assert context_ladder(40, smallest=8) == [8, 16, 32, 40]


def test_pick_is_the_smallest_fitting_graph() -> None:
    sizes, buckets = batch_ladder(24), context_ladder(2048)
    every = capture_order(sizes, buckets)
    assert every[0] == (24, 2048) and every[-1] == (1, 256)  # largest first
    for n in range(1, 25):
        for seq in (1, 255, 256, 257, 600, 1024, 1025, 2047, 2048):
            bs, bucket = pick_graph(n, seq, every)
            assert bs == min(s for s in sizes if s >= n)
            assert bucket == min(c for c in buckets if c >= seq)  # not the model's length
    assert pick_graph(25, 10, every) is None  # more decodes than any graph: eager
    assert pick_graph(1, 2049, every) is None
    # The pool's bound cut off the small graphs (a prefix of the order was captured): the
    # step replays a larger one, and never one too small for it.
    some = every[:len(buckets) * 2 + 1]  # (24, *), (16, *), (8, 2048)
    assert pick_graph(3, 300, some) == (8, 2048)  # fewer padding rows first
    assert pick_graph(9, 300, some) == (16, 512)
    assert pick_graph(17, 2048, some) == (24, 2048)
    assert pick_graph(8, 2000, some) == (8, 2048)


def test_capture_stops_at_a_failure_or_at_the_pool_bound() -> None:
    keys = capture_order([1, 2, 4], [256, 512])
    used = [0]

    def capture(key: tuple[int, int]) -> None:
        if key == keys[3]:
            raise RuntimeError("operation not permitted when stream is capturing")
        used[0] += 100

    assert capture_within(keys, capture, lambda: used[0], 10_000) == (False, 3)
    used[0] = 0
    assert capture_within(keys[:3], capture, lambda: used[0], 10_000) == (True, 3)
    used[0] = 0
    assert capture_within(keys[:3], capture, lambda: used[0], 150) == (True, 2)
    assert abs(pool_bound(80 << 30, 0.9) - (4 << 30)) <= 1  # half of the 10% left
    assert pool_bound(8 << 30, 0.99) == 256 << 20


# ---- agreement across two TP ranks: a Gloo group of two processes ----------------------------

SCENARIOS: list[tuple[str, dict, dict]] = [  # name, rank 0's faults, rank 1's
    ("all captured", {}, {}),
    ("rank 1's third capture fails", {}, {"fail_at": 2}),
    ("rank 0's first capture fails", {"fail_at": 0}, {}),
    ("warm-up fails on every rank", {"fail_warmup": True}, {"fail_warmup": True}),
    ("bounds cut at 5 and 7 graphs", {"bound": 450}, {"bound": 650}),
]


def _scenario(tp: TPGroup, faults: dict[str, Any]) -> tuple[bool, list]:
    """DecodeGraphs.capture with the CUDA parts faked: each warm-up runs a real collective (as
    a forward's all-reduces do), each capture only records (as graph capture does)."""
    graphs = DecodeGraphs(None, None, [], 4, 1024, 16, torch.device("cpu"), tp,
                          faults.get("bound", 1 << 30))
    used = [0]

    def warm_up(keys: list) -> None:
        if faults.get("fail_warmup"):
            raise RuntimeError("warm-up failed")
        for _ in keys:
            dist.all_reduce(torch.ones(3), group=tp.group)

    def capture_one(key: tuple[int, int]) -> None:
        if len(graphs._graphs) == faults.get("fail_at"):
            raise RuntimeError("capture failed")
        graphs._graphs[key] = (None, None)
        used[0] += 100

    graphs._warm_up, graphs._capture_one = warm_up, capture_one
    torch.cuda.graph_pool_handle = lambda: None
    torch.cuda.memory_reserved = lambda device=None: used[0]
    torch.cuda.synchronize = lambda device=None: None
    ok = graphs.capture()
    return ok, sorted(graphs._graphs)


def _rank(rank: int, port: int, out: Any) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=timedelta(seconds=30))
        group = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, 2,
                                      timedelta(seconds=30))
        tp = TPGroup(rank, 2, group)
        results = []
        for _, *faults in SCENARIOS:
            results.append(_scenario(tp, faults[rank]))
            # The ranks are still in lockstep: the next collective meets its peer.
            x = torch.tensor([float(rank + 1)])
            dist.all_reduce(x, group=group)
            assert x.item() == 3.0
        out.put((rank, results))
    except BaseException as exc:  # reported, not lost in the child
        out.put((rank, repr(exc)))


@pytest.mark.timeout(120)
def test_capture_is_agreed_across_two_tp_ranks() -> None:
    """A failed capture on one rank: every rank runs eagerly; different pool bounds: every rank
    keeps the same graphs. Without the agreement the ranks disagree (and, on GPUs, a replay's
    padded collectives would meet an eager step's on the other rank)."""
    store = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, store.port, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert all(isinstance(r, list) for r in got.values()), got
    all_keys = sorted(capture_order(batch_ladder(4), context_ladder(1024)))
    first5 = sorted(capture_order(batch_ladder(4), context_ladder(1024))[:5])
    want = [(True, all_keys), (False, []), (False, []), (False, []), (True, first5)]
    for i, (name, *_) in enumerate(SCENARIOS):
        assert got[0][i] == got[1][i] == want[i], name


# ---- on a GPU ------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile", [False, True])
def test_decode_replays_graphs_per_bucket_hf_exact(tiny_model, compile: bool) -> None:
    """Contexts in the 256, 512 and 1024 buckets (model length 1024): each bucket's graphs
    replay, and every output equals the eager engine's and HF's."""
    model_dir = tiny_model(arch="qwen2", num_layers=2, max_position_embeddings=1024)
    prompts = [random_prompt(n, seed=n) for n in (3, 13, 200, 300, 700, 900)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = {}
    for graphs in (True, False):
        llm = LLM(model=model_dir, device="cuda", dtype="float32", attention_backend="triton",
                  compile=compile, cuda_graphs=graphs, max_num_seqs=8, block_size=16)
        runner = llm.engine.runner
        assert (runner.decode_graphs is not None) == graphs
        if graphs:
            assert runner.decode_graphs.buckets == [256, 512, 1024]
        runs[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if graphs:  # every step after the prefills decoded from a graph of the longest bucket
            replays = runner.decode_graphs.replays
            assert sum(replays.values()) >= MAX_TOKENS - 2, replays
            assert {c for _, c in replays} == {1024}, replays
            # One request at a time: its own context's bucket, not the model's length.
            for prompt, bucket in (([5] * 100, 256), ([5] * 400, 512)):
                replays.clear()
                llm.generate([prompt], params)
                assert {c for _, c in replays} == {bucket}, (bucket, replays)
        llm.engine.check_no_leaks()
        llm.close()
    assert runs[True] == runs[False]
    for prompt, tokens in zip(prompts, runs[True]):
        assert_greedy_matches(model_dir, prompt, tokens, hf_greedy(model_dir, prompt, MAX_TOKENS))


def _nccl_rank(rank: int, port: int, out: Any) -> None:
    """One GPU rank: a toy decode forward whose collective is the model's (TPGroup.all_reduce on
    NCCL); rank 1's cannot be captured in the first round (an injected failure)."""
    try:
        from pd_cluster.engine.tp_comm import create_groups
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=timedelta(seconds=60))
        _, tp = create_groups(store, rank, 2, device, 60.0)
        weight = torch.arange(64 * 8, dtype=torch.float32, device=device).view(64, 8)
        results = []
        for fail in (rank == 1, False):
            def forward(ids: torch.Tensor, pos: torch.Tensor, ctx: Any) -> torch.Tensor:
                if fail and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("injected: not capturable on rank 1")
                return tp.all_reduce(weight[ids % 64] * (pos[:, None] + 1))
            graphs = DecodeGraphs(forward, None, [], 4, 512, 16, device, tp)
            ok = graphs.capture()
            ids = torch.tensor([3, 9, 70], device=device)
            pos = torch.tensor([5, 300, 7], device=device)
            # Eager (both ranks: their collectives still meet), then the replay if any.
            eager = forward(ids, pos, None).clone()
            got = None
            if graphs.ready(3, 301):
                got = graphs.run(ids, pos, torch.zeros(3, dtype=torch.long, device=device),
                                 torch.tensor([6, 301, 8], dtype=torch.int32, device=device),
                                 torch.zeros(3, 20, dtype=torch.int32, device=device),
                                 torch.ones(3, dtype=torch.long, device=device), 301).clone()
            torch.cuda.synchronize()
            want = 2 * weight[ids % 64] * (pos[:, None] + 1)
            replayed = got is not None and torch.equal(got, want)
            results.append((ok, torch.equal(eager, want), replayed, sorted(graphs.replays)))
        out.put((rank, results))
    except BaseException as exc:
        out.put((rank, repr(exc)))


@pytest.mark.two_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.timeout(300)
def test_capture_failure_on_one_gpu_rank_is_agreed_over_nccl() -> None:
    """Real captures with NCCL collectives recorded: rank 1's capture fails, so both ranks run
    eagerly and their next collectives still meet; then both capture, and a replay (batch 4,
    bucket 512) equals the eager result on both."""
    store = dist.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(r, store.port, out), daemon=True)
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert all(isinstance(r, list) for r in got.values()), got
    for rank in (0, 1):
        assert got[rank][0] == (False, True, False, []), (rank, got[rank])
        assert got[rank][1] == (True, True, True, [(4, 512)]), (rank, got[rank])


@pytest.mark.two_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_replays_equal_eager(tiny_model) -> None:
    """A TP2 engine (NCCL) with graphs: the same greedy tokens as without."""
    model_dir = tiny_model(arch="llama", num_heads=4, num_kv_heads=2, max_position_embeddings=1024)
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 300)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = {}
    for graphs in (True, False):
        llm = LLM(model=model_dir, device="cuda", dtype="float32", attention_backend="triton",
                  tensor_parallel_size=2, cuda_graphs=graphs, max_num_seqs=8, block_size=16,
                  collective_timeout=60.0)
        assert (llm.engine.runner.decode_graphs is not None) == graphs
        runs[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if graphs:
            assert sum(llm.engine.runner.decode_graphs.replays.values()) >= MAX_TOKENS - 2
        llm.engine.check_no_leaks()
        llm.close()
    assert runs[True] == runs[False]
