"""pd-cluster: a prefill/decode disaggregated LLM serving cluster. `pd-cluster serve MODEL`
serves a model on this machine; `pd-cluster launch --config FILE` starts a cluster from a YAML.

One subcommand per job, each registered with its own module."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable



def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="offline generation demo on the built-in (or given) model")
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: built-in tiny model)")
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pd_cluster import LLM, SamplingParams
    llm = LLM(model=args.model)
    prompts = args.prompt or ["The quick brown fox", "Once upon a time", "Hello world"]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed)
    for out in llm.generate(prompts, params, use_tqdm=True):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    return 0


def _add_make_model(sub: argparse._SubParsersAction) -> None:
    from pd_cluster.checkpoints.maker_cli import add_make_model_args, run_make_model
    p = sub.add_parser("make-model", help="write a deterministic tiny HF checkpoint + tokenizer")
    add_make_model_args(p)
    p.set_defaults(run=run_make_model)


def _add_cluster_commands(sub: argparse._SubParsersAction) -> None:
    try:
        from pd_cluster.serving.cluster.cli_cluster import add_cluster_commands
        from pd_cluster.serving.cluster.cli_scale import add_scale_command
        from pd_cluster.serving.cluster.serve_cli import add_serve_command
    except ImportError:  # serving extras not importable: the offline commands still work
        return
    add_serve_command(sub)
    add_cluster_commands(sub)
    add_scale_command(sub)


def _add_planner_commands(sub: argparse._SubParsersAction) -> None:
    try:
        from pd_cluster.planner.cli import add_planner_commands
    except ImportError:  # serving extras not importable: the offline commands still work
        return
    add_planner_commands(sub)


def _add_config_reference(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config-reference",
                       help="print (or write) the cluster YAML reference, docs/configuration.md")
    p.add_argument("--out", default=None, help="write it to this file instead of stdout")
    p.set_defaults(run=_run_config_reference)


def _run_config_reference(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pd_cluster.serving.cluster.config_reference import render
    text = render()
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_cluster_commands, _add_planner_commands, _add_generate, _add_make_model,
    _add_config_reference]
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def build_parser() -> argparse.ArgumentParser:
    from pd_cluster import __version__
    parser = argparse.ArgumentParser(prog="pd-cluster", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pd-cluster {__version__}")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=_LOG_LEVELS,
                        help="log messages at this level and above (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pd_cluster import start_trace
    start_trace.mark_process_start("launcher")
    start_trace.mark("launcher", "cli main")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand says what it takes (serve: its usage and the nearest flag)
        on_extra = getattr(args, "on_extra_args", None)
        if on_extra is None:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return on_extra(extra)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "build_parser"]
