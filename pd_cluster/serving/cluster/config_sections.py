"""The cluster config's sections other than the engine's and the connector's own: each role's
engines (replicas, resources, placement), the proxy, Ray and the engines' CPU use. cluster_config.py assembles them
into ClusterConfig."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pd_cluster.driver.cpu_setup import CpuPolicy


class ConfigSection(BaseModel):
    """Frozen, strict, no unknown keys (each named with its path by schema.config_error)."""
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class RoleConfig(ConfigSection):
    """One role's engines (the same keys for prefill, decode and colocated): how many, their
    resources per rank, and where Ray places them."""
    replicas: int = Field(1, ge=1)  # engines of this role
    # Ranks per engine (tensor parallelism): rank 0 in the engine actor, the others its worker
    # processes on the same node, one device each. num_cpus, num_gpus and the engine's KV
    # budget are per rank; the actor holds tensor_parallel_size x them.
    tensor_parallel_size: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, ge=0)  # Ray CPUs per rank; also its torch thread count on CPU
    num_gpus: float = Field(0.0, ge=0)  # 1 per rank on CUDA
    max_restarts: int = Field(3, ge=-1)  # Ray restarts a dead engine this many times (-1: ever)
    # Placement, all through Ray. Custom resources each engine needs (nodes started with
    # `ray start --resources`).
    resources: dict[str, float] = Field(default_factory=dict)
    node_labels: dict[str, str] = Field(default_factory=dict)  # `ray start --labels` it needs
    # How the role's replicas are laid out: a placement group strategy (null: Ray's default).
    strategy: Literal["spread", "pack", "strict_spread", "strict_pack"] | None = None
    # Prompt tokens an engine of this role computes per step while it has decodes running
    # (protects their inter-token latency). Unset: the engine section's value, else for decode
    # engines cluster_config.DECODE_PREFILL_CAP (they prefill only when the proxy finds that cheaper than P).
    max_prefill_tokens_per_step: int | None = Field(None, ge=1)

    @field_validator("resources")
    @classmethod
    def _resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory"):
                raise ValueError(f"{name}: use num_cpus / num_gpus instead")
            if amount <= 0:
                raise ValueError(f"{name}: must be a number > 0, got {amount!r}")
        return value

    @model_validator(mode="after")
    def _whole_gpus_per_rank(self) -> "RoleConfig":
        if self.tensor_parallel_size > 1 and 0 < self.num_gpus < 1:
            raise ValueError(f"num_gpus: {self.num_gpus} with tensor_parallel_size "
                             f"{self.tensor_parallel_size}: each rank needs a whole GPU (NCCL "
                             f"refuses two ranks on one GPU)")
        return self

    @model_validator(mode="after")
    def _strategy_needs_resources(self) -> "RoleConfig":
        if self.strategy and not self.demand():
            raise ValueError("strategy: a placement group needs num_cpus, num_gpus or "
                             "resources > 0 per engine")
        return self

    def demand(self) -> dict[str, float]:
        """Ray resources one engine of this role holds (all its ranks)."""
        tp = self.tensor_parallel_size
        out = {"CPU": self.num_cpus * tp, "GPU": self.num_gpus * tp, **self.resources}
        return {k: float(v) for k, v in out.items() if v}


class SloConfig(ConfigSection):
    """The service-level targets the cluster serves to (as vLLM's benchmark counts goodput):
    the proxy's P-or-D choice and a decode engine lending its cores to prefill both keep
    every running request within tpot_ms (tpot_budget.py). Defaults: an interactive chat
    (first token within 2 s, 20 tokens/s after it); set your own (serve --slo-tpot-ms)."""
    ttft_ms: float = Field(2000.0, gt=0)  # time to first token target, ms
    # Time per output token target, ms: (last token - first token) / (tokens - 1), per request.
    tpot_ms: float = Field(50.0, gt=0)
    # Percentile of a decode engine's recent step times taken as its step time when predicting
    # TPOT (higher: more conservative).
    percentile: float = Field(90.0, gt=0, le=100)


class ProxyConfig(ConfigSection):
    """The OpenAI-compatible HTTP proxy: where it listens, admission, routing, failure
    handling."""
    host: str = "127.0.0.1"  # address the API listens on (0.0.0.0: every interface)
    port: int = 8000  # 0: any free port (the launcher prints the URL)
    max_inflight: int = Field(256, ge=1)  # requests running at once; more wait in the queue
    # Requests waiting for an in-flight slot (first come, first served; their wait counts in
    # their TTFT); beyond it a request gets 429 with Retry-After.
    max_queue: int = Field(1024, ge=0)
    # Largest request body read (bytes); a larger one gets 413 before it is read whole (a
    # 128k-token prompt as token ids is ~1 MB of JSON).
    max_body_bytes: int = Field(32 << 20, ge=1)
    # Tokens per streamed chunk at least (as vLLM's stream_interval): the first token and the
    # last chunk go at once; fewer, larger chunks cost the proxy and the client less per token.
    stream_interval: int = Field(1, ge=1)
    # Which engine of a role gets a request: cache_aware (the longest cached prefix weighed
    # against load, from the engines' prefix-cache reports), least_loaded or round_robin.
    routing: str = "cache_aware"
    # Per request in a disaggregated cluster: auto, remote prefill on P or prefill on D alone,
    # whichever is expected to give the first token sooner (routing/ttft_model.py); always:
    # every request with max_tokens > 1 goes through P.
    disaggregation: Literal["auto", "always"] = "auto"
    # auto: D prefills alone only when that is expected to give the first token this much
    # sooner than P would (P's queue or missing cache); below it, prefill stays off D.
    local_prefill_margin_ms: float = Field(20.0, ge=0)
    # auto: a local prefill on D delays each request D is decoding by its own duration; D
    # prefills alone only when the new request's gain beats the margin plus this share of that
    # total delay (0: ignore it; 1: a running request's second counts like the new one's).
    local_prefill_stall_weight: float = Field(1.0, ge=0)
    # Targets: D prefills alone only when the pause that adds keeps every request it decodes
    # (and one arriving meanwhile) within slo.tpot_ms; see SloConfig.
    slo: SloConfig = Field(default_factory=SloConfig)
    # Decode engines match the prompt against their own prefix cache and receive only the KV
    # blocks they lack (false: every prompt's KV is shipped whole, as before).
    decode_prefix_reuse: bool = True
    cache_events_interval: float = Field(0.25, gt=0)  # s between prefix-cache reports pulled
    # What a prompt block held only in an engine's lower KV tier (host memory or disk:
    # engine.kv_offloading_size) is worth to routing and the P-or-D cost estimate, as a share
    # of a device hit (1) over a miss (0): restoring it is a copy of its KV instead of its
    # prefill. The default 0.8: a host copy at memory/PCIe speed costs about a fifth of
    # recomputing (docs/architecture.md, "KV offloading").
    lower_tier_hit_weight: float = Field(0.8, ge=0, le=1)
    cache_index_max_blocks: int = Field(65536, ge=1)  # block hashes remembered per engine
    request_timeout: float = Field(120.0, gt=0)  # bound on every wait for one request
    health_check_interval: float = Field(2.0, gt=0)  # s between health checks of each engine
    health_check_timeout: float = Field(10.0, gt=0)  # s a health check may take before it fails
    unhealthy_threshold: int = Field(2, ge=1)  # failed checks before routing around an engine
    max_retries: int = Field(2, ge=0)  # extra engine pairs tried before any output is sent
    # Times a request may move to another engine when its engine fails mid-stream.
    max_migrations: int = Field(2, ge=0)
    max_restarts: int = 3  # Ray restarts a dead proxy this many times (on the launch node)
    # tool_choice "auto": pick tool calls out of the model's text with this parser (hermes,
    # qwen, llama3_json, mistral), as vLLM's --enable-auto-tool-choice --tool-call-parser.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # the parser for tool_choice "auto" (see above)
    # A Jinja chat template used instead of the tokenizer's (vLLM's --chat-template): the
    # template itself, or a file holding one (read on the launching node).
    chat_template: str | None = None
    # On SIGINT/SIGTERM or `pd-cluster stop`: new requests get 503 (Retry-After), requests
    # in flight get this many seconds to finish, then end with "server shutting down".
    shutdown_timeout: float = Field(30.0, ge=0)
    # Output constraints (json schemas, regex, grammars, tools) are compiled once by the
    # proxy before any engine sees them, on threads off the event loop: a larger one (bytes
    # of its text) is a 400, not compiled.
    grammar_max_bytes: int = Field(256 << 10, ge=1)
    # A constraint not compiled within this many seconds is a 400 naming its field (other
    # streams go on meanwhile); the answer is remembered for the same spec.
    grammar_check_timeout: float = Field(5.0, gt=0)
    log_stats_interval: float = 10.0  # s between per-engine stats lines in the log (0: off)
    # API keys (README, "Security"): one key or a list. With any key set (here or through
    # api_key_env), every route but /health and open_routes needs `Authorization: Bearer KEY`.
    api_key: str | list[str] | None = None
    # An environment variable of the launching shell holding the key (or several, comma-
    # separated), handed to the proxy through Ray; unset or empty is a launch error.
    api_key_env: str | None = None
    # Served without a key even when keys are set. /metrics is open by default, as vLLM's
    # (Prometheus scrapes it without a key); [] protects it too.
    open_routes: list[Literal["/metrics", "/cluster/status", "/version"]] = Field(
        default_factory=lambda: ["/metrics"])
    ssl_certfile: str | None = None  # TLS (uvicorn's): certificate, PEM; https with keyfile
    ssl_keyfile: str | None = None  # TLS: the certificate's private key, PEM

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: object) -> object:
        if isinstance(data, dict) and "token_transport" in data:
            raise ValueError("token_transport: removed; tokens always travel on the engines' "
                             "token stream (one frame per engine step): delete this key")
        return data

    @field_validator("port")
    @classmethod
    def _port(cls, value: int) -> int:
        if not 0 <= value < 65536:
            raise ValueError(f"must be in [0, 65535], got {value}")
        return value

    @model_validator(mode="after")
    def _tls_pair(self) -> "ProxyConfig":
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("ssl_certfile, ssl_keyfile: set both (or neither)")
        return self

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str | None) -> str | None:
        if value is None or "{{" in value or "{%" in value:
            return value  # the template itself
        from pathlib import Path
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"{value!r} is neither a Jinja template nor a file")
        return path.read_text()

    @field_validator("tool_call_parser")
    @classmethod
    def _tool_parser(cls, value: str | None) -> str | None:
        from pd_cluster.serving.api.tool_parsers import PARSERS
        if value is not None and value not in PARSERS:
            raise ValueError(f"must be one of {', '.join(PARSERS)}, got {value!r}")
        return value

    @field_validator("routing")
    @classmethod
    def _routing(cls, value: str) -> str:
        from pd_cluster.serving.routing.router import router_names
        if value not in router_names():
            raise ValueError(f"must be one of {', '.join(router_names())}, got {value!r}")
        return value


class CpuConfig(ConfigSection):
    """How engines use their node's CPU cores and runtime libraries."""
    # Each engine on CPU pins its compute threads (num_cpus of them) to cores of its own,
    # claimed on its node; with none free it does not pin and says so (driver/cpu_setup.py).
    pin_threads: bool = CpuPolicy.pin_threads
    # Cores of each node kept for the proxy, Ray and the OS: decode and colocated engines
    # claim them last, prefill engines first (on a 2-core node, one engine on core 1 leaves
    # core 0 to serving; in 1P1D, P shares core 0 with serving and D has core 1).
    reserve_cores: int = Field(CpuPolicy.reserve_cores, ge=0)
    # LD_PRELOAD tcmalloc and Intel OpenMP (libiomp5) into engines where the node has them.
    preload_libraries: bool = CpuPolicy.preload_libraries
    # A decode engine lends its cores to a prefill engine pinned on the same node while the
    # pause keeps its requests within proxy.slo.tpot_ms (the prefill step runs a thread on
    # them; the decode engine takes them back at its next step: driver/core_lending.py).
    lend_decode_cores: bool = True
    # A prefill engine lends its cores to a decode engine pinned on the same node while it has
    # no prompt to compute (a decode step runs a thread on them; the prefill engine takes them
    # back as soon as a prompt arrives: driver/core_lending.py). Off: where P shares its core
    # with serving, as on a 2-core node, the borrowed thread waits for serving at every
    # parallel region and decode steps got slower (docs/benchmarks.md).
    lend_prefill_cores: bool = False


class RayConfig(ConfigSection):
    """Which Ray cluster runs the engines."""
    address: str | None = None  # Ray cluster to join (null: start a local instance)
    namespace: str = "pd-cluster"  # Ray namespace of the cluster's actors (one cluster each)
    num_cpus: float | None = None  # local instance only; default: what the engines need
    num_gpus: float | None = None  # local instance only; default: the GPUs Ray detects


class PlannerConfig(ConfigSection):
    """The SLO controller (pd_cluster/planner/controller.py; off by default): every interval_s
    it compares measured TTFT/TPOT and load with the profile's predictions (targets:
    proxy.slo) and switches engines between roles or scales a role within these bounds.
    `pd-cluster plan` writes this section; `pd-cluster profile` makes the profile."""
    enabled: bool = False  # run the controller in the proxy (it needs profile and the actuator)
    # The cost table `pd-cluster profile` wrote for this model, dtype, device and pipe
    # (required when enabled).
    profile: str | None = None
    interval_s: float = Field(10.0, gt=0)  # s between the controller's looks
    # After any action, none other for this long (a switched engine drains, then the
    # measurements need time to show its effect).
    cooldown_s: float = Field(60.0, ge=0)
    min_prefill: int = Field(1, ge=1)  # prefill engines at least
    max_prefill: int = Field(8, ge=1)  # prefill engines at most
    min_decode: int = Field(1, ge=1)  # decode engines at least
    max_decode: int = Field(8, ge=1)  # decode engines at most
    # Engines of both roles together at most (engine slots; null: max_prefill + max_decode).
    max_engines: int | None = Field(None, ge=2)
    # A change is made only when it raises the predicted capacity by this share at least
    # (and the same call came twice in a row): steady load near a threshold does not flap.
    hysteresis: float = Field(0.15, ge=0)
    # An idle engine is removed only once the cluster has had room to spare for this long
    # since the last change (one engine per such stretch): an engine removed takes its start
    # (weights loaded) to come back when the load returns, a switch only its drain. Scale up
    # at once, down slowly (Kubernetes' HPA waits 300 s the same way).
    scale_down_after_s: float = Field(300.0, ge=0)
    # `mode: auto`'s second table: the same model profiled by one engine on the cores of the
    # prefill and decode engines together (`pd-cluster profile --config` of a colocated
    # config with that num_cpus).
    colocated_profile: str | None = None
    # The workload `mode: auto` sizes the shape for (both needed with its profiles).
    input_len: int | None = Field(None, ge=1)  # prompt tokens per request
    output_len: int | None = Field(None, ge=1)  # output tokens per request

    @model_validator(mode="after")
    def _bounds(self) -> "PlannerConfig":
        if self.min_prefill > self.max_prefill:
            raise ValueError(f"min_prefill: {self.min_prefill} > max_prefill {self.max_prefill}")
        if self.min_decode > self.max_decode:
            raise ValueError(f"min_decode: {self.min_decode} > max_decode {self.max_decode}")
        if self.max_engines is not None and self.max_engines < self.min_prefill + self.min_decode:
            raise ValueError(f"max_engines: {self.max_engines} < min_prefill + min_decode")
        if self.enabled and not self.profile:
            raise ValueError("profile: the controller needs the cost table (`pd-cluster "
                             "profile --config FILE --out PROFILE`)")
        return self

    @property
    def engine_budget(self) -> int:
        return self.max_engines or self.max_prefill + self.max_decode
