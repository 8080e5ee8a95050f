"""Request rules shared by the engine (LLM API) and the OpenAI server: one place, two callers.

The engine is lenient where the LLM API is (max_tokens past the context is capped, as vLLM's
offline API does); the server is strict where OpenAI's API is (a 400). Errors name the
offending parameter so the server can answer with an OpenAI-style body.
"""
from __future__ import annotations

from typing import Sequence


class InvalidRequest(ValueError):
    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def check_prompt(token_ids: Sequence[int], vocab_size: int, max_model_len: int,
                 param: str = "prompt") -> int:
    """Room left to generate after the prompt (>= 1), or InvalidRequest."""
    if not token_ids:
        raise InvalidRequest(f"{param}: must contain at least one token", param)
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size
           for t in token_ids):
        raise InvalidRequest(f"prompt_token_ids: every id must be an int in [0, {vocab_size})",
                             param)
    room = max_model_len - len(token_ids)
    if room <= 0:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len); "
            f"the prompt has {len(token_ids)} tokens, which leaves no room to generate.",
            param, "context_length_exceeded")
    return room


def check_max_tokens(requested: int | None, room: int, n_prompt: int,
                     max_model_len: int) -> int:
    """The server's rule: max_tokens defaults to the room left and may not exceed it."""
    if requested is None:
        return room
    if requested > room:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens; you requested "
            f"{n_prompt + requested} ({n_prompt} in the prompt, {requested} for the "
            f"completion).", "max_tokens", "context_length_exceeded")
    return requested
