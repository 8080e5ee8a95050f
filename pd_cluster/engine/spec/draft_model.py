"""The draft_model proposer (vLLM's ``draft_model``): a small model with the served model's
tokenizer proposes each decoding request's next k tokens, greedily, one batched draft forward
per draft position (draft_runner.py runs them on the draft's own cache).

Per request the draft's cache holds the request's tokens up to ``computed``, then the drafts it
was fed last step (d1..d(k-1) at positions base..). Before proposing again, the fed drafts that
the request's tokens now confirm stay (their KV is the accepted tokens' KV); the rest is rolled
back (``computed`` moves back; those slots are simply written again). Then one forward catches
the draft up on whatever the request gained: the whole prompt and first token when it starts
decoding here (its own prefill), the accepted tokens and the target's token after them later.
Through P/D (draft_pd.py) a request's draft blocks are reserved when it is admitted to wait for
its KV, and a prefill engine with the same draft ships the prompt's draft KV into them: the
catch-up then starts after the prompt (only where it did not come does the draft run its
prefill here).

Lossless for sampling too, with the verifier's point-mass rule (rejection.py with q = None): the
greedy draft d(j+1) is a function of the tokens before it, so at each position the proposal is
a point mass; accepting d with probability p(d) and otherwise drawing from p without d, renormed,
gives P(d) = p(d) and P(x) = (1 - p(d)) p(x) / (1 - p(d)) = p(x) for x != d: exactly p. (The
draft's own probabilities would accept more often; the point-mass rule needs none of them.)

A request whose drafts keep failing stops proposing for a while (backoff.py): its draft cache
catches up on the tokens it missed when it proposes again.

A request that leaves the running set (finished, aborted, preempted) gives its draft blocks
back at the next proposal or abort; a preempted request catches up again when it returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pd_cluster.config import SpeculativeConfig
from pd_cluster.engine.spec.draft_runner import Chunk, DraftRunner
from pd_cluster.engine.spec.pooled_proposer import PooledProposer
from pd_cluster.request import Request


@dataclass
class _State:
    request: Request  # identity: a request id used again is another request
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose draft KV holds the request's own tokens
    fed: list[int] = field(default_factory=list)  # drafts written at positions computed..
    misses: int = 0  # backoff.py's
    cooldown: int = 0
    kept: float = 0.0
    lost: float = 0.0
    receiving: bool = False  # reserved for draft KV coming from a prefill engine (draft_pd.py)


class DraftModelProposer(PooledProposer):
    def __init__(self, config: SpeculativeConfig, runner: DraftRunner,
                 max_model_len: int) -> None:
        super().__init__(config.num_speculative_tokens, runner, max_model_len, _State)
        self.runner: DraftRunner = runner
        # Through P/D (draft_pd.py): whether a request's draft KV landed with its KV (None:
        # it did not).
        self.landed: Callable[[str], bytes | None] = lambda request_id: None
        self.prefill_tokens = 0  # prompt tokens the draft ran here (its own prefills)

    def _sweep(self, live: set[str]) -> None:
        """Give back the blocks of requests that left the running set (a reserved one only
        once it finished: it may still be waiting for its KV)."""
        self.release([rid for rid, s in self.states.items() if rid not in live
                      and not (s.receiving and not s.request.is_finished)])

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "spec_draft_prefill_tokens": self.prefill_tokens}

    def propose(self, requests: list[Request]) -> None:
        """Set ``spec_token_ids`` of each decoding request for the next step."""
        live = {r.request_id for r in requests}
        if self.backoff.skip(len(requests)):  # drafts do not pay at this batch size (backoff.py)
            self._sweep(live)
            for request in requests:
                request.spec_token_ids = []
            return
        self._sweep(live)
        active: list[tuple[Request, _State, int]] = []
        for request in requests:
            request.spec_token_ids = []
            k = self._room(request)
            if k < 1:
                continue
            state = self._state(request)
            if state.receiving:  # its first proposal: did the prompt's draft KV come?
                state.receiving = False
                if self.landed(request.request_id) is not None:
                    state.computed = request.num_prompt_tokens
            if self.backoff.resting(state):
                continue
            k = min(k, self.backoff.width(state, k, len(requests)))  # fewer draft forwards too
            n = request.num_tokens
            confirmed = 0  # fed drafts the request's tokens now hold: their KV stays
            for a, b in zip(state.fed, request.token_ids_range(state.computed, n)):
                if a != b:
                    break
                confirmed += 1
            state.computed = min(state.computed + confirmed, n - 1)  # the rest rolls back
            state.fed = []
            # Positions up to n + k - 2: the last draft is proposed, never fed.
            if self.runner.grow(state.blocks, n + k - 1):
                active.append((request, state, k))
        if not active:
            return
        chunks: list[Chunk] = [(s.blocks, s.computed, r.token_ids_range(s.computed, r.num_tokens),
                                r.num_prompt_tokens, True) for r, s, _ in active]
        self.prefill_tokens += sum(max(0, r.num_prompt_tokens - s.computed) for r, s, _ in active)
        drafts = [[t] for t in self.runner.next_tokens(chunks)]
        for r, s, _ in active:
            s.computed = r.num_tokens
        for j in range(1, max(k for _, _, k in active)):
            more = [i for i, (_, _, k) in enumerate(active) if k > j]
            chunks = [(active[i][1].blocks, active[i][0].num_tokens + j - 1, [drafts[i][-1]],
                       active[i][0].num_prompt_tokens, True) for i in more]
            for i, token in zip(more, self.runner.next_tokens(chunks)):
                active[i][1].fed.append(drafts[i][-1])
                drafts[i].append(token)
        for (request, _, _), d in zip(active, drafts):
            request.spec_token_ids = [int(t) for t in d]
