"""`pd-cluster` command line: one subcommand per job, each registered with its own module."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable



def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="offline generation demo on the built-in (or given) model")
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: built-in tiny model)")
    p.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
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
    except ImportError:  # serving extras not importable: the offline commands still work
        return
    add_cluster_commands(sub)


_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_generate, _add_make_model, _add_cluster_commands]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-cluster", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "build_parser"]
