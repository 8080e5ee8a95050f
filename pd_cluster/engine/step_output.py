"""Rank 0 only: a step's logits groups -> sampled tokens and prompt logprobs."""
from __future__ import annotations

import torch

from pd_cluster.engine.penalties import apply_penalties
from pd_cluster.engine.sampler import Sampler, apply_min_tokens_mask, token_logprobs
from pd_cluster.engine.scheduler import ModelRunnerOutput
from pd_cluster.engine.step_input import StepPlan
from pd_cluster.engine.structured.masks import apply_grammar_masks, follow_sampled


def sample_step(plan: StepPlan, logits: list[torch.Tensor], sampler: Sampler,
                result: ModelRunnerOutput) -> None:
    for chunk in plan.prompt_chunks:
        req = chunk.request
        k = req.sampling_params.prompt_logprobs
        req.prompt_logprobs.extend(token_logprobs(
            logits[chunk.group], req.prompt_token_ids[chunk.a + 1:chunk.b + 1],
            [k] * (chunk.b - chunk.a)))
    if plan.sample_group is None:
        return
    reqs = plan.sample_requests
    rows = logits[plan.sample_group]
    if any(r.sampling_params.min_tokens for r in reqs):
        rows = apply_min_tokens_mask(rows, [r.sampling_params for r in reqs],
                                     [r.num_output_tokens for r in reqs], reqs[0].eos_token_id)
    rows = apply_penalties(rows, reqs)
    if any(r.grammar is not None for r in reqs):
        rows = apply_grammar_masks(rows, reqs)
    sampled = sampler.sample(rows, [r.sampling_params for r in reqs],
                             [r.generator_for_next_token(rows.device) for r in reqs])
    if any(r.grammar is not None for r in reqs):
        follow_sampled(reqs, sampled.token_ids)
    for req, token, logprobs in zip(reqs, sampled.token_ids, sampled.logprobs):
        result.sampled_token_ids[req.request_id] = token
        result.logprobs[req.request_id] = logprobs
