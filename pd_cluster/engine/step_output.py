"""Rank 0 only: a step's logits groups -> sampled tokens and prompt logprobs."""
from __future__ import annotations

import torch

from pd_cluster.engine.penalties import apply_penalties
from pd_cluster.engine.sampler import Sampler, apply_min_tokens_mask, token_logprobs
from pd_cluster.engine.scheduler import ModelRunnerOutput
from pd_cluster.engine.spec.verify import verify
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
    if any(plan.sample_drafts):
        rows, reqs = _verify_drafts(plan, rows, sampler, result)
        if not reqs:
            return
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


def _verify_drafts(plan: StepPlan, rows: torch.Tensor, sampler: Sampler,
                   result: ModelRunnerOutput) -> tuple[torch.Tensor, list]:
    """Decide the requests with drafts (spec/verify.py); returns the rows and requests of the
    others, which sample as usual."""
    spec_rows, spec_reqs, spec_drafts, plain_rows, plain_reqs = [], [], [], [], []
    start = 0
    for req, drafts in zip(plan.sample_requests, plan.sample_drafts):
        n = len(drafts) + 1
        if drafts:
            spec_rows.extend(range(start, start + n))
            spec_reqs.append(req)
            spec_drafts.append(drafts)
        else:
            plain_rows.append(start)
            plain_reqs.append(req)
        start += n
    # Every request speculating (the usual case while drafts pay): the rows as they are.
    spec = rows if not plain_reqs else rows[torch.tensor(spec_rows, dtype=torch.long,
                                                         device=rows.device)]
    for req, v in zip(spec_reqs, verify(spec, spec_reqs, spec_drafts, sampler)):
        result.sampled_token_ids[req.request_id] = v.token
        result.logprobs[req.request_id] = v.logprobs[-1]
        result.accepted_token_ids[req.request_id] = v.accepted
        result.accepted_logprobs[req.request_id] = v.logprobs[:-1]
    if not plain_reqs:
        return rows[:0], plain_reqs
    return rows[torch.tensor(plain_rows, dtype=torch.long, device=rows.device)], plain_reqs
