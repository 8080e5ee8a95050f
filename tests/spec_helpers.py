"""A proposer for tests: proposes a known continuation (the run without speculation), with
chosen drafts made wrong, so that acceptance and rejection both happen on models whose random
text the ngram lookup rarely predicts."""
from __future__ import annotations

from typing import Any


class OracleProposer:
    """``reference``: prompt tuple -> the tokens generated without speculation; every
    ``wrong_every``-th proposal has its second draft replaced by ``wrong(token)``."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], k: int = 4,
                 wrong_every: int = 3, wrong: Any = None) -> None:
        self.reference, self.k, self.wrong_every = reference, k, wrong_every
        self.wrong = wrong or (lambda t: (t + 1) % 256 + 4)
        self.proposals = 0

    def observe(self, request: Any, num_drafts: int, num_accepted: int) -> None:
        pass

    def release(self, request_ids: list[str]) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}

    def check_no_leaks(self) -> None:
        pass

    def propose(self, requests: list[Any]) -> None:
        for r in requests:
            r.spec_token_ids = []
            want = self.reference.get(tuple(r.prompt_token_ids))
            if not r.is_decoding or want is None:
                continue
            n = r.num_output_tokens
            room = (r.sampling_params.max_tokens or 1 << 30) - n - 1
            drafts = list(want[n:n + min(self.k, room)])
            self.proposals += 1
            if self.proposals % self.wrong_every == 0 and len(drafts) > 1:
                drafts[1] = self.wrong(drafts[1])
            r.spec_token_ids = drafts


def use_proposer(engine: Any, proposer: Any) -> None:
    """Put ``proposer`` in an engine started with ``speculative`` set (in place of its own)."""
    assert engine.config.speculative is not None
    engine.proposer = engine.scheduler.proposer = proposer


def outputs(llm: Any, prompts: list[list[int]], params: Any) -> list[Any]:
    return [o.outputs[0] for o in llm.generate(prompts, params)]
