"""speculative method mtp (issue 41): the tiny DeepSeek-V3 preset's MTP layer proposes, chained
k times, the target verifies. Greedy output equals the engine without speculation (one request,
a batch, max_tokens and a stop string, prompts in chunks), seeded sampling is reproducible and
equal, the spec counters count the drafts, and the target's hidden states reach the head at
the right positions (a test head behind the same interface checks them against HF's and
proposes the known continuation, so drafts are accepted and rejected). Every test ends
leak-free: the target's blocks and the head's."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from pd_cluster import LLM, SamplingParams
from pd_cluster.config import EngineConfig, SpeculativeConfig
from pd_cluster.engine.spec.backoff import Backoff
from pd_cluster.serving.cluster.cluster_config import parse_config
from tests.conftest import hf_model, random_prompt
from tests.spec_helpers import outputs
from tests.test_families import family_model  # noqa: F401 (the fixture)

PROMPTS = [random_prompt(n, seed=n) for n in (5, 19, 40, 33)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def model(family_model: Any) -> str:  # noqa: F811
    return family_model("tiny-deepseek-v3")


@pytest.fixture(scope="module")
def base(model: str) -> LLM:
    return LLM(model=model, block_size=8, num_kv_blocks=96, compile=False)


@pytest.fixture(scope="module")
def spec(model: str) -> LLM:
    """Prompts (and the head's catch-up) in chunks of 16 tokens."""
    return LLM(model=model, block_size=8, num_kv_blocks=96, max_num_batched_tokens=16,
               speculative=MTP, compile=False)


def test_greedy_equals_no_speculation_batch_and_alone(base: LLM, spec: LLM) -> None:
    want = [o.token_ids for o in outputs(base, PROMPTS, GREEDY)]
    before = dict(spec.engine.stats())
    assert [o.token_ids for o in outputs(spec, PROMPTS, GREEDY)] == want  # a batch of 4
    assert [o.token_ids for o in outputs(spec, PROMPTS[1:2], GREEDY)] == want[1:2]
    s = spec.engine.stats()
    drafts = s["spec_num_draft_tokens"] - before.get("spec_num_draft_tokens", 0)
    accepted = s["spec_num_accepted_tokens"] - before.get("spec_num_accepted_tokens", 0)
    assert drafts > 0 and s["spec_num_drafts"] > 0  # the vllm:spec_decode_* counters
    print(f"mtp acceptance on random weights: {accepted}/{drafts}")
    base.engine.check_no_leaks()
    spec.engine.check_no_leaks()


def test_max_tokens_and_stop_string_as_without(base: LLM, spec: LLM) -> None:
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert ([o.token_ids for o in outputs(spec, PROMPTS, short)]
            == [o.token_ids for o in outputs(base, PROMPTS, short)])
    full = outputs(base, PROMPTS[2:3], GREEDY)[0]
    stop = full.text[len(full.text) // 2:][:3]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    want, got = outputs(base, PROMPTS[2:3], params)[0], outputs(spec, PROMPTS[2:3], params)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids,
                                                            want.finish_reason)
    assert want.finish_reason == "stop"
    spec.engine.check_no_leaks()


def test_seeded_sampling_reproducible_and_abort_frees_head_blocks(base: LLM, spec: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)
    first = [o.token_ids for o in outputs(spec, PROMPTS[:2], params)]
    assert [o.token_ids for o in outputs(spec, PROMPTS[:2], params)] == first
    assert [o.token_ids for o in outputs(base, PROMPTS[:2], params)] == first
    engine = spec.engine
    # The random head's drafts all failed above: the engine-wide gate would propose on one
    # step in 8, at a phase (and a step-cost fit) earlier tests set. A fresh backoff proposes
    # at the request's first decode step, so the head surely holds its blocks below.
    engine.proposer.backoff = Backoff()
    engine.add_request("cut", PROMPTS[1], GREEDY)
    for _ in range(4):
        engine.step()
    s = engine.stats()
    assert s["spec_draft_kv_blocks_free"] < s["spec_draft_kv_blocks_total"]
    engine.abort_request(["cut"])
    engine.check_no_leaks()


class _KnownHead(torch.nn.Module):
    """A HiddenStateHead that records what it is fed and proposes ``answer`` (the tokens after
    ``prompt``), every third chained draft wrong. Its states carry their position in column 0
    and a mark in column 1, so its own rows are told from the target's."""
    MARK = 12345.0

    def __init__(self, real: Any, prompt: list[int], answer: list[int]) -> None:
        super().__init__()
        self.real, self.seq = real, prompt + answer
        self.fed: list[tuple[int, int, torch.Tensor]] = []  # (position, token, target hidden)
        self.chained = 0

    def kv_cache_specs(self, dtype: torch.dtype) -> list[Any]:
        return self.real.kv_cache_specs(dtype)

    def forward(self, token_ids, positions, hidden, ctx):  # type: ignore[no-untyped-def]
        out = hidden.clone()
        for p, t, h in zip(positions.tolist(), token_ids.tolist(), hidden):
            if float(h[1]) != self.MARK:
                self.fed.append((p, t, h.clone()))
        out[:, 0], out[:, 1] = positions.to(out.dtype), self.MARK
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], self.real.shared_head.head.vocab_size)
        for i, p in enumerate(hidden[:, 0].long().tolist()):
            self.chained += 1
            want = self.seq[p + 2] if p + 2 < len(self.seq) else 5
            logits[i, want if self.chained % 3 else (want + 1) % 200 + 4] = 1.0
        return logits


def test_head_gets_the_targets_hidden_states_and_accepts(base: LLM, model: str) -> None:
    prompt = PROMPTS[2]
    answer = list(outputs(base, [prompt], GREEDY)[0].token_ids)
    llm = LLM(model=model, block_size=8, num_kv_blocks=64, max_num_batched_tokens=16,
              speculative=MTP, compile=False)
    runner = llm.engine.proposer.runner
    head = runner.head = _KnownHead(runner.head, prompt, answer)
    assert list(outputs(llm, [prompt], GREEDY)[0].token_ids) == answer
    s = llm.engine.stats()
    assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]
    seq = prompt + answer
    with torch.inference_mode():  # HF's last hidden states are after the final norm
        ref = hf_model(model)(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
    positions = sorted({p for p, _, _ in head.fed})
    # Every position in order, up to where the last proposal (max_tokens near) needed them.
    assert positions == list(range(len(positions))) and len(positions) >= len(seq) - 6
    for p, t, h in head.fed:
        assert t == seq[p + 1]
        torch.testing.assert_close(h.float(), ref[p].float(), atol=2e-3, rtol=2e-3)
    llm.engine.check_no_leaks()


def test_config_errors_name_the_field(tiny_model: Any, model: str) -> None:
    with pytest.raises(ValueError, match="model: mtp reads the served checkpoint"):
        SpeculativeConfig(method="mtp", model="x")
    # Through P/D too (tests/test_spec_mtp_pd.py); not with the KV tiers (prefix caching off).
    EngineConfig(model=model, speculative=MTP, kv_transfer={"role": "consumer"})
    parse_config({"model": model, "engine": {"speculative": MTP}})  # disaggregated
    parse_config({"model": model, "mode": "colocated", "engine": {"speculative": MTP}})
    with pytest.raises(ValueError, match="speculative.method: mtp turns prefix caching off"):
        EngineConfig(model=model, speculative=MTP, kv_offloading_size=1)
    with pytest.raises(ValueError, match="speculative.method: mtp needs a checkpoint with MTP"):
        LLM(model=tiny_model(), num_kv_blocks=16, speculative=MTP, compile=False)
