"""Scheduler unit tests with a fake model runner (no model).

The fake runner "samples" a fixed token for every request whose scheduled chunk reaches the end
of its sequence, exactly as the real ModelRunner decides which rows to sample; the driver finishes
requests at max_tokens as the engine's output processor would.
"""
from __future__ import annotations

import itertools

import pytest

from pd_cluster.config import EngineConfig
from pd_cluster.engine.block_manager import BlockManager
from pd_cluster.engine.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput
from pd_cluster.request import Request, RequestStatus
from pd_cluster.sampling_params import SamplingParams

TOKEN = 7
_ids = itertools.count()


def make_scheduler(num_blocks: int = 64, block_size: int = 8, max_num_seqs: int = 64,
                   max_num_batched_tokens: int = 2048, max_model_len: int = 1024,
                   enable_prefix_caching: bool = True) -> Scheduler:
    config = EngineConfig(model="unused", block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          enable_prefix_caching=enable_prefix_caching)
    return Scheduler(config, BlockManager(num_blocks, block_size, enable_prefix_caching),
                     max_model_len)


def make_request(prompt_len: int, max_tokens: int = 4, start: int | None = None,
                 rid: str | None = None) -> Request:
    n = next(_ids)
    base = 1000 * (n + 1) if start is None else start  # distinct prompts: no accidental sharing
    return Request(rid or f"req{n}", list(range(base, base + prompt_len)),
                   SamplingParams(temperature=0, max_tokens=max_tokens))


