"""How many prompt tokens a step may carry beside the requests it decodes.

A step with no decoding request takes the whole token budget. While requests decode, prompt
chunks ride in their steps (Sarathi-Serve's mixed step), and the chunk is bounded, in order:
- by ``max_prefill_tokens_per_step`` (a fixed cap);
- with ``tpot_target_ms``, by what the decoding requests' TPOT slack pays for: a decode
  step's measured time plus the least slack of those that can still meet the target
  (tpot_budget.py; one block at least, so prompts always progress; requests past saving do
  not hold prompts back, and when none can be saved the step takes the whole budget: held to
  the target it would save nobody and slow every prompt behind, an overload that feeds
  itself);
- with ``ttft_target_ms`` as well, widened to what the queued prompts' TTFT deadlines need
  (ttft_budget.py), as far as the cap.
Step times come from the engine's own measurements (step_time_model.py); until they are
known only the cap applies.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from pd_cluster.config import EngineConfig
from pd_cluster.engine.step_time_model import StepTimeModel
from pd_cluster.request import Request
from pd_cluster.tpot_budget import Decoding, request_slack
from pd_cluster.ttft_budget import Queued, rate_needed


def prompt_tokens(config: EngineConfig, step_times: StepTimeModel, now: float,
                  running: Sequence[Request], waiting: Iterable[Request], max_model_len: int,
                  budget: int) -> int:
    """Prompt tokens this step may take out of ``budget``."""
    decoding = [r for r in running if r.is_decoding]
    if not decoding:
        return budget
    if config.max_prefill_tokens_per_step is not None:
        budget = min(budget, config.max_prefill_tokens_per_step)
    if config.tpot_target_ms is None:
        return budget
    fits = _within_tpot(step_times, decoding, now, config.tpot_target_ms / 1e3, max_model_len)
    if fits is None:
        return budget
    width = max(fits - len(decoding), config.block_size)
    if config.ttft_target_ms is not None:
        prompts = [*(r for r in running if not r.is_decoding), *waiting]
        needed = _for_ttft(step_times, prompts, len(decoding), now,
                           config.ttft_target_ms / 1e3, budget)
        width = max(width, needed or 0)
    return min(budget, width)


def _within_tpot(step_times: StepTimeModel, decoding: list[Request], now: float,
                 target: float, max_model_len: int) -> int | None:
    """The widest step that keeps every decoding request that can still meet ``target``
    TPOT within it; None: no bound (the step times are not known yet, or no request can
    still meet the target)."""
    decode_step = step_times.seconds_for(len(decoding))
    if decode_step is None:
        return None
    slacks = [request_slack(_progress(r, now, max_model_len), decode_step, target)
              for r in decoding]
    within = [s for s in slacks if s >= 0]
    return step_times.tokens_within(decode_step + min(within)) if within else None


def _for_ttft(step_times: StepTimeModel, prompts: list[Request], decoding: int, now: float,
              target: float, widest: int) -> int | None:
    """The prompt chunk that brings the queued ``prompts`` still able to meet the TTFT
    target in within it; None: nothing waits or the step times are unknown; ``widest`` when
    no width keeps up."""
    fastest = step_times.prompt_rate(widest, decoding)
    if fastest is None:
        return None
    queued = [Queued(r.num_tokens - r.num_computed_tokens, r.arrival_time) for r in prompts]
    rate = rate_needed(queued, now, target, fastest)
    if rate <= 0:
        return None
    chunk = step_times.tokens_for_rate(rate, decoding)
    return widest if chunk is None else min(chunk, widest)


def _progress(request: Request, now: float, max_model_len: int) -> Decoding:
    start = request.first_token_time if request.first_token_time is not None else now
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is None:  # unbounded: the context bounds it
        max_tokens = max_model_len - request.num_prompt_tokens
    done = request.first_token_index
    return Decoding(now - start, max(request.num_output_tokens - done, 1),
                    max(max_tokens - done, 1))
