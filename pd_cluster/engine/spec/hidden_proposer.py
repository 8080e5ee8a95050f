"""The proposer of hidden-state heads (``speculative: {method: mtp}``; hidden_head.py): after
each step the engine hands it the target's hidden states (``capture``), and it proposes each
decoding request's next k tokens with the head, chained k times (vLLM's way with one MTP layer).

Per request it keeps the target's hidden states not yet fed to the head (``hidden``, positions
``hidden_start`` ..) and the head's cache, which holds positions up to ``computed`` with the
target's hidden states. A proposal for a request of n tokens: one forward catches the head up
on positions computed .. n-2 (hidden state h_p, token p+1: the last one gives d1), then the
chain runs positions n-1 .. n+k-3 on the head's own states and the drafts (d2 .. dk). The
chained positions' KV read the head's states, not the target's, so they never stay: the next
catch-up writes them again from ``computed`` = n-1. After verification the target's hidden
states at the kept positions (the last token and the accepted drafts) are the valid ones: rows
at positions >= the request's computed tokens are dropped when the next step's arrive.

Lossless as draft_model's (its docstring): the drafts are greedy, a point mass; verify.py keeps
exactly the tokens the target would draw. A request with no hidden states for some position
(its KV computed elsewhere) gets no drafts; the engine keeps that from happening (prefix
caching off: llm_engine.py). Through P/D (mtp_pd.py) the head's blocks for the prompt are
reserved when the request is admitted to wait for its KV (``reserve``); at its first proposal,
if the prefill engine's MTP KV and last hidden state landed, the head starts after the prompt
(computed = L - 1, that hidden state); else the request decodes without drafts (D has no
hidden states for its prompt), unless D computed the prompt itself after a failed transfer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pd_cluster.config import SpeculativeConfig
from pd_cluster.engine.spec.head_runner import HeadChunk, HeadRunner
from pd_cluster.engine.spec.hidden_head import TargetRows
from pd_cluster.engine.spec.pooled_proposer import PooledProposer
from pd_cluster.request import Request


@dataclass
class _State:
    request: Request  # identity: a request id used again is another request
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # head positions written with the target's hidden states
    hidden: torch.Tensor | None = None  # the target's, positions hidden_start ..
    hidden_start: int = 0
    broken: bool = False  # a position's hidden state never came: no drafts
    drafts: list[int] = field(default_factory=list)  # the last proposal (reused if nothing new)
    misses: int = 0  # backoff.py's
    cooldown: int = 0
    kept: float = 0.0
    lost: float = 0.0
    receiving: bool = False  # reserved for the MTP state coming from a prefill engine

    @property
    def hidden_end(self) -> int:
        return self.hidden_start + (0 if self.hidden is None else self.hidden.shape[0])


class HiddenStateProposer(PooledProposer):
    def __init__(self, config: SpeculativeConfig, runner: HeadRunner,
                 max_model_len: int) -> None:
        super().__init__(config.num_speculative_tokens, runner, max_model_len, _State)
        self.runner: HeadRunner = runner
        # Through P/D (mtp_pd.py): what came with a request's MTP KV (None: it did not), and
        # that as the target's hidden state at the prompt's last position [1, hidden].
        self.landed: Callable[[str], bytes | None] = lambda request_id: None
        self.decode_landed: Callable[[bytes], torch.Tensor] | None = None
        self.prefill_tokens = 0  # prompt positions 0 .. L - 2 the head ran here (its prefill)

    def _land(self, request: Request, state: _State) -> None:
        """A request from a prefill engine starts decoding: start after its prompt where the
        MTP state came with its KV."""
        state.receiving = False
        data = self.landed(request.request_id)
        if data is None or self.decode_landed is None:
            return  # capture finds positions without hidden states: no drafts (unless D
            # computed the prompt itself: a failed transfer, recomputed here)
        state.computed = state.hidden_start = request.num_prompt_tokens - 1
        state.hidden = self.decode_landed(data)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "spec_draft_prefill_tokens": self.prefill_tokens}

    # ---- the engine's hook ---------------------------------------------------------------
    def capture(self, rows: list[TargetRows], hidden: torch.Tensor) -> None:
        """A step's target hidden states (``rows``: where each request's positions are),
        before the step's outcome moves the requests on."""
        for r in rows:
            state = self._state(r.request)
            # Recomputed from earlier (preempted): the head is written again from there.
            state.computed = min(state.computed, r.start)
            new = hidden[r.first:r.first + r.count]
            keep_from = state.computed
            if state.hidden is not None and state.hidden_start <= keep_from <= r.start \
                    <= state.hidden_end:
                old = state.hidden[keep_from - state.hidden_start:r.start - state.hidden_start]
                state.hidden = torch.cat([old, new])
                state.hidden_start = keep_from
            elif r.start == keep_from:
                state.hidden, state.hidden_start = new.clone(), r.start
            else:  # positions computed .. start - 1 have no hidden state here
                state.broken, state.hidden = True, None

    # ---- proposing -----------------------------------------------------------------------
    def propose(self, requests: list[Request]) -> None:
        """Set ``spec_token_ids`` of each decoding request for the next step."""
        live = {r.request_id for r in requests}
        self.release([rid for rid, s in self.states.items() if rid not in live
                      and not (s.receiving and not s.request.is_finished)])
        for request in requests:
            request.spec_token_ids = []
            state = self.states.get(request.request_id)
            if state is not None and state.receiving and request.is_decoding \
                    and state.request is request:
                self._land(request, state)
        if self.backoff.skip(len(requests)):  # drafts do not pay at this batch size
            return
        active: list[tuple[Request, _State, int]] = []
        for request in requests:
            k = self._room(request)
            state = self.states.get(request.request_id)
            if k < 1 or state is None or state.broken or self.backoff.resting(state):
                continue
            k = min(k, self.backoff.width(state, k, len(requests)))
            n = request.num_tokens
            if state.computed >= n - 1:  # nothing new since the last proposal (not scheduled)
                request.spec_token_ids = state.drafts[:k]
                continue
            if state.hidden_start > state.computed or state.hidden_end < n - 1:
                continue  # cannot happen while capture saw every step; lossless anyway
            # Head positions up to n + k - 3 (the catch-up's last is n - 2).
            if self.runner.grow(state.blocks, n + k - 2):
                active.append((request, state, k))
        if not active:
            return
        chunks = []
        for r, s, _ in active:
            self.prefill_tokens += max(0, min(r.num_tokens, r.num_prompt_tokens) - 1 - s.computed)
            rows = s.hidden[s.computed - s.hidden_start:r.num_tokens - 1 - s.hidden_start]
            chunks.append(HeadChunk(s.blocks, s.computed,
                                    r.token_ids_range(s.computed + 1, r.num_tokens), rows,
                                    r.num_prompt_tokens))
        out, tokens = self.runner.run(chunks)
        states = list(out)  # each request's head state at its last position
        drafts = [[t] for t in tokens]
        for r, s, _ in active:  # the rows fed; those after them are unverified: dropped
            s.computed = r.num_tokens - 1
            s.hidden, s.hidden_start = None, s.computed
        for j in range(1, max(k for _, _, k in active)):
            more = [i for i, (_, _, k) in enumerate(active) if k > j]
            chunks = [HeadChunk(active[i][1].blocks, active[i][0].num_tokens + j - 2,
                                [drafts[i][-1]], states[i].unsqueeze(0),
                                active[i][0].num_prompt_tokens)
                      for i in more]
            step_states, step_tokens = self.runner.run(chunks)
            for at, i in enumerate(more):
                states[i] = step_states[at]
                drafts[i].append(step_tokens[at])
        for (request, state, _), d in zip(active, drafts):
            state.drafts = request.spec_token_ids = [int(t) for t in d]
