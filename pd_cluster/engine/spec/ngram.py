"""The ngram proposer (prompt lookup, vLLM's ``ngram``): the request's last n tokens (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up earlier in its prompt and
output; the tokens that followed the latest match are the drafts. No model, no state to ship:
the drafts are a function of the request's tokens, so a request arriving by KV transfer or
resumed elsewhere speculates alike.

Backing off: a verification that accepted nothing cost a wider step for one token, so a
request whose drafts keep failing proposes again only after 1, 2, 4 ... 32 steps (reset by the
first accepted draft), 8x that while most of the engine's recent drafts failed; ungrounded text
then runs almost as without speculation."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pd_cluster.config import SpeculativeConfig
from pd_cluster.request import Request

_MAX_COOLDOWN = 32
_LOW_RATE, _LOW_RATE_SCALE = 0.2, 8  # accepted / drafted below which backing off is longer


@dataclass
class _State:
    """Per request (on ``Request.spec_state``): the backoff, and the tokens as an array."""
    misses: int = 0  # verifications in a row that accepted nothing
    cooldown: int = 0  # steps left without proposing
    tokens: np.ndarray | None = None  # the request's tokens, the first ``length`` valid
    length: int = 0


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
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.max_model_len = max_model_len
        self.rate = 0.5  # accepted / drafted, a moving average over recent verifications

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome (the scheduler's update): backs off on a total miss, 8x
        longer while the engine's recent drafts are mostly rejected (a large batch of
        ungrounded requests would otherwise have one of them verifying in most steps)."""
        self.rate = 0.9 * self.rate + 0.1 * (num_accepted / num_drafts)
        state = self._state(request)
        if num_accepted:
            state.misses = 0
        else:
            state.misses += 1
            scale = _LOW_RATE_SCALE if self.rate < _LOW_RATE else 1
            state.cooldown = min(scale * 2 ** (state.misses - 1), scale * _MAX_COOLDOWN)

    def propose(self, requests: list[Request]) -> None:
        """Set ``spec_token_ids`` of each decoding request for the next step."""
        for request in requests:
            request.spec_token_ids = []
            if not request.is_decoding or request.is_finished:
                continue
            state = self._state(request)
            if state.cooldown:
                state.cooldown -= 1
                continue
            params = request.sampling_params
            room = self.max_model_len - request.num_tokens - 1  # positions the step may use
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - request.num_output_tokens - 1)
            k = min(self.k, room)
            if k < 1:
                continue
            request.spec_token_ids = find_drafts(self._tokens(request, state), self.min_n,
                                                 self.max_n, k)

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

    @staticmethod
    def _tokens(request: Request, state: _State) -> np.ndarray:
        """The request's tokens as an array, extended in place (amortised: no copy per step)."""
        n, arr, have = request.num_tokens, state.tokens, state.length
        if arr is None or len(arr) < n or have > n:  # full, or tokens dropped
            grown = np.empty(max(2 * n, 64), dtype=np.int64)
            if arr is not None and have <= n:
                grown[:have] = arr[:have]
            else:
                have = 0
            arr = grown
        arr[have:n] = request.token_ids_range(have, n)
        state.tokens, state.length = arr, n
        return arr[:n]
