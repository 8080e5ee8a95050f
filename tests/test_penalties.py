"""Logit adjustments against a plain reference implementation of vLLM's semantics."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pd_cluster.engine.penalties import apply_penalties
from pd_cluster.sampling_params import SamplingParams


def reference(row: list[float], params: SamplingParams, prompt: list[int],
              output: list[int]) -> list[float]:
    out = list(row)
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    if params.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 \
                else out[t] * params.repetition_penalty
    for t in set(output):
        out[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return out


@pytest.mark.parametrize("seed", range(5))
def test_apply_penalties_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    vocab = 50
    reqs, rows = [], []
    for i in range(4):
        params = SamplingParams(
            presence_penalty=rng.choice([0.0, 0.5, -1.0]),
            frequency_penalty=rng.choice([0.0, 0.3, 1.2]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
            logit_bias={rng.randrange(vocab): rng.uniform(-5, 5)} if i % 2 else None)
        reqs.append(SimpleNamespace(sampling_params=params,
                                    prompt_token_ids=[rng.randrange(vocab) for _ in range(8)],
                                    output_token_ids=[rng.randrange(vocab) for _ in range(12)]))
        rows.append([rng.uniform(-3, 3) for _ in range(vocab)])
    logits = torch.tensor(rows, dtype=torch.float32)
    apply_penalties(logits, reqs)
    for got, row, r in zip(logits.tolist(), rows, reqs):
        want = reference(row, r.sampling_params, r.prompt_token_ids, r.output_token_ids)
        assert got == pytest.approx(want, abs=1e-5)


def test_rows_without_penalties_are_untouched() -> None:
    logits = torch.randn(2, 10)
    before = logits.clone()
    reqs = [SimpleNamespace(sampling_params=SamplingParams(), prompt_token_ids=[1, 2],
                            output_token_ids=[3, 3])] * 2
    apply_penalties(logits, reqs)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("bad", [{"presence_penalty": 3.0}, {"frequency_penalty": -2.5},
                                 {"repetition_penalty": 0.0}, {"logit_bias": {1: 200.0}},
                                 {"logit_bias": {"a": 1.0}}])
def test_penalty_params_are_validated(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
