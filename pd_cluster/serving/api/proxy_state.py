"""The proxy's state: the tokenizer and the prompt rules, and the parts that serve requests
(engine pool, token channel, dispatcher, admission, metrics), wired from the cluster config."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pd_cluster.generation_defaults import load_generation_defaults
from pd_cluster.serving.api.errors import invalid_request
from pd_cluster.serving.api.grammar_check import GrammarCheck
from pd_cluster.serving.api.openai_schemas import ChatCompletionRequest, CompletionRequest
from pd_cluster.serving.api.tools import template_messages
from pd_cluster.serving.api.unknown_fields import UnknownFields
from pd_cluster.serving.cluster.cluster_config import ClusterConfig, resolve_model
from pd_cluster.serving.cluster.scaling import LiveActuator
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.admission import Admission
from pd_cluster.serving.routing.dispatch import Dispatcher
from pd_cluster.serving.routing.engine_pool import EnginePool
from pd_cluster.serving.routing.token_channel import TokenChannel
from pd_cluster.validation import InvalidRequest, check_max_tokens, check_prompt

logger = logging.getLogger(__name__)
MAX_CHOICES = 256  # prompts x n in one request


def load_tokenizer(cfg: ClusterConfig) -> Any:
    """The tokenizer the proxy encodes prompts with (the engines' own: engine.tokenizer, else
    the model's). Seconds of transformers on a first load: a deferred proxy does it while the
    engines load (cluster/proxy_actor.py); without torch where the files allow
    (pd_cluster/tokenizer_loader.py)."""
    from pd_cluster.tokenizer_loader import load_tokenizer as load
    return load(cfg.engine.get("tokenizer") or resolve_model(cfg.model))


class ProxyState:
    def __init__(self, cfg: ClusterConfig, engines: list[tuple[str, str, Any]],
                 starter: Any = None, tokenizer: Any = None):
        """``starter``: an EngineStarter (serving/cluster/engine_starter.py) when this proxy
        may start engines (launched on Ray); without one it can only remove or switch.
        ``tokenizer``: ``load_tokenizer(cfg)``'s, loaded ahead (None: loaded here)."""
        from pd_cluster.config import read_hf_config

        self.cfg = cfg
        path = resolve_model(cfg.model)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
        hf = read_hf_config(path)
        self.vocab_size = int(hf["vocab_size"])
        self.max_model_len = int(cfg.engine.get("max_model_len")
                                 or hf.get("max_position_embeddings", 2048))
        # Requests' sampling defaults (vLLM's --generation-config), named once at start.
        self.generation_defaults = load_generation_defaults(
            path, cfg.engine.get("generation_config", "auto"),
            cfg.engine.get("override_generation_config"))
        if (summary := self.generation_defaults.summary()) is not None:
            logger.info("%s", summary)
        self.pool = EnginePool(engines, cfg.proxy)
        self.metrics = ProxyMetrics(lambda: self.pool.engines, cfg.model_name,
                                    int(cfg.engine.get("block_size", 16)))
        failures = self.metrics.cache_report_failures
        self.pool.cache_feed.on_failure = lambda engine: failures.labels(engine).inc()
        channel = TokenChannel(cfg.proxy.health_check_timeout, self.pool.token_path_lost)
        self.pool.token_channel = channel
        self.dispatcher = Dispatcher(self.pool, cfg.mode, self.metrics, channel,
                                     cfg.proxy.max_retries, cfg.proxy.max_migrations,
                                     cfg.proxy.stream_interval)
        self.actuator = LiveActuator(self.pool, cfg, starter, self.metrics)
        self.planner_window: Any = None  # planner.enabled: the controller's RequestWindow
        self._planner_loop: Any = None
        self.admission = Admission(cfg.proxy.max_inflight, cfg.proxy.max_queue, self.metrics)
        self.inflight = 0  # requests in the proxy, queued ones included
        self.unknown_fields = UnknownFields()  # request fields ignored (each logged once)
        self.node_ip = _node_ip()
        # Tokenizing (chat templates included) runs off the event loop, one request at a
        # time, and only for requests admitted (app.py): the 429 bound covers it too.
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="proxy-tokenize")
        # Output constraints compile on their own threads, bounded in size and time (app.py)
        self.grammar_check = GrammarCheck(cfg.proxy.grammar_max_bytes,
                                          cfg.proxy.grammar_check_timeout)

    def start_planner(self) -> None:
        """planner.enabled: the SLO controller's thread, acting through this proxy's actuator
        (pd_cluster/planner/live.py); it runs off the event loop, so the actuator's blocking
        calls are allowed there."""
        if not self.cfg.planner.enabled:
            return
        from pd_cluster.planner.live import start_planner
        decisions, failures = self.metrics.planner_decisions, self.metrics.planner_look_failures
        self._planner_loop, self.planner_window = start_planner(
            self.cfg.planner, self.cfg.proxy.slo, self.actuator,
            int(self.cfg.engine.get("max_num_seqs", 64)),
            lambda action, reason: decisions.labels(action, reason).inc(),
            lambda error: failures.labels(error).inc())

    def stop_planner(self) -> None:
        if self._planner_loop is not None:
            self._planner_loop.stop()
            self._planner_loop, self.planner_window = None, None

    def planner_status(self) -> dict[str, Any]:
        """The plan in force for /cluster/status (`pd-cluster status`): {"enabled": false}
        when the controller does not run."""
        if self._planner_loop is None:
            return {"enabled": False}
        return self._planner_loop.status()

    def close(self) -> None:
        self.tokenizing.shutdown(wait=False, cancel_futures=True)
        self.grammar_check.close()

    # ---- prompt handling -----------------------------------------------------------------
    async def tokenize(self, req: CompletionRequest | ChatCompletionRequest
                       ) -> tuple[list[list[int]], list[str]]:
        """Token ids of each prompt and, for a completion with echo, each prompt's text (on
        the tokenizing thread; a 400 for a bad prompt is raised here)."""
        def work() -> tuple[list[list[int]], list[str]]:
            if isinstance(req, ChatCompletionRequest):
                return [self.chat_prompt(req)], []
            prompts = self.completion_prompts(req)
            return prompts, self.prompt_texts(req, prompts) if req.echo else []
        return await asyncio.wrap_future(self.tokenizing.submit(work))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt: a text or token-id prompt, or a list of either."""
        batch = _prompt_list(req)
        if len(batch) * req.n > MAX_CHOICES:
            raise invalid_request(f"prompt: {len(batch)} prompts x n={req.n} exceeds "
                                  f"{MAX_CHOICES} choices per request", "prompt")
        # a text prompt is tokenized as the engine (and vLLM) would
        return [list(self.tokenizer.encode(p)) if isinstance(p, str) else list(p)
                for p in batch]

    def prompt_texts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """What echo shows of each prompt: its text as sent, or its token ids decoded."""
        return [p if isinstance(p, str) else self.tokenizer.decode(ids)
                for p, ids in zip(_prompt_list(req), prompts)]

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        plan = getattr(req, "tool_plan", None)  # /tokenize's request has no tools
        try:
            text = self.tokenizer.apply_chat_template(
                template_messages(req.messages), add_generation_prompt=True, tokenize=False,
                chat_template=self.cfg.proxy.chat_template,  # None: the tokenizer's
                tools=plan.template_tools() if plan is not None else None)
        except Exception as e:  # noqa: BLE001 - a template error is the request's problem
            raise invalid_request(f"messages: chat template failed: {e}", "messages") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def max_tokens(self, requested: int | None, ids: list[int], prompt_param: str) -> int:
        """The request's max_tokens under the shared rules (pd_cluster.validation), at most
        the generation config's max_new_tokens (vLLM's server-wide limit)."""
        try:
            room = check_prompt(ids, self.vocab_size, self.max_model_len, prompt_param)
            return self.generation_defaults.cap(
                check_max_tokens(requested, room, len(ids), self.max_model_len))
        except InvalidRequest as e:
            raise invalid_request(str(e), e.param, e.code) from None


def _prompt_list(req: CompletionRequest) -> list[Any]:
    prompt = req.prompt
    return prompt if isinstance(prompt, list) and prompt and isinstance(
        prompt[0], (str, list)) else [prompt]


def _node_ip() -> str:
    """This proxy's node as the cluster knows it (the host name outside Ray, e.g. in tests)."""
    import socket
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - informational only
        pass
    return socket.gethostname()
