"""What every rank needs to run one step (``StepInput``), built once by the engine from its
SchedulerOutput, and what only rank 0 keeps to turn the logits into tokens (``StepPlan``).

The StepInput is the message the executor broadcasts to its workers: plain lists of ints and
the connector's typed metadata, msgpack-encoded (no Request objects, no pickle). Every rank
runs the same forward and computes logits for the same ``logit_rows`` groups, in order (the
vocabulary-parallel LM head is a collective, so all ranks must call it alike); only rank 0
samples.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from connectors.metadata import KVConnectorMetadata
from pd_cluster.engine.kv_tiers.ops import TierOps
from pd_cluster.engine.scheduler import ScheduledRequest
from pd_cluster.request import Request

_LOGITS_CHUNK = 512  # prompt positions whose logits are materialised at once


class StepInput(msgspec.Struct, tag="step", forbid_unknown_fields=True):
    """One forward: the batch (decodes first), its paged-cache layout and the logits wanted."""
    tokens: list[int]
    positions: list[int]
    query_start: list[int]  # len(batch) + 1 offsets into tokens
    seq_lens: list[int]
    block_tables: list[list[int]]  # KV cache group 0's, padded with 0 to one width
    num_decodes: int
    prompt_lens: list[int]  # per request (RoPE scalings that depend on the prompt length)
    # Each group is one compute_logits call over these [start, stop) hidden-row ranges.
    logit_rows: list[list[tuple[int, int]]] = []
    kv_meta: KVConnectorMetadata | None = None
    tier_ops: TierOps | None = None  # run first, also in an empty step (kv_tiers/ops.py)
    # The other KV cache groups' tables (engine/kv_groups.py), each as block_tables; [] with
    # one group.
    group_tables: list[list[list[int]]] = []

    @property
    def empty(self) -> bool:
        return not self.tokens


@dataclass
class PromptLogprobChunk:
    """Logits group ``group`` scores prompt tokens a+1 .. b of ``request``."""
    request: Request
    group: int
    a: int
    b: int


@dataclass
class StepPlan:
    """Rank 0's side of a step: which logits group samples which requests."""
    sample_group: int | None = None
    sample_requests: list[Request] = field(default_factory=list)
    # Per sample request: the drafts this step verifies (its rows: one per draft, plus one).
    sample_drafts: list[list[int]] = field(default_factory=list)
    prompt_chunks: list[PromptLogprobChunk] = field(default_factory=list)


def build_step(scheduled: list[ScheduledRequest], block_size: int,
               kv_meta: KVConnectorMetadata | None, tier_ops: TierOps | None = None
               ) -> tuple[StepInput, StepPlan]:
    plan = StepPlan()
    if not scheduled:
        return StepInput([], [], [0], [], [], 0, [], kv_meta=kv_meta, tier_ops=tier_ops), plan
    batch = batch_order(scheduled)
    tokens: list[int] = []
    positions: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    sampling: list[int] = []  # batch indices whose step ends at the sequence end
    for i, item in enumerate(batch):
        req, start = item.request, item.request.num_computed_tokens
        end = start + item.num_new_tokens
        drafts = item.spec_token_ids  # after the request's last token, in lookahead slots
        tokens.extend(req.token_ids_range(start, end - len(drafts)))
        tokens.extend(drafts)
        positions.extend(range(start, end))
        query_start.append(query_start[-1] + item.num_new_tokens)
        seq_lens.append(end)
        if end - len(drafts) == req.num_tokens:
            sampling.append(i)
    tables = _padded([s.request.block_ids for s in batch])
    group_tables = [_padded([s.request.group_block_ids[k] for s in batch])
                    for k in range(1, len(batch[0].request.group_block_ids))]
    groups: list[list[tuple[int, int]]] = []
    _plan_prompt_logprobs(batch, query_start, groups, plan)
    if sampling:
        plan.sample_group = len(groups)
        groups.append([(query_start[i + 1] - 1 - len(batch[i].spec_token_ids),
                        query_start[i + 1]) for i in sampling])
        plan.sample_requests = [batch[i].request for i in sampling]
        plan.sample_drafts = [batch[i].spec_token_ids for i in sampling]
    num_decodes = sum(1 for s in batch if s.num_new_tokens == 1)
    prompt_lens = [s.request.num_prompt_tokens for s in batch]
    step = StepInput(tokens, positions, query_start, seq_lens, tables, num_decodes,
                     prompt_lens, groups, kv_meta, tier_ops, group_tables)
    return step, plan


def batch_order(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The step's order of its requests: decodes first (backends batch the one-token queries
    at the front)."""
    return sorted(scheduled, key=lambda s: s.num_new_tokens != 1)


def _padded(tables: list[list[int]]) -> list[list[int]]:
    """The tables padded with 0 to one width (one block at least)."""
    width = max(1, max(len(t) for t in tables))
    return [list(t) + [0] * (width - len(t)) for t in tables]


def _plan_prompt_logprobs(batch: list[ScheduledRequest], query_start: list[int],
                          groups: list[list[tuple[int, int]]], plan: StepPlan) -> None:
    """Prompt positions run now whose logits score the next prompt token (position p's logits
    score prompt token p + 1), in chunks that bound the [rows, vocab] logits."""
    for i, item in enumerate(batch):
        req = item.request
        if req.sampling_params.prompt_logprobs is None:
            continue
        start = req.num_computed_tokens
        if start == 0:  # (re)computed from the beginning, e.g. after a preemption
            req.prompt_logprobs = [None]
        if len(req.prompt_logprobs) != start + 1:
            continue  # earlier positions were not computed here (their KV came from P)
        stop = min(start + item.num_new_tokens, req.num_prompt_tokens - 1)
        for a in range(start, stop, _LOGITS_CHUNK):
            b = min(a + _LOGITS_CHUNK, stop)
            first = query_start[i] + a - start
            plan.prompt_chunks.append(PromptLogprobChunk(req, len(groups), a, b))
            groups.append([(first, first + b - a)])
