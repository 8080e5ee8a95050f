"""Per-request detokenization and stop checks, turning engine updates into RequestOutputs."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pd_cluster.engine.detokenizer import IncrementalDetokenizer
from pd_cluster.engine.stop_checker import FINISH_STOP, StopChecker
from pd_cluster.outputs import CompletionOutput, RequestOutput
from pd_cluster.request import Request, RequestStatus

_FINISH_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}


@dataclass
class _RequestState:
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    num_seen_tokens: int = 0
    num_emitted_chars: int = 0  # text handed out in deltas so far
    first_token_time: float | None = None
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.states: dict[str, _RequestState] = {}

    def add(self, request: Request, prompt: str | None, emitted_chars: int = 0) -> None:
        """Track a request; a resumed one arrives with output tokens, of whose text the client
        already has ``emitted_chars`` characters."""
        params = request.sampling_params
        state = _RequestState(
            prompt, IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                           params.skip_special_tokens),
            StopChecker(params, request.eos_token_id, num_prompt_tokens=request.num_prompt_tokens,
                        max_model_len=self.max_model_len))
        for token in request.output_token_ids:
            state.detokenizer.append(token)
        state.num_seen_tokens = len(request.output_token_ids)
        state.num_emitted_chars = emitted_chars
        self.states[request.request_id] = state

    def process(self, updated: list[Request]) -> tuple[list[RequestOutput], list[tuple[Request, RequestStatus]]]:
        """Outputs for requests with new tokens, and the ones that must finish now."""
        outputs, to_finish = [], []
        now = time.monotonic()
        for request in updated:
            state = self.states[request.request_id]
            detok, checker = state.detokenizer, state.stop_checker
            new_tokens = request.output_token_ids[state.num_seen_tokens:]
            reason, by_string = None, False
            for i in range(len(new_tokens)):
                seen = state.num_seen_tokens + i + 1
                ids = request.output_token_ids  # a slice only if several tokens came at once
                reason = checker.check_token(ids if seen == len(ids) else ids[:seen])
                if reason == FINISH_STOP:
                    break  # a stop token's text never appears in the output
                delta = detok.append(new_tokens[i])
                if request.sampling_params.stop:
                    stop_str, pos = checker.check_text(detok.text, len(delta),
                                                       state.num_seen_tokens + i + 1)
                    if stop_str is not None:
                        detok.truncate(pos)
                        reason, by_string = FINISH_STOP, True
                        break
                if reason:
                    break
            if reason and i + 1 < len(new_tokens):
                # Several tokens came at once (speculation) and one ended the request: the
                # ones after it were never generated, as without speculation.
                del request.output_token_ids[state.num_seen_tokens + i + 1:]
                del request.output_logprobs[state.num_seen_tokens + i + 1:]
                new_tokens = new_tokens[:i + 1]
            state.num_seen_tokens = len(request.output_token_ids)
            state.first_token_time = state.first_token_time or now
            if reason:
                if not by_string:
                    detok.flush()  # emit bytes held back waiting for a character to complete
                request.stop_reason = checker.stop_reason
                to_finish.append((request, _FINISH_STATUS[reason]))
                request.finish_reason = reason
            outputs.append(self._output(request, state, self._delta_text(request, state, reason),
                                        new_tokens, finished=reason is not None))
        return outputs, to_finish

    @staticmethod
    def _delta_text(request: Request, state: _RequestState, reason: str | None) -> str:
        """New text that can no longer change: while running, the last max_stop_len - 1
        characters could still become a stop string (then they are cut, not sent)."""
        text = state.detokenizer.text
        end = len(text)
        if reason is None and request.sampling_params.stop:
            end = max(end - (request.sampling_params.max_stop_len - 1), state.num_emitted_chars)
        delta = text[state.num_emitted_chars:end]
        state.num_emitted_chars = max(end, state.num_emitted_chars)
        return delta

    def finished_output(self, request: Request) -> RequestOutput:
        """Final output for a request finished from outside (abort)."""
        state = self.states[request.request_id]
        return self._output(request, state, "", [], finished=True)

    def _output(self, request: Request, state: _RequestState, delta_text: str,
                delta_tokens: list[int], finished: bool) -> RequestOutput:
        params = request.sampling_params
        completion = CompletionOutput(
            index=0, text=state.detokenizer.text, token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason if finished else None,
            stop_reason=request.stop_reason if finished else None,
            logprobs=list(request.output_logprobs) if params.logprobs is not None else None,
            delta_text=delta_text, delta_token_ids=list(delta_tokens),
            delta_logprobs=(request.output_logprobs[len(request.output_logprobs)
                                                    - len(delta_tokens):]
                            if params.logprobs is not None else None))
        metrics = {"arrival_time": request.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        if finished:
            self.states.pop(request.request_id, None)
        return RequestOutput(request.request_id, state.prompt, request.prompt_token_ids,
                             [completion], finished, request.num_cached_tokens,
                             self._prompt_logprobs(request, state), metrics)

    @staticmethod
    def _prompt_logprobs(request: Request, state: _RequestState
                         ) -> list[dict[int, float] | None] | None:
        """The prompt's logprobs, in the first output after they are all computed here."""
        if (request.sampling_params.prompt_logprobs is None or state.prompt_logprobs_sent
                or len(request.prompt_logprobs) != request.num_prompt_tokens):
            return None
        state.prompt_logprobs_sent = True
        return list(request.prompt_logprobs)
