"""`pd-cluster serve MODEL`: a P/D cluster on this machine with no YAML, in the foreground
(as `vllm serve MODEL`); Ctrl-C stops everything it started.

Each flag is a cluster YAML key (the table below, shown in `--help`), so `serve` is `launch`
with a config built from flags: a `--config` file, then `--set KEY=VALUE`s, then the flags.
"""
from __future__ import annotations

import argparse
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


FLAGS = (
    Flag("--host", "proxy.host", "address the API listens on", str, metavar="HOST"),
    Flag("--port", "proxy.port", "API port (0: any free port)", int, metavar="PORT"),
    Flag("--prefill", "prefill.replicas", "prefill engines", int, metavar="N"),
    Flag("--decode", "decode.replicas", "decode engines", int, metavar="M"),
    Flag("--mode", "mode", "disaggregated (prefill + decode engines) or colocated",
         choices=("disaggregated", "colocated")),
    Flag("--served-model-name", "served_model_name", "name(s) clients send as `model` (the "
         "first is reported; default: MODEL as given)", nargs="+", metavar="NAME"),
    Flag("--dtype", "engine.dtype", "auto (fp32 on CPU, bf16 on CUDA), float32, float16, "
         "bfloat16"),
    Flag("--device", "engine.device", "auto, cpu, cuda or cuda:N"),
    Flag("--seed", "engine.seed", "seed of the engines' sampling RNG", int),
    Flag("--block-size", "engine.block_size", "tokens per KV cache block", int),
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
    Flag("--pipe", "kv_transfer.pipe", "KV transfer pipe (zmq, gloo, nccl, ...)"),
    Flag("--routing", "proxy.routing", "cache_aware, least_loaded or round_robin"),
    Flag("--disaggregation", "proxy.disaggregation", "auto (remote prefill when expected "
         "sooner) or always", choices=("auto", "always")),
    Flag("--api-key", "proxy.api_key", "key(s) clients must send as `Authorization: Bearer "
         "KEY` (visible in `ps`: --set proxy.api_key_env=VAR reads one from the environment)",
         nargs="+", metavar="KEY"),
    Flag("--ssl-certfile", "proxy.ssl_certfile", "TLS certificate (PEM): serve https"),
    Flag("--ssl-keyfile", "proxy.ssl_keyfile", "TLS private key (PEM) of --ssl-certfile"),
    Flag("--namespace", "ray.namespace", "Ray namespace (one cluster per namespace)"),
)


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
        p.add_argument(f.flag, dest=_dest(f), type=f.type, default=None, choices=f.choices,
                       nargs=f.nargs, help=f"{f.help} [{f.key}]",
                       metavar=f.metavar or f.flag.lstrip("-").upper().replace("-", "_"))
    p.set_defaults(run=run_serve)


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
    for f in FLAGS:
        value = getattr(args, _dest(f))
        if value is not None:
            set_path(overrides, f.key, value)
    if args.config:
        return load_config(args.config, overrides)
    kv = overrides.setdefault("kv_transfer", {})
    if not any(kv.get(k) for k in ("host", "interface", "cidr")):
        kv["host"] = "127.0.0.1"  # one machine: the KV plane on loopback (README, "Security")
    return parse_config({}, overrides)


def run_serve(args: argparse.Namespace) -> int:
    from pd_cluster.serving.cluster.cli_cluster import run_cluster
    return run_cluster(serve_config(args), args.address, detach=False,
                       progress=not args.no_progress)
