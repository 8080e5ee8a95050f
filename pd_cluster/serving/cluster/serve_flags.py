"""`pd-cluster serve`'s flags: each one's cluster YAML key (the table the command, `--help` and
docs/configuration.md are built from), the `vllm serve` flags that mean nothing here, and the
hint for a flag `serve` does not know.

A vLLM user's command line should run unchanged where it can: a flag whose job this cluster
does another way (or always) is accepted and named in one line on stderr; one that would change
what is served and cannot is an error in one line. Anything else gets `serve`'s usage and the
nearest flag or `--set` key, not argparse's bare "unrecognized arguments".
"""
from __future__ import annotations

import argparse
import difflib
import json
from dataclasses import dataclass
from typing import Any

@dataclass(frozen=True)
class Flag:
    flag: str
    key: str  # the cluster YAML key it sets (docs/configuration.md)
    help: str
    type: Any = str
    choices: tuple[str, ...] | None = None
    nargs: str | None = None
    metavar: str | None = None
    action: Any = None  # "store_true", argparse.BooleanOptionalAction, ...
    aliases: tuple[str, ...] = ()  # vLLM's short forms (-tp)
    also: tuple[tuple[str, Any], ...] = ()  # other keys set to a constant when given
    per_role: bool = False  # key is "prefill.X": set X for every role of the mode

    def keys(self) -> list[str]:
        """Every YAML key this flag may set (the reference names the flag beside each)."""
        if self.per_role:
            leaf = self.key.split(".", 1)[1]
            return [f"{r}.{leaf}" for r in ("prefill", "decode", "colocated")]
        return [self.key, *(k for k, _ in self.also)]


