"""draft_model speculation (issue 41): a draft made of the target's first layer proposes, the
target verifies; greedy output equals the engine without speculation and HF, through preemption
and chunked prefill (the draft's prefill chunked too); a draft equal to the target accepts every
draft; sampling is seeded-reproducible; aborts free the draft's blocks; the config is checked
(naming speculative.model). Every test ends with both caches leak-free."""
from __future__ import annotations

import json
import shutil
from typing import Any

import pytest

from pd_cluster import LLM, SamplingParams
from pd_cluster.checkpoints.truncate import truncate_layers
from pd_cluster.config import SpeculativeConfig
from tests.conftest import hf_greedy, random_prompt
from tests.spec_helpers import outputs

PROMPTS = [random_prompt(n, seed=n) for n in (5, 19, 40, 33)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _spec(model: str, k: int = 3) -> dict[str, Any]:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def models(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(target: 2 layers, draft: its first layer)."""
    target = tiny_model()
    return target, str(truncate_layers(target, tmp_path_factory.mktemp("draft"), 1))


@pytest.fixture(scope="module")
def base(models: tuple[str, str]) -> LLM:
    return LLM(model=models[0], block_size=8, num_kv_blocks=128, compile=False)


@pytest.fixture(scope="module")
def spec(models: tuple[str, str]) -> LLM:
    """Short of blocks (4 requests of ~65 tokens in 14 blocks of 8: preemptions) and of step
    budget (prompts, and the draft's prefill, in chunks of 16)."""
    return LLM(model=models[0], block_size=8, num_kv_blocks=14, max_num_batched_tokens=16,
               speculative=_spec(models[1]), compile=False)


def _delta(engine: Any, before: dict[str, Any], key: str) -> int:
    return engine.stats()[key] - before.get(key, 0)


def test_greedy_equals_no_speculation_and_hf_through_preemption(base, spec, models) -> None:
    before = dict(spec.engine.stats())
    want = [o.token_ids for o in outputs(base, PROMPTS, GREEDY)]
    got = [o.token_ids for o in outputs(spec, PROMPTS, GREEDY)]
    assert got == want
    assert [list(w) for w in want[:2]] == [hf_greedy(models[0], p, 24) for p in PROMPTS[:2]]
    accepted = _delta(spec.engine, before, "spec_num_accepted_tokens")
    assert 0 < accepted < _delta(spec.engine, before, "spec_num_draft_tokens")
    assert _delta(spec.engine, before, "num_preemptions") > 0
    base.engine.check_no_leaks()
    spec.engine.check_no_leaks()  # the target's blocks and the draft's


def test_a_draft_equal_to_the_target_is_always_accepted(base, models) -> None:
    same = LLM(model=models[0], block_size=8, num_kv_blocks=64, speculative=_spec(models[0], 4),
               compile=False)
    want = [o.token_ids for o in outputs(base, PROMPTS[:3], GREEDY)]
    assert [o.token_ids for o in outputs(same, PROMPTS[:3], GREEDY)] == want
    s = same.engine.stats()
    assert s["spec_num_draft_tokens"] > 0
    assert s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"]
    same.engine.check_no_leaks()


def test_a_compiling_engine_runs_the_draft_compiled_too(base, models) -> None:
    """With engine.compile the draft's forwards go through its own compiled graph (none
    eager), and the output still equals the engine without speculation."""
    from pd_cluster.engine.compiled_model import CompiledModel
    compiled = LLM(model=models[0], block_size=8, num_kv_blocks=64, speculative=_spec(models[1]),
                   compile=True)
    want = [o.token_ids for o in outputs(base, PROMPTS[:2], GREEDY)]
    assert [o.token_ids for o in outputs(compiled, PROMPTS[:2], GREEDY)] == want
    draft = compiled.engine.proposer.runner.forward_model
    assert isinstance(draft, CompiledModel) and draft.state == "compiled"
    assert draft.compiled_steps > 0 and draft.eager_steps == 0
    compiled.engine.check_no_leaks()


def test_seeded_sampling_reproducible_and_abort_frees_draft_blocks(base, spec) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)
    first = [o.token_ids for o in outputs(spec, PROMPTS[:2], params)]
    assert [o.token_ids for o in outputs(spec, PROMPTS[:2], params)] == first
    assert [o.token_ids for o in outputs(base, PROMPTS[:2], params)] == first  # as without
    engine = spec.engine
    engine.add_request("cut", PROMPTS[1], GREEDY)
    for _ in range(6):
        engine.step()
    assert engine.stats()["spec_draft_kv_blocks_free"] < engine.stats()[
        "spec_draft_kv_blocks_total"]
    engine.abort_request(["cut"])
    engine.check_no_leaks()


def test_config_errors_name_the_field(tiny_model: Any, models, tmp_path) -> None:
    with pytest.raises(ValueError, match="model: draft_model needs"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="speculative.model: the draft's vocab_size 384"):
        LLM(model=models[0], num_kv_blocks=16, speculative=_spec(tiny_model(vocab_size=384)))
    # Same vocabulary size, another tokenizer: two token ids swapped.
    other = tmp_path / "other"
    shutil.copytree(models[1], other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="speculative.model: the draft's tokenizer differs"):
        LLM(model=models[0], num_kv_blocks=16, speculative=_spec(str(other)))
    with pytest.raises(ValueError, match="speculative.model: .*not found"):
        LLM(model=models[0], num_kv_blocks=16, speculative=_spec(str(tmp_path / "none")))


def test_truncate_layers_checks_the_count(models, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"num_layers: must be in \[1, 2\]"):
        truncate_layers(models[0], tmp_path / "x", 3)
