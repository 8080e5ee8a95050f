"""max_prefill_tokens_per_step: while a request decodes, a step takes at most that many prompt
tokens (chunked prefill does the rest), so a long local prefill cannot stall running decodes."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from pd_cluster import LLM, SamplingParams
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.scheduler import SchedulerOutput

CAP = 8
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_cap_is_validated() -> None:
    with pytest.raises(ValidationError, match="max_prefill_tokens_per_step"):
        EngineConfig(model="unused", max_prefill_tokens_per_step=0)
    assert EngineConfig(model="unused").max_prefill_tokens_per_step is None


def test_prompt_tokens_per_step_stay_under_the_cap_while_a_decode_runs(tiny_model) -> None:
    model = tiny_model()
    e = LLMEngine(EngineConfig(model=model, block_size=8, max_num_batched_tokens=256,
                               max_prefill_tokens_per_step=CAP))
    steps: list[tuple[bool, int]] = []  # (a decode ran, prompt tokens scheduled)
    schedule = e.scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        decodes = [s for s in out.scheduled if s.request.is_decoding]
        steps.append((bool(decodes), out.num_tokens - len(decodes)))
        return out
    e.scheduler.schedule = recording
    prompts = [[5 + i % 50 for i in range(20)], [9 + i % 70 for i in range(61)],
               [3 + i % 40 for i in range(45)]]
    e.add_request("a", prompts[0], GREEDY)
    done: dict[str, list[int]] = {}
    for step in range(400):
        if step == 3:  # "a" decodes by now: the long prompts come in
            e.add_request("b", prompts[1], GREEDY)
            e.add_request("c", prompts[2], GREEDY)
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not e.has_unfinished_requests():
            break
    with_decode = [n for decoding, n in steps if decoding]
    assert with_decode and max(with_decode) <= CAP and max(n for _, n in steps) > CAP
    ref = LLM(model=model, block_size=8).generate(prompts, [GREEDY] * 3)
    assert [done[r] for r in "abc"] == [o.outputs[0].token_ids for o in ref]
    e.check_no_leaks()