def json_object(text: str) -> dict[str, Any]:
    """vLLM's JSON-valued flags (--structured-outputs-config '{"backend": "xgrammar"}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


FLAGS = (
    Flag("--host", "proxy.host", "address the API listens on", str, metavar="HOST"),
    Flag("--port", "proxy.port", "API port (0: any free port)", int, metavar="PORT"),
    Flag("--prefill", "prefill.replicas", "prefill engines", int, metavar="N"),
    Flag("--decode", "decode.replicas", "decode engines", int, metavar="M"),
    Flag("--mode", "mode", "auto (the shape the planner's profiles say serves more within the "
         "SLO, else disaggregated), disaggregated (prefill + decode engines) or colocated",
         choices=("auto", "disaggregated", "colocated")),
    Flag("--served-model-name", "served_model_name", "name(s) clients send as `model` (the "
         "first is reported; default: MODEL as given)", nargs="+", metavar="NAME"),
    Flag("--dtype", "engine.dtype", "auto (fp32 on CPU, bf16 on CUDA), float32, float16, "
         "bfloat16"),
    Flag("--device", "engine.device", "auto, cpu, cuda or cuda:N"),
    Flag("--seed", "engine.seed", "seed of the engines' sampling RNG", int),
    Flag("--block-size", "engine.block_size", "tokens per KV cache block", int),
    Flag("--kv-cache-dtype", "engine.kv_cache_dtype", "auto (the model's dtype), fp8_e4m3 or "
         "fp8_e5m2 (FP8 KV with per-block scales)", choices=("auto", "fp8_e4m3", "fp8_e5m2")),
    Flag("--max-model-len", "engine.max_model_len", "longest prompt + output (default: the "
         "model's)", int),
    Flag("--max-num-seqs", "engine.max_num_seqs", "requests per engine step at most", int),
    Flag("--max-num-batched-tokens", "engine.max_num_batched_tokens",
         "tokens per engine step at most", int),
    Flag("--gpu-memory-utilization", "engine.gpu_memory_utilization",
         "share of a GPU's memory each engine may use", float),
    Flag("--num-kv-blocks", "engine.num_kv_blocks", "KV cache blocks per engine (default: "
         "sized from memory)", int),
    Flag("--tokenizer", "engine.tokenizer", "tokenizer directory (default: the model's)"),
    Flag("--pipe", "kv_transfer.pipe", "KV transfer pipe (auto, zmq, shm, nixl, gloo, nccl, cuda_ipc)"),
    Flag("--routing", "proxy.routing", "cache_aware, least_loaded or round_robin"),
    Flag("--disaggregation", "proxy.disaggregation", "auto (remote prefill when expected "
         "sooner) or always", choices=("auto", "always")),
    Flag("--api-key", "proxy.api_key", "key(s) clients must send as `Authorization: Bearer "
         "KEY` (visible in `ps`: --set proxy.api_key_env=VAR reads one from the environment)",
         nargs="+", metavar="KEY"),
    Flag("--ssl-certfile", "proxy.ssl_certfile", "TLS certificate (PEM): serve https"),
    Flag("--ssl-keyfile", "proxy.ssl_keyfile", "TLS private key (PEM) of --ssl-certfile"),
    Flag("--namespace", "ray.namespace", "Ray namespace (one cluster per namespace)"),
    # vLLM's names (`vllm serve --help`), each on the key that does the same here.
    Flag("--tensor-parallel-size", "prefill.tensor_parallel_size", "ranks (devices) per "
         "engine, for every role (decode., colocated. too)", int, aliases=("-tp",),
         per_role=True, metavar="N"),
    Flag("--enable-prefix-caching", "engine.enable_prefix_caching", "reuse the KV of cached "
         "prompt prefixes (--no-enable-prefix-caching: off)",
         action=argparse.BooleanOptionalAction),
    Flag("--kv-offloading-size", "engine.kv_offloading_size", "GiB of host memory per engine "
         "for KV blocks evicted from the device", float, metavar="GIB"),
    Flag("--enable-auto-tool-choice", "proxy.enable_auto_tool_choice", "tool_choice auto: "
         "parse tool calls out of the model's text (with --tool-call-parser)",
         action="store_true"),
    Flag("--tool-call-parser", "proxy.tool_call_parser", "hermes, qwen, llama3_json or "
         "mistral", metavar="NAME"),
    Flag("--structured-outputs-config", "engine.structured_outputs", "JSON object, e.g. "
         "'{\"backend\": \"xgrammar\", \"disable_any_whitespace\": true}'", json_object,
         metavar="JSON"),
    Flag("--speculative-config", "engine.speculative", "JSON object, e.g. '{\"method\": "
         "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 5}'", json_object,
         metavar="JSON"),
    Flag("--generation-config", "engine.generation_config", "where requests' default "
         "sampling params come from: auto (the model's generation_config.json), vllm (none) "
         "or a folder holding a generation_config.json", metavar="auto|vllm|FOLDER"),
    Flag("--override-generation-config", "engine.override_generation_config", "JSON object "
         "of sampling keys set over the generation config's, e.g. '{\"temperature\": 0.5}'",
         json_object, metavar="JSON"),
    Flag("--chat-template", "proxy.chat_template", "a Jinja chat template, or a file holding "
         "one, used instead of the tokenizer's", metavar="TEMPLATE"),
    Flag("--enforce-eager", "engine.compile", "no torch.compile and no CUDA graphs",
         action="store_const", also=(("engine.cuda_graphs", False),)),
    Flag("--shutdown-timeout", "proxy.shutdown_timeout", "s in-flight requests get to finish "
         "on Ctrl-C, SIGTERM or `pd-cluster stop` (new ones get 503 meanwhile)", float,
         metavar="S"),
    Flag("--disable-log-stats", "proxy.log_stats_interval", "no periodic stats lines",
         action="store_const"),
    Flag("--slo-ttft-ms", "proxy.slo.ttft_ms", "time-to-first-token target the P-or-D choice "
         "serves to", float, metavar="MS"),
    Flag("--slo-tpot-ms", "proxy.slo.tpot_ms", "time-per-output-token target: local prefills "
         "and lent decode cores keep every running request within it", float, metavar="MS"),
)
# store_const flags: the value each sets its key to.
CONST = {"--enforce-eager": False, "--disable-log-stats": 0.0}


def flags_by_key() -> dict[str, list[str]]:
    """YAML key -> the serve flags that set it (for the config reference)."""
    out: dict[str, list[str]] = {}
    for f in FLAGS:
        for key in f.keys():
            out.setdefault(key, []).append(f.flag)
    return out


@dataclass(frozen=True)
class Ignored:
    flag: str
    why: str
    takes_value: bool = False
    # A value that changes what is served and cannot be honoured here: an error, not a note.
    only: str | None = None


IGNORED = (
    Ignored("--trust-remote-code", "models run on this project's own implementations "
            "(docs/models.md); no repository code is executed"),
    Ignored("--disable-log-requests", "requests are not logged beyond the access log"),
    Ignored("--enable-log-requests", "requests are not logged beyond the access log (see "
            "--log-level DEBUG)"),
    Ignored("--swap-space", "no CPU swap space: preempted requests recompute; "
            "--kv-offloading-size keeps evicted prefix blocks in host memory", True),
    Ignored("--pipeline-parallel-size", "no pipeline parallelism; use --tensor-parallel-size "
            "and --prefill/--decode replicas", True, only="1"),
    Ignored("--distributed-executor-backend", "engines always run as Ray actors", True),
    Ignored("--enable-chunked-prefill", "prefill is always chunked (--max-num-batched-tokens)"),
    Ignored("--disable-frontend-multiprocessing", "the API runs in its own Ray actor"),
    Ignored("--uvicorn-log-level", "use pd-cluster --log-level", True),
    Ignored("--disable-uvicorn-access-log", "the access log is pd_cluster.access (--log-level "
            "WARNING silences it)"),
    Ignored("--max-log-len", "prompts are not logged", True),
    Ignored("--tokenizer-mode", "tokenizers load through transformers' AutoTokenizer", True),
    Ignored("--load-format", "checkpoints load from safetensors", True, only="auto"),
    Ignored("--download-dir", "Hugging Face ids use the hub cache: set HF_HUB_CACHE", True),
    Ignored("--quantization", "checkpoints' own quantization config decides (docs/models.md)",
            True),
)
BY_FLAG = {i.flag: i for i in IGNORED}


class _Ignore(argparse.Action):
    """Collects (flag, value) pairs; the flag is then named in a note, not applied."""
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        given = list(getattr(namespace, self.dest) or [])
        given.append((option_string, None if values == [] else values))
        setattr(namespace, self.dest, given)


def add_ignored(p: argparse.ArgumentParser) -> None:
    """Accept each flag (so its value is not taken for MODEL), hidden from --help: the epilog
    lists them."""
    for item in IGNORED:
        p.add_argument(item.flag, dest="vllm_ignored", action=_Ignore, default=None,
                       nargs=None if item.takes_value else 0, help=argparse.SUPPRESS)


def ignored_notes(given: list[tuple[str, str | None]] | None) -> list[str]:
    """One line per flag given; ValueError (one line) for a value that cannot be honoured."""
    return [_note(BY_FLAG[flag], value) for flag, value in given or []]


def epilog() -> str:
    return ("vLLM flags accepted and ignored (no meaning here): "
            + ", ".join(i.flag for i in IGNORED) + ".\n")


def _note(item: Ignored, value: str | None) -> str:
    if item.only is not None and value is not None and value != item.only:
        raise ValueError(f"{item.flag} {value}: not available here ({item.why})")
    return f"note: {item.flag} has no meaning here ({item.why}); ignored"


def nearest(flag: str, options: list[str], keys: list[str]) -> str:
    """`did you mean --x?` or `did you mean --set key=VALUE?` for an unknown ``flag`` (the
    closest of serve's flags and the YAML keys' last parts), or where to look."""
    word = flag.lstrip("-").replace("-", "_")
    candidates = {o.lstrip("-").replace("-", "_"): o for o in options}
    for key in keys:  # a flag of serve wins a tie with a key
        candidates.setdefault(key.rsplit(".", 1)[-1], f"--set {key}=VALUE")
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    if close:
        return f"did you mean {candidates[close[0]]}?"
    return "`pd-cluster serve --help` lists the flags; --set KEY=VALUE sets any config key"
