"""What the client gets next, computed from the legs and what it was sent: pure functions.

Nothing here changes a leg or Sent: ``next_output`` returns an Output (the event, and what it
settles about the first token) that the dispatcher commits (Sent.commit) once it sends it.
"""
from __future__ import annotations

from pd_cluster.serving.routing.legs import EngineFailed, GenerateJob, Leg, Output, Sent, StreamEvent

_REPLACEMENT_CHAR = "\ufffd"

PromptLogprobs = list[dict[int, float] | None]


def waiting_prompt_logprobs(job: GenerateJob, legs: list[Leg], sent: Sent
                            ) -> tuple[bool, PromptLogprobs | None]:
    """(are they still to be sent, the prompt's logprobs if a leg has them): output waits for
    them (computed by P, while D may be ahead), and goes out with them."""
    if job.params.prompt_logprobs is None or sent.prompt_logprobs_sent:
        return False, None
    return True, next((lg.prompt_logprobs for lg in legs if lg.prompt_logprobs is not None),
                      None)


def next_output(leg: Leg, job: GenerateJob, sent: Sent,
                prompt_logprobs: PromptLogprobs | None, waiting: bool,
                stream_interval: int = 1) -> Output | None:
    """What the client gets next from ``leg``, given everything it produced so far; None
    when nothing changes. Once the client has its first token, output waits for
    ``stream_interval`` new tokens (or the finish). Raises EngineFailed when D's first token
    contradicts the one the client already has from P."""
    last = leg.last
    if last is None:
        return None
    if waiting and prompt_logprobs is None:
        return None  # nothing goes out before the prompt's logprobs
    if not waiting:
        prompt_logprobs = None
    first_from_prefill: bool | None = None
    if not leg.kind.ends_request:  # P
        if sent.any:
            return None  # D got there first: P's token only matters for the KV it ships
        done = leg.finished and last.finish_reason == "stop" and job.params.min_tokens <= 1
        if leg.finished and not done and last.finish_reason != "length":
            return None  # P stopped under a larger min_tokens: D has the real answer
        first_from_prefill = True
    else:
        done = leg.finished
        if sent.first_token_from_prefill and leg.token_ids:
            first_from_prefill = False  # compare once: D must continue P's token
            if leg.token_ids[0] != sent.token_ids[0]:
                # D recomputed the prompt (its KV did not arrive) and disagrees with the token
                # the client already has: never continue a different sequence. The request
                # resumes elsewhere from the client's tokens.
                raise EngineFailed(leg.engine, f"its first token {leg.token_ids[0]} differs "
                                               f"from the prefill engine's {sent.token_ids[0]}",
                                   dead=False)
    new_tokens = leg.token_ids[len(sent.token_ids):]
    if stream_interval > 1 and not done and sent.any and len(new_tokens) < stream_interval:
        # Held in the leg until there are enough (or it finishes): nothing is lost if the
        # engine fails meanwhile, the request resumes from what the client has.
        return Output(None, first_from_prefill) if first_from_prefill is False else None
    end = len(leg.text)
    if not done and job.params.stop:
        # Hold back what could be the start of a stop string: once sent, text cannot be
        # taken back if the engine later truncates it at the match (as vLLM does).
        end = max(end - (job.params.max_stop_len - 1), len(sent.text))
    if not leg.kind.ends_request and not done and _REPLACEMENT_CHAR in leg.text:
        new_text = ""  # P flushed a partial character; D's text will carry it whole
    else:
        new_text = leg.text[len(sent.text):end]
    if not new_tokens and not new_text and not done:
        return Output(None, first_from_prefill) if first_from_prefill is False else None
    new_logprobs = None
    if job.params.logprobs is not None:  # leg.logprobs runs parallel to leg.token_ids
        new_logprobs = leg.logprobs[len(sent.token_ids):len(leg.token_ids)]
    reason = (last.finish_reason or "stop") if done else None
    return Output(StreamEvent(new_text, new_tokens, reason, last.num_prompt_tokens,
                              last.num_cached_tokens, new_logprobs, prompt_logprobs),
                  first_from_prefill)