def fake_execute(out: SchedulerOutput, block_size: int) -> ModelRunnerOutput:
    result = ModelRunnerOutput()
    for item in out.scheduled:
        r = item.request
        assert item.num_new_tokens >= 1
        end = r.num_computed_tokens + item.num_new_tokens
        assert end <= r.num_tokens, "scheduled past the end of the sequence"
        assert len(r.block_ids) * block_size >= end, "KV slots missing for scheduled tokens"
        if end == r.num_tokens:
            result.sampled_token_ids[r.request_id] = TOKEN
    return result


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step; returns the schedule and the requests that finished in it."""
    out = sched.schedule()
    updated = sched.update_from_output(out, fake_execute(out, sched.block_manager.block_size))
    finished = []
    for r in updated:
        if r.num_output_tokens >= r.sampling_params.max_tokens:
            sched.finish(r, RequestStatus.FINISHED_LENGTH)
            finished.append(r)
    return out, finished


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outs
        outs.append(step(sched)[0])
    raise AssertionError("scheduler did not finish its requests")


def test_single_request_prefill_then_decode() -> None:
    sched = make_scheduler()
    r = make_request(10, max_tokens=3)
    sched.add_request(r)
    out, _ = step(sched)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(r, 10)]
    assert r.status is RequestStatus.RUNNING and r.output_token_ids == [TOKEN]
    out, _ = step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [1]
    out, finished = step(sched)
    assert finished == [r] and r.output_token_ids == [TOKEN] * 3
    assert r.finish_reason == "length"
    assert not sched.has_unfinished()
    sched.check_no_leaks()


def test_max_num_seqs_respected() -> None:
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(5, max_tokens=3) for _ in range(5)]
    for r in reqs:
        sched.add_request(r)
    for out in run_to_completion(sched):
        assert len(out.scheduled) <= 2
        assert len(sched.running) <= 2
    assert all(r.num_output_tokens == 3 for r in reqs)
    sched.check_no_leaks()


def test_max_num_batched_tokens_respected() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    reqs = [make_request(n, max_tokens=4) for n in (3, 9, 25, 1, 14)]
    for r in reqs:
        sched.add_request(r)
    outs = run_to_completion(sched)
    assert all(0 < out.num_tokens <= 10 for out in outs)
    assert any(out.num_tokens == 10 for out in outs)  # the budget is actually used
    assert all(r.num_output_tokens == 4 for r in reqs)
    sched.check_no_leaks()


def test_chunked_prefill_splits_prompt_and_mixes_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    short = make_request(3, max_tokens=10)
    long = make_request(50, max_tokens=2)
    sched.add_request(short)
    sched.add_request(long)

    out, _ = step(sched)  # short: whole prompt (3); long: first chunk (13)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(short, 3), (long, 13)]
    assert long.num_computed_tokens == 13 and long.output_token_ids == []
    assert short.output_token_ids == [TOKEN]

    chunks = [13]
    while long.num_output_tokens == 0:
        out, _ = step(sched)
        items = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        assert items[short.request_id] == 1  # the decode rides along in the same step
        assert out.num_tokens <= 16
        chunks.append(items[long.request_id])
    assert chunks == [13, 15, 15, 7]  # 50 prompt tokens across 4 steps
    assert long.num_computed_tokens == 50
    run_to_completion(sched)
    assert short.num_output_tokens == 10 and long.num_output_tokens == 2
    sched.check_no_leaks()


def test_running_requests_scheduled_before_waiting() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    first = make_request(4, max_tokens=5)
    sched.add_request(first)
    step(sched)
    second = make_request(30, max_tokens=1)
    sched.add_request(second)
    out, _ = step(sched)
    assert out.scheduled[0].request is first and out.scheduled[0].num_new_tokens == 1
    assert out.scheduled[1].request is second and out.scheduled[1].num_new_tokens == 7
    run_to_completion(sched)
    sched.check_no_leaks()


def test_preemption_newest_first_and_resume() -> None:
    bs = 8
    sched = make_scheduler(num_blocks=4, block_size=bs)
    a, b, c = (make_request(8, max_tokens=4) for _ in range(3))  # one full block each
    for r in (a, b, c):
        sched.add_request(r)
    out, _ = step(sched)  # all three prefill: 3 blocks used, 1 free
    assert len(out.scheduled) == 3 and sched.block_manager.num_free_blocks == 1

    out, _ = step(sched)  # each decode needs a 2nd block: a gets the last, c (newest) yields
    assert out.preempted_ids == [c.request_id]
    assert [s.request for s in out.scheduled] == [a, b]
    assert c.status is RequestStatus.PREEMPTED and c.block_ids == []
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert sched.waiting[0] is c and sched.num_preemptions == 1
    assert c.output_token_ids == [TOKEN]  # generated tokens are kept and recomputed

    run_to_completion(sched)
    assert [r.num_output_tokens for r in (a, b, c)] == [4, 4, 4]
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in (a, b, c))
    assert c.num_preemptions == 1 and a.num_preemptions == 0 and b.num_preemptions == 0
    sched.check_no_leaks()


def test_preempted_request_recomputes_prompt_and_outputs() -> None:
    sched = make_scheduler(num_blocks=4, block_size=8, enable_prefix_caching=False)
    a, b = make_request(15, max_tokens=6), make_request(9, max_tokens=6)
    for r in (a, b):
        sched.add_request(r)
    recompute = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        out, _ = step(sched)
        for s in out.scheduled:
            if s.request is b and s.request.num_preemptions and s.num_new_tokens > 1:
                recompute.append(s.num_new_tokens)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    # The re-prefill covers the prompt plus every output token generated before preemption
    # except the newest (which has no KV yet): it ends at the sequence end and samples.
    assert recompute and all(n > 9 for n in recompute)
    assert a.num_output_tokens == 6 and b.num_output_tokens == 6
    sched.check_no_leaks()


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make_scheduler(num_blocks=4, block_size=8)
    a, b, c = (make_request(8, max_tokens=3) for _ in range(3))
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    d = make_request(1, max_tokens=1)
    sched.add_request(d)
    out, _ = step(sched)
    assert out.preempted_ids and d not in [s.request for s in out.scheduled]
    run_to_completion(sched)
    sched.check_no_leaks()


def test_abort_waiting_request() -> None:
    sched = make_scheduler()
    r = make_request(10)
    sched.add_request(r)
    aborted = sched.abort([r.request_id, "no-such-request"])
    assert aborted == [r]
    assert r.status is RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort"
    assert not sched.waiting and not sched.has_unfinished()
    assert sched.abort([r.request_id]) == []  # already gone
    sched.check_no_leaks()


def test_abort_running_request_frees_blocks() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    a, b = make_request(40, max_tokens=20), make_request(5, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a is mid-prefill (16 of 40 computed)
    assert a.status is RequestStatus.RUNNING and 0 < a.num_computed_tokens < 40
    assert sched.block_manager.num_used_blocks > 0
    assert sched.abort([a.request_id]) == [a]
    assert a not in sched.running and a.block_ids == []
    step(sched)
    step(sched)  # b is decoding now
    assert b.num_output_tokens >= 1
    sched.abort([b.request_id])
    assert sched.block_manager.num_used_blocks == 0
    sched.check_no_leaks()


def test_abort_between_schedule_and_update() -> None:
    sched = make_scheduler()
    a, b = make_request(6, max_tokens=5), make_request(6, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    result = fake_execute(out, sched.block_manager.block_size)
    sched.abort([a.request_id])
    updated = sched.update_from_output(out, result)
    assert updated == [b]
    run_to_completion(sched)
    sched.check_no_leaks()


def test_duplicate_request_id_rejected() -> None:
    sched = make_scheduler()
    sched.add_request(make_request(3, rid="dup"))
    with pytest.raises(ValueError, match="dup"):
        sched.add_request(make_request(3, rid="dup"))
    run_to_completion(sched)
    sched.check_no_leaks()


def test_check_no_leaks_detects_leftovers() -> None:
    sched = make_scheduler()
    r = make_request(3)
    sched.add_request(r)
    step(sched)
    with pytest.raises(AssertionError):
        sched.check_no_leaks()
    sched.abort([r.request_id])
    sched.check_no_leaks()


def test_many_requests_tight_memory_all_finish() -> None:
    """Stress: tight blocks, small budget, mixed lengths -> every request finishes, no leaks."""
    sched = make_scheduler(num_blocks=12, block_size=8, max_num_seqs=4, max_num_batched_tokens=20)
    reqs = [make_request(n, max_tokens=m) for n, m in
            [(1, 9), (30, 5), (8, 17), (17, 3), (60, 8), (2, 30), (16, 16), (40, 1), (9, 9)]]
    for r in reqs:
        sched.add_request(r)
    outs = run_to_completion(sched, max_steps=2000)
    assert all(out.num_tokens <= 20 and len(out.scheduled) <= 4 for out in outs)
    for r in reqs:
        assert r.num_output_tokens == r.sampling_params.max_tokens
    assert sched.num_preemptions > 0
    sched.check_no_leaks()
