"""Finish conditions for a generating request (token-level and text-level).

Intended per-step order in the engine (matches vLLM V1):

1. ``reason = check_token_stop(output_token_ids, eos_token_id, params)``
2. If ``reason == "stop"`` the last token is EOS / a stop token: do NOT feed
   it to the detokenizer (its text never appears in the output).
   Otherwise ``delta = detok.append(tok)``.
3. ``stop_str, pos = check_stop(detok.text, len(delta), params, num_output_tokens=...)``;
   a match finishes the request with reason "stop" (overriding "length")
   and the text is cut to ``detok.text[:pos]``.
"""

from __future__ import annotations

from pd_cluster.sampling_params import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"

# A model's EOS: one id, or several (Llama 3's generation_config lists three), or none.
EosIds = int | tuple[int, ...] | None


def eos_ids(eos_token_id: EosIds) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)


def _min_tokens_satisfied(num_output_tokens: int, params: SamplingParams) -> bool:
    # A stop (token or string) may only end the request once min_tokens
    # ordinary tokens precede it, i.e. the stopping token is number
    # min_tokens + 1. This matches vLLM's min-tokens logits masking, which
    # bans stop tokens while fewer than min_tokens tokens exist.
    return num_output_tokens > params.min_tokens


def check_token_stop(
    output_token_ids: list[int],
    eos_token_id: EosIds,
    params: SamplingParams,
    *,
    num_prompt_tokens: int = 0,
    max_model_len: int | None = None,
) -> str | None:
    """Return "stop", "length" or None for the token just appended.

    "stop": last token is EOS (unless ``ignore_eos``) or in ``stop_token_ids``.
    "length": ``max_tokens`` output tokens reached, or the sequence filled
    ``max_model_len``. A natural stop wins over length when both hold on the
    same token (the model did end on its own).
    """
    n = len(output_token_ids)
    if n == 0:
        return None
    if _min_tokens_satisfied(n, params):
        last = output_token_ids[-1]
        if not params.ignore_eos and last in eos_ids(eos_token_id):
            return FINISH_STOP
        if last in params.stop_token_ids:  # type: ignore[operator]
            return FINISH_STOP
    if params.max_tokens is not None and n >= params.max_tokens:
        return FINISH_LENGTH
    if max_model_len is not None and num_prompt_tokens + n >= max_model_len:
        return FINISH_LENGTH
    return None


def stop_token_id(output_token_ids: list[int], eos_token_id: EosIds, params: SamplingParams) -> int | None:
    """The stop_token_ids entry that ended the request (OpenAI ``stop_reason``)."""
    if output_token_ids and output_token_ids[-1] in params.stop_token_ids:  # type: ignore[operator]
        last = output_token_ids[-1]
        if params.ignore_eos or last not in eos_ids(eos_token_id):
            return last
    return None


def check_stop(
    text: str,
    new_text_len: int,
    params: SamplingParams,
    *,
    num_output_tokens: int | None = None,
) -> tuple[str | None, int | None]:
    """Look for a stop string in the text added this step.

    Returns ``(stop_str, truncate_to)`` where the caller keeps
    ``text[:truncate_to]``; ``(None, None)`` when nothing matched. The
    truncated text ends just before the stop string, or just after it with
    ``include_stop_str_in_output`` (text generated past the stop string in the
    same step is always dropped). Among several matches, the earliest wins.

    Only ``text[-(new_text_len + len(stop) - 1):]`` is searched per stop
    string: anything earlier was checked on previous steps, so the per-step
    cost is independent of the output length.
    """
    stops: list[str] = params.stop  # type: ignore[assignment]
    if not stops or new_text_len <= 0:
        return None, None
    if num_output_tokens is not None and not _min_tokens_satisfied(num_output_tokens, params):
        return None, None
    best: tuple[int, str] | None = None
    text_len = len(text)
    for s in stops:
        start = max(0, text_len - new_text_len - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[0] or (idx == best[0] and len(s) > len(best[1]))):
            best = (idx, s)
    if best is None:
        return None, None
    idx, s = best
    return s, idx + len(s) if params.include_stop_str_in_output else idx


class StopChecker:
    """Stateful convenience wrapper around the functions above for one request."""

    def __init__(
        self,
        params: SamplingParams,
        eos_token_id: EosIds,
        *,
        num_prompt_tokens: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        self.params = params
        self.eos_token_id = eos_token_id
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len
        self.stop_reason: int | str | None = None  # matched stop token id / string

    def check_token(self, output_token_ids: list[int]) -> str | None:
        reason = check_token_stop(
            output_token_ids,
            self.eos_token_id,
            self.params,
            num_prompt_tokens=self.num_prompt_tokens,
            max_model_len=self.max_model_len,
        )
        if reason == FINISH_STOP:
            self.stop_reason = stop_token_id(output_token_ids, self.eos_token_id, self.params)
        return reason

    def check_text(self, text: str, new_text_len: int, num_output_tokens: int) -> tuple[str | None, int | None]:
        stop_str, pos = check_stop(text, new_text_len, self.params, num_output_tokens=num_output_tokens)
        if stop_str is not None:
            self.stop_reason = stop_str
        return stop_str, pos
