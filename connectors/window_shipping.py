"""Ship only the window: which prompt blocks of a sliding-window layer a decode engine can
still read, so the producer sends those and no others.

A decode engine's first query is the first output token, at position L (the prompt's length);
a layer with window W shows it the keys L - W < k <= L (HF's window), and every later query
sees later keys still. So a sliding layer's prompt blocks before the one holding position
L - W + 1 are never read on the decode side (its attention starts at the window's first
block: the C++ kernel walks from it, the Triton kernels from its first token, the torch
reference gathers from it), and they are not sent. They hold whatever the decode engine's
cache held before, so they are never registered for prefix hits there either
(``unshipped_blocks``): a later request's hit could need them.
"""
from __future__ import annotations

from typing import Any, Sequence


def layer_windows(kv_specs: Sequence[dict[str, Any]]) -> tuple[int | None, ...]:
    """Each layer's window from its described KV spec (kv_spec.py), None for full attention."""
    return tuple(s.get("window") if s.get("kind") == "sliding" else None for s in kv_specs)


def first_shipped_token(num_prompt_tokens: int, window: int | None, block_size: int) -> int:
    """The first prompt token (block-aligned) of a layer the decode engine will read."""
    if window is None or num_prompt_tokens <= 0:
        return 0
    return max(0, num_prompt_tokens - window + 1) // block_size * block_size


def unshipped_blocks(num_prompt_tokens: int, windows: Sequence[int | None],
                     block_size: int) -> int:
    """Leading prompt blocks that some layer did not ship (the smallest window's)."""
    return max((first_shipped_token(num_prompt_tokens, w, block_size) for w in windows),
               default=0) // block_size
