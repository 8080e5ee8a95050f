"""`pd-cluster serve MODEL`: a P/D cluster on this machine with no YAML, in the foreground
(as `vllm serve MODEL`); Ctrl-C stops everything it started.

Each flag is a cluster YAML key (the table below, shown in `--help`), so `serve` is `launch`
with a config built from flags: a `--config` file, then `--set KEY=VALUE`s, then the flags.
Flags that `vllm serve` has use vLLM's names, so a vLLM command line runs unchanged; vLLM flags
with no meaning here are accepted and named (vllm_flags.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from pd_cluster.serving.cluster import vllm_flags

# Keys of every role: a flag for one of them (tensor parallelism) sets the mode's roles.
_ROLES = {"auto": ("prefill", "decode"), "disaggregated": ("prefill", "decode"),
          "colocated": ("colocated",)}


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


def _json_object(text: str) -> dict[str, Any]:
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
         "'{\"backend\": \"xgrammar\", \"disable_any_whitespace\": true}'", _json_object,
         metavar="JSON"),
    Flag("--speculative-config", "engine.speculative", "JSON object, e.g. '{\"method\": "
         "\"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 5}'", _json_object,
         metavar="JSON"),
    Flag("--generation-config", "engine.generation_config", "where requests' default "
         "sampling params come from: auto (the model's generation_config.json), vllm (none) "
         "or a folder holding a generation_config.json", metavar="auto|vllm|FOLDER"),
    Flag("--override-generation-config", "engine.override_generation_config", "JSON object "
         "of sampling keys set over the generation config's, e.g. '{\"temperature\": 0.5}'",
         _json_object, metavar="JSON"),
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
_CONST = {"--enforce-eager": False, "--disable-log-stats": 0.0}


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve MODEL on a P/D cluster on this machine, in the foreground",
        description="Start a prefill/decode cluster on this machine serving MODEL with an "
                    "OpenAI-compatible API, in the foreground; Ctrl-C stops everything it "
                    "started. Every flag sets the cluster YAML key in brackets "
                    "(docs/configuration.md has them all; --set KEY=VALUE sets any other).")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="a built-in preset (e.g. tiny-llama), a checkpoint directory or a "
                        "Hugging Face repo id; served under this name as written [model]")
    p.add_argument("--config", default=None, help="a cluster YAML to start from (flags win)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other config key, e.g. --set decode.num_cpus=2 (repeatable)")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: a local "
                   "instance that stops with this command)")
    p.add_argument("--no-progress", action="store_true", help="no per-engine progress lines")
    for f in FLAGS:
        _add_flag(p, f)
    vllm_flags.add_ignored(p)
    p.epilog = vllm_flags.epilog()
    p.set_defaults(run=run_serve, on_extra_args=lambda extra: _unknown(p, extra))


def _add_flag(p: argparse.ArgumentParser, f: Flag) -> None:
    help_text = f"{f.help} [{f.key}]"
    names = (f.flag, *f.aliases)
    if f.action == "store_true":
        p.add_argument(*names, dest=_dest(f), action="store_const", const=True, default=None,
                       help=help_text)
    elif f.action == "store_const":
        p.add_argument(*names, dest=_dest(f), action="store_const", const=_CONST[f.flag],
                       default=None, help=help_text)
    elif f.action is not None:
        p.add_argument(*names, dest=_dest(f), action=f.action, default=None, help=help_text)
    else:
        p.add_argument(*names, dest=_dest(f), type=f.type, default=None, choices=f.choices,
                       nargs=f.nargs, help=help_text,
                       metavar=f.metavar or f.flag.lstrip("-").upper().replace("-", "_"))


def _unknown(p: argparse.ArgumentParser, extra: list[str]) -> int:
    """An argument `serve` does not take: its usage line and the nearest flag or key."""
    from pd_cluster.serving.cluster.config_reference import all_keys
    options = [o for a in p._actions for o in a.option_strings if o.startswith("--")]
    flags = [a for a in extra if a.startswith("-")]
    if not flags:
        p.error(f"unrecognized arguments: {' '.join(extra)} (MODEL is given once)")
    flag = flags[0].split("=", 1)[0]
    p.error(f"unrecognized argument {flag}: {vllm_flags.nearest(flag, options, all_keys())}")
    return 2  # p.error exits


def flags_by_key() -> dict[str, list[str]]:
    """YAML key -> the serve flags that set it (for the config reference)."""
    out: dict[str, list[str]] = {}
    for f in FLAGS:
        for key in f.keys():
            out.setdefault(key, []).append(f.flag)
    return out


def _dest(f: Flag) -> str:
    return "opt_" + f.flag.lstrip("-").replace("-", "_")


def serve_config(args: argparse.Namespace) -> Any:
    """The ClusterConfig the flags describe (ConfigError naming the key when invalid)."""
    from pd_cluster.serving.cluster.cluster_config import (load_config, parse_config,
                                                           parse_overrides)
    from pd_cluster.serving.cluster.schema import set_path
    overrides = parse_overrides(args.set)
    if args.model is not None:
        overrides["model"] = args.model
    mode = overrides.get("mode") or args.opt_mode or _file_mode(args.config)
    for f in FLAGS:
        value = getattr(args, _dest(f))
        if value is None:
            continue
        keys = ([f"{r}.{f.key.split('.', 1)[1]}" for r in _ROLES.get(mode, ())]
                if f.per_role else [f.key])
        for key in keys:
            set_path(overrides, key, value)
        for key, const in f.also:
            set_path(overrides, key, const)
    if args.config:
        return load_config(args.config, overrides)
    from pd_cluster.serving.cluster.auto_shape import resolve_shape
    if mode == "colocated" or resolve_shape(overrides)[0]["mode"] == "colocated":
        return parse_config({}, overrides)  # no KV transfer to place
    kv = overrides.setdefault("kv_transfer", {})
    if not any(kv.get(k) for k in ("host", "interface", "cidr")):
        kv["host"] = "127.0.0.1"  # one machine: the KV plane on loopback (README, "Security")
    return parse_config({}, overrides)


def _file_mode(path: str | None) -> str:
    """The mode a --config file sets (per-role flags need it before the merge)."""
    if not path:
        return "auto"
    import yaml
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return "auto"  # load_config reports the file's problem
    return (data or {}).get("mode", "auto") if isinstance(data, dict) else "auto"


def run_serve(args: argparse.Namespace) -> int:
    from pd_cluster.serving.cluster.cli_cluster import run_cluster
    for note in vllm_flags.ignored_notes(getattr(args, "vllm_ignored", None)):
        print(note, file=sys.stderr)
    return run_cluster(serve_config(args), args.address, detach=False,
                       progress=not args.no_progress)
