"""Speculation counters, as vLLM exports them (vllm:spec_decode_num_drafts, ..._num_draft_tokens,
..._num_accepted_tokens, ..._num_accepted_tokens_per_pos): running totals of one engine."""
from __future__ import annotations

from typing import Any


class SpecStats:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0  # verifications (a request's drafts in one step)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens  # position i accepted

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(min(num_accepted, len(self.accepted_per_pos))):
            self.accepted_per_pos[i] += 1

    def as_stats(self) -> dict[str, Any]:
        """For the engine's stats(): absent when speculation is off."""
        if not self.accepted_per_pos:
            return {}
        return {"spec_num_drafts": self.num_drafts,
                "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_pos": list(self.accepted_per_pos)}

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: 1 + accepted drafts per verification (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
