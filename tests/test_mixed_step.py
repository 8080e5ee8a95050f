"""A colocated engine mixes prompt chunks into its decode steps, each sized by the step times
it measured and the decoding requests' TPOT slack under ``tpot_target_ms``: decodes keep
their tokens exact across the mixed steps (greedy equal to each request run alone), and the
chunk follows the slack (a request that can still meet the target bounds it, one already late
does not), widened as far as the queued prompts' TTFT target needs (a prompt already lost to
it asks for nothing)."""
from __future__ import annotations

import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.config import EngineConfig
from pd_cluster.engine.step_time_model import StepTimeModel
from pd_cluster.tpot_budget import Decoding, request_slack
from pd_cluster.ttft_budget import Queued, rate_needed

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_the_line_through_measured_steps_gives_the_width_that_fits() -> None:
    m = StepTimeModel()
    for n in (1, 2, 4, 100, 200):
        assert m.tokens_within(1.0) is None or len(m._steps) >= 4
        m.add(n, 0.010 + 0.0005 * n)  # 10 ms fixed, 0.5 ms a token
    fixed, per_token = m.line()
    assert fixed == pytest.approx(0.010) and per_token == pytest.approx(0.0005)
    assert m.tokens_within(0.0301) == 40
    assert m.tokens_within(0.005) == 0  # less than the fixed part: nothing fits
    alike = StepTimeModel()
    for _ in range(10):
        alike.add(3, 0.01)
    assert alike.line() is None  # one width: no slope to trust


def _measured(sched) -> None:
    sched.step_times = StepTimeModel()  # as if measured: 10 ms + 0.5 ms a token
    for n in (1, 2, 50, 100, 300):
        sched.step_times.add(n, 0.010 + 0.0005 * n)


def test_the_prefill_chunk_spends_the_decoding_requests_slack(tiny_model) -> None:
    target = 0.0301
    llm = LLM(model=tiny_model(), num_kv_blocks=128, block_size=8,
              tpot_target_ms=target * 1e3, max_num_batched_tokens=512)
    sched = llm.engine.scheduler
    now = 1000.0
    sched.clock = lambda: now
    llm.engine.add_request("d", list(range(5, 25)), GREEDY)
    llm.engine.step()  # its prefill: its first token at `now`
    assert sched.requests["d"].first_token_time == now
    llm.engine.add_request("p", list(range(5, 400)), GREEDY)
    _measured(sched)
    decode_step = 0.010 + 0.0005 * 1
    for elapsed in (0.0, 0.05, 0.15):  # d has decoded longer and longer at one token
        now = 1000.0 + elapsed
        slack = request_slack(Decoding(elapsed, 1, 12), decode_step, target)
        fits = int((decode_step + slack - 0.010) / 0.0005)
        assert sched._prefill_budget(10_000) == max(fits - 1, 8), elapsed
    now = 1000.0
    out = sched.schedule()
    widths = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert widths["d"] == 1 and 8 < widths["p"] < 395, widths  # a chunk the slack pays for
    llm.engine.executor.execute(out)  # (the step runs, as scheduled)
    sched.update_from_output(out, _no_tokens())
    llm.engine.abort_request(["d", "p"])
    llm.engine.check_no_leaks()


def test_a_request_past_saving_does_not_hold_prompts_back(tiny_model) -> None:
    llm = LLM(model=tiny_model(), num_kv_blocks=128, block_size=8, tpot_target_ms=30.1,
              max_num_batched_tokens=512)
    sched = llm.engine.scheduler
    now = 1000.0
    sched.clock = lambda: now
    for rid in ("late", "fresh"):
        llm.engine.add_request(rid, list(range(5, 25)), GREEDY)
    llm.engine.step()  # both prefilled: first tokens at `now`
    _measured(sched)
    decode_step = 0.010 + 0.0005 * 2
    sched.requests["late"].first_token_time = now - 10.0  # 10 s for one token: lost
    budget = sched._prefill_budget(10_000)
    slack = request_slack(Decoding(0.0, 1, 12), decode_step, 0.0301)
    assert budget == int((decode_step + slack - 0.010) / 0.0005) - 2  # fresh's slack alone
    sched.requests["fresh"].first_token_time = now - 10.0  # both lost: no TPOT bound
    assert sched._prefill_budget(10_000) == 10_000
    llm.engine.abort_request(["late", "fresh"])
    llm.engine.check_no_leaks()


def _no_tokens():
    from pd_cluster.engine.scheduler import ModelRunnerOutput
    return ModelRunnerOutput()


def test_a_tight_target_still_moves_prompts_a_block_a_step() -> None:
    cfg = EngineConfig(model="tiny-llama", tpot_target_ms=0.001, block_size=8)
    assert cfg.tpot_target_ms == 0.001
    with pytest.raises(ValueError, match="tpot_target_ms"):
        EngineConfig(model="tiny-llama", tpot_target_ms=0)


