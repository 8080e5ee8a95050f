"""Offline batch API mirroring vLLM: ``LLM(model=...).generate(prompts, sampling_params)``
and ``.chat(messages, sampling_params)``."""
from __future__ import annotations

import itertools
import logging
from typing import Any, Sequence

from tqdm import tqdm

from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine, PromptType
from pd_cluster.generation_defaults import load_generation_defaults
from pd_cluster.outputs import RequestOutput
from pd_cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any):
        """``model``: what `pd-cluster serve` takes (a preset name, a checkpoint directory or
        a Hugging Face repo id, from the hub cache or downloaded); None: the built-in model."""
        from pd_cluster.serving.cluster.model_source import check_model
        model = check_model("tiny-llama" if model is None else model)
        config = EngineConfig.from_kwargs(model, **engine_args)
        # generation_config / override_generation_config: checked before the engine loads
        self._defaults = load_generation_defaults(model, config.generation_config,
                                                  config.override_generation_config)
        if (summary := self._defaults.summary()) is not None:
            logger.info("%s", summary)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no SamplingParams: the generation
        config's sampling keys over SamplingParams' defaults (vLLM's method)."""
        return self._defaults.sampling_params()

    def close(self) -> None:
        """Stop the engine's KV connector and tensor-parallel workers (also on ``with`` exit)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params: got {len(params_list)} for "
                                 f"{len(prompt_list)} prompts")
        ids = [f"offline-{next(self._ids)}" for _ in prompt_list]
        added: list[str] = []
        try:
            for rid, prompt, params in zip(ids, prompt_list, params_list):
                self.engine.add_request(rid, prompt, params)
                added.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(added)  # leave nothing behind on error or Ctrl-C
            raise

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages)
        or to several (a list of such lists), through the tokenizer's chat template, as vLLM's
        ``LLM.chat``. Content is text (a string or text parts); any other part is a
        ValueError."""
        from pd_cluster.chat import render_chat
        prompts = []
        for conv in _as_conversations(messages):
            text, ids = render_chat(
                self.get_tokenizer(), conv, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        prompt_logprobs: dict[str, Any] = {}  # they come once, in an earlier output
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while len(finished) < len(ids):
            for out in self.engine.step():
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished:
                    out.prompt_logprobs = prompt_logprobs.pop(out.request_id, None)
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[rid] for rid in ids]


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_conversations(messages: Any) -> list[list[dict[str, Any]]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: expected a list of messages (or a list of such lists)")
    if all(isinstance(m, (list, tuple)) for m in messages):
        return [list(conv) for conv in messages]
    return [list(messages)]
