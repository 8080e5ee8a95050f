"""`pd-cluster serve MODEL`: a P/D cluster on this machine with no YAML, in the foreground
(as `vllm serve MODEL`); Ctrl-C stops everything it started.

Each flag is a cluster YAML key (the table below, shown in `--help`), so `serve` is `launch`
with a config built from flags: a `--config` file, then `--set KEY=VALUE`s, then the flags.
Flags that `vllm serve` has use vLLM's names, so a vLLM command line runs unchanged; vLLM flags
with no meaning here are accepted and named (serve_flags.py).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from pd_cluster.serving.cluster import serve_flags
from pd_cluster.serving.cluster.serve_flags import CONST, FLAGS, Flag

# Keys of every role: a flag for one of them (tensor parallelism) sets the mode's roles.
_ROLES = {"auto": ("prefill", "decode"), "disaggregated": ("prefill", "decode"),
          "colocated": ("colocated",)}


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
    serve_flags.add_ignored(p)
    p.epilog = serve_flags.epilog()
    p.set_defaults(run=run_serve, on_extra_args=lambda extra: _unknown(p, extra))


def _add_flag(p: argparse.ArgumentParser, f: Flag) -> None:
    help_text = f"{f.help} [{f.key}]"
    names = (f.flag, *f.aliases)
    if f.action == "store_true":
        p.add_argument(*names, dest=_dest(f), action="store_const", const=True, default=None,
                       help=help_text)
    elif f.action == "store_const":
        p.add_argument(*names, dest=_dest(f), action="store_const", const=CONST[f.flag],
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
    p.error(f"unrecognized argument {flag}: {serve_flags.nearest(flag, options, all_keys())}")
    return 2  # p.error exits


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
    for note in serve_flags.ignored_notes(getattr(args, "vllm_ignored", None)):
        print(note, file=sys.stderr)
    return run_cluster(serve_config(args), args.address, detach=False,
                       progress=not args.no_progress)