def test_decodes_keep_their_tokens_exact_across_mixed_steps(tiny_model) -> None:
    model = tiny_model()
    prompts = [[5 + (i * 13 + j * 7) % 400 for j in range(n)] for i, n in
               enumerate((9, 150, 37, 260, 18, 120))]
    alone = [LLM(model=model, num_kv_blocks=256, block_size=8).generate([p], GREEDY)[0]
             .outputs[0].token_ids for p in prompts]
    # A cap of one block: every mixed step carries one block of prompt, the rest waits.
    mixed = LLM(model=model, num_kv_blocks=256, block_size=8, max_prefill_tokens_per_step=8)
    engine = mixed.engine
    done: dict[str, list[int]] = {}
    chunks: list[int] = []
    engine.add_request("r0", prompts[0], GREEDY)
    pending = list(enumerate(prompts))[1:]
    while engine.has_unfinished_requests() or pending:
        if pending:  # one more arrives each step, while the others decode
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, GREEDY)
        out = engine.step()
        done.update({o.request_id: o.outputs[0].token_ids for o in out if o.finished})
        if engine.scheduler.step_times.line() is not None:
            chunks.append(engine.scheduler._prefill_budget(10_000))
    assert [done[f"r{i}"] for i in range(len(prompts))] == alone
    assert chunks and min(chunks) == 8  # a block a step while decodes run
    engine.check_no_leaks()


def test_the_rate_the_queued_prompts_need_and_the_chunk_that_moves_it() -> None:
    now = 100.0
    # 1000 tokens due in 2 s, then 1000 more due in 3 s: 2000 / 3 s is the higher need.
    queue = [Queued(1000, now - 2.0), Queued(1000, now - 1.0)]
    assert rate_needed(queue, now, 4.0, fastest=10_000) == pytest.approx(2000 / 3)
    # The first is past its deadline: it is drained within one more target (1000 / 4 s),
    # and its tokens still go first (the second's 2000 / 3 s is the higher need).
    late = [Queued(1000, now - 5.0), Queued(1000, now - 1.0)]
    assert rate_needed(late, now, 4.0, fastest=10_000) == pytest.approx(2000 / 3)
    assert rate_needed(late[:1], now, 4.0, fastest=10_000) == pytest.approx(1000 / 4)
    # Beyond the fastest rate: lost too, so both are drained within one more target.
    assert rate_needed(queue, now, 4.0, fastest=100) == pytest.approx(2000 / 4)
    assert rate_needed([], now, 4.0, fastest=100) == 0.0
    m = StepTimeModel()
    for n in (1, 2, 50, 100, 300):
        m.add(n, 0.010 + 0.0005 * n)
    c = m.tokens_for_rate(1000.0, others=4)  # c / (10 ms + 0.5 ms (c + 4)) >= 1000 tok/s
    assert c / (0.010 + 0.0005 * (c + 4)) >= 1000 > (c - 1) / (0.010 + 0.0005 * (c + 3))
    assert m.tokens_for_rate(2000.0, others=4) is None  # 0.5 ms a token: 2000/s unreachable


def test_the_ttft_target_widens_the_chunk_past_the_tpot_slack(tiny_model) -> None:
    # A tight TPOT target: d's slack pays for about one block of prompt a step.
    llm = LLM(model=tiny_model(), num_kv_blocks=256, block_size=8, tpot_target_ms=12,
              ttft_target_ms=1000, max_num_batched_tokens=512)
    sched = llm.engine.scheduler
    now = 1000.0
    sched.clock = lambda: now
    llm.engine.add_request("d", list(range(5, 25)), GREEDY)
    llm.engine.step()  # d decodes from here on
    _measured(sched)
    llm.engine.add_request("p", list(range(5, 405)), GREEDY)  # 400 prompt tokens
    p = sched.requests["p"]
    p.arrival_time = now  # 1 s to its deadline: 400 tokens/s is easy, the slack decides
    slack_only = sched._prefill_budget(10_000)
    assert slack_only == 8
    p.arrival_time = now - 0.95  # 50 ms left: 8000 tokens/s, more than any width moves
    assert sched._prefill_budget(10_000) == slack_only  # lost: 400 tokens in 1 s, the slack's
    p.arrival_time = now - 0.75  # 250 ms left: 1600 tokens/s
    widened = sched._prefill_budget(10_000)
    need = sched.step_times.tokens_for_rate(400 / 0.25, 1)
    assert widened == need and widened > slack_only
    p.arrival_time = now - 2.0  # past its deadline: 400 tokens within 1 s, the slack's
    assert sched._prefill_budget(10_000) == slack_only
    llm.engine.add_request("q", list(range(5, 405)) * 4, GREEDY)  # 1600 more, as late
    sched.requests["q"].arrival_time = now - 2.0
    # 2000 tokens within 1 s: past any width (0.5 ms a token), so the whole budget
    assert sched._prefill_budget(10_000) == 10_000
    llm.engine.abort_request(["d", "p", "q"])
    llm.engine.check_no_leaks()
