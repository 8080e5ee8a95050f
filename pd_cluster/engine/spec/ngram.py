"""The ngram proposer (prompt lookup, vLLM's ``ngram``): the request's last n tokens (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up earlier in its prompt and
output; the tokens that followed the latest match are the drafts. No model, no state to ship:
the drafts are a function of the request's tokens, so a request arriving by KV transfer or
resumed elsewhere speculates alike.

Backing off (backoff.py): a request whose drafts keep failing stops proposing for a while.
And a step pays almost nothing for a request whose recent tokens occur nowhere earlier (the
common case on ungrounded text): each request keeps the set of its earlier min-n-grams, grown
by the step's new tokens, so the lookup runs only when its last min-n-gram is in it (exactly
when it can find drafts).

Growing (``num_speculative_tokens_max``): copied text is copied in long runs, so a request
whose drafts were all kept verifies twice as many next step (up to the max), and goes back to
``num_speculative_tokens`` at the first rejected draft. On the grounded benchmark at batch 1 a
run of ~45 copied tokens took 9-10 verifies at 4 drafts each; growing to 16, about 5. The
backoff's width (each next draft only while its chance of being kept repays its cost) still
bounds it, so where a token is not nearly free the wider verify is not taken."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pd_cluster.config import SpeculativeConfig
from pd_cluster.engine.spec.backoff import Backoff
from pd_cluster.request import Request


@dataclass
class _State:
    """Per request (on ``Request.spec_state``): the backoff, the tokens as an array, and the
    min-n-grams that end before the last token (those with a successor)."""
    misses: int = 0  # verifications in a row that accepted nothing
    cooldown: int = 0  # steps left without proposing
    kept: float = 0.0  # backoff.py's acceptance estimate
    lost: float = 0.0
    tokens: np.ndarray | None = None  # the request's tokens, the first ``length`` valid
    length: int = 0
    grams: set[tuple[int, ...]] = field(default_factory=set)
    grams_end: int = 0  # grams ending at positions < grams_end are in ``grams``
    span: int = 0  # drafts the next verify may take (grows while all are kept); 0: k


def find_drafts(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The ``k`` tokens after the latest earlier occurrence of the longest suffix of
    ``tokens`` (length in [min_n, max_n]) that occurs earlier; [] if none does. One pass over
    the tokens for the last one's earlier occurrences, then only those are extended back
    (ungrounded text: almost none, so a step pays about a microsecond per request)."""
    length = len(tokens)
    if length < min_n + 1:
        return []
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])  # each has a successor
    if not ends.size:
        return []
    matched = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(max_n, length - 1)):
        idx = ends - back
        alive &= idx >= 0
        alive[alive] = tokens[idx[alive]] == tokens[length - 1 - back]
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(matched == best)[-1]]) + 1
    return tokens[end:end + k].tolist()


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.k_max = config.max_drafts
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.max_model_len = max_model_len
        self.backoff = Backoff()

    @property
    def rate(self) -> float:
        return self.backoff.rate

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome (the scheduler's update), for the backoff and the
        span: all of a full-width verify kept doubles it, a rejected draft resets it."""
        state = self._state(request)
        self.backoff.observe(state, num_drafts, num_accepted)
        if num_accepted < num_drafts:
            state.span = 0
        elif num_drafts >= (state.span or self.k):
            state.span = min(2 * num_drafts, self.k_max)

    def propose(self, requests: list[Request]) -> None:
        """Set ``spec_token_ids`` of each decoding request for the next step. Per request the
        common cases cost a microsecond or two of plain Python (at batch 16 of a small model a
        step is ~2.5 ms, and numpy calls per request here were 8% of it): a resting request
        is skipped; else the last min-n-gram is looked up in the request's set; only a hit
        builds the token array and runs the lookup."""
        backoff, batch = self.backoff, len(requests)
        if backoff.skip(batch):  # drafts do not pay at this batch size (backoff.py)
            for request in requests:
                if request.spec_token_ids:
                    request.spec_token_ids = []
            return
        started, drafted = time.perf_counter(), 0
        for index, request in enumerate(requests):
            if request.spec_token_ids:
                request.spec_token_ids = []
            if not request.is_decoding or request.is_finished:
                continue
            if not backoff.probes(index, batch):  # a closed gate's probe: another's turn
                continue
            state = request.spec_state
            if state is None:
                state = request.spec_state = _State()
            elif state.cooldown:  # backoff.resting, inline (the common case at large batches)
                state.cooldown -= 1
                continue
            if not self._seen_before(request, state):
                continue
            params = request.sampling_params
            n = request.num_tokens
            room = self.max_model_len - n - 1  # positions the step may use
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - len(request.output_token_ids) - 1)
            k = min(state.span or self.k, room)
            if k < 1:
                continue
            k = min(k, backoff.width(state, k, batch))
            tokens = self._tokens(request, state)
            request.spec_token_ids = find_drafts(tokens, self.min_n, self.max_n, k)
            drafted += bool(request.spec_token_ids)
        backoff.proposed(time.perf_counter() - started, drafted)

    def release(self, request_ids: list[str]) -> None:
        """Nothing held outside the requests themselves."""

    def stats(self) -> dict[str, Any]:
        return {}

    def check_no_leaks(self) -> None:
        pass

    @staticmethod
    def _state(request: Request) -> _State:
        if request.spec_state is None:
            request.spec_state = _State()
        return request.spec_state

    def _seen_before(self, request: Request, state: _State) -> bool:
        """Whether the last min-n-gram of the request's tokens ends earlier too (find_drafts
        finds drafts exactly then); the set grows by the grams ending before the last token.
        Lists, not the array: a step adds a token or a few, and numpy's per-call cost is
        larger than the work."""
        n, m = request.num_tokens, self.min_n
        if n < m + 1:
            return False
        if state.grams_end > n - 1:  # tokens dropped (preempted, resumed): grams again
            state.grams, state.grams_end = set(), 0
        start = max(state.grams_end, m - 1)
        if start < n - 1:
            window = request.token_ids_range(start - m + 1, n - 1)
            state.grams.update(tuple(window[i:i + m]) for i in range(len(window) - m + 1))
            state.grams_end = n - 1
        out = request.output_token_ids
        last = out[-m:] if len(out) >= m else request.token_ids_range(n - m, n)
        return tuple(last) in state.grams

    @staticmethod
    def _tokens(request: Request, state: _State) -> np.ndarray:
        """The request's tokens as an array, extended in place (amortised: no copy per step)."""
        n, arr, have = request.num_tokens, state.tokens, state.length
        if arr is None or len(arr) < n or have > n:  # full, or tokens dropped
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            if arr is not None and have <= n:
                grown[:have] = arr[:have]
            else:
                have = 0  # tokens dropped (_seen_before restarted the grams)
            arr = grown
        arr[have:n] = request.token_ids_range(have, n)
        state.tokens, state.length = arr, n
        return arr[:n]
