"""Token log-probabilities in OpenAI's two response shapes (legacy completions, chat)."""
from __future__ import annotations

from typing import Any, Callable

TokenText = Callable[[int], str]
Logprobs = list[dict[int, float] | None]


def completion_logprobs(token_ids: list[int], logprobs: Logprobs, text: TokenText,
                        offset: int) -> dict[str, Any]:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}; ``offset`` is where these
    tokens' text starts in the choice's text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lps in zip(token_ids, logprobs):
        s = text(tid)
        tokens.append(s)
        token_lps.append(lps.get(tid) if lps else None)
        tops.append({text(t): lp for t, lp in lps.items()} if lps else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: Logprobs, text: TokenText,
                  top: int) -> dict[str, Any]:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}."""
    content = []
    for tid, lps in zip(token_ids, logprobs):
        ranked = sorted((lps or {}).items(), key=lambda kv: -kv[1])[:top]
        content.append({**_entry(tid, (lps or {}).get(tid), text),
                        "top_logprobs": [_entry(t, lp, text) for t, lp in ranked]})
    return {"content": content}


def _entry(token_id: int, logprob: float | None, text: TokenText) -> dict[str, Any]:
    s = text(token_id)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode())}
