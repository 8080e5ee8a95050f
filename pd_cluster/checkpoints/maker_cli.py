"""`pd-cluster make-model`: its flags and what it runs (a preset overridden by explicit flags)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from pd_cluster.checkpoints.maker import ARCHS, make_model, param_count
from pd_cluster.checkpoints.presets import PRESETS, preset_names


def add_make_model_args(parser: argparse.ArgumentParser) -> None:
    """Flags for `pd-cluster make-model`; size flags default to None = take preset/make_model default."""
    parser.add_argument("--out", required=True, help="output checkpoint directory")
    parser.add_argument("--preset", choices=preset_names(), default=None, help="start from a named preset")
    parser.add_argument("--arch", choices=ARCHS, default=None,
                        help="model family (default: the preset's, else llama)")
    parser.add_argument("--seed", type=int, default=None,
                        help="weights' random seed (the same seed writes the same checkpoint)")
    sizes = {"vocab-size": "tokens in the vocabulary", "hidden-size": "width of the residual "
             "stream", "num-layers": "decoder layers", "num-heads": "attention (query) heads",
             "num-kv-heads": "key/value heads (fewer than --num-heads: grouped-query "
             "attention)", "head-dim": "width of one head (default: hidden / heads)",
             "intermediate-size": "width of the MLP", "max-position-embeddings":
             "longest sequence the model's positions cover"}
    for flag, text in sizes.items():
        parser.add_argument(f"--{flag}", type=int, default=None,
                            help=f"{text} (default: the preset's or a tiny size)")
    parser.add_argument("--rope-theta", type=float, default=None, help="RoPE base frequency")
    parser.add_argument("--tie-word-embeddings", action="store_true", default=None,
                        help="the output projection shares the embedding matrix")

def run_make_model(args: argparse.Namespace) -> int:
    """`pd-cluster make-model`: preset (if any) overridden by explicit flags. Returns 2 on bad sizes."""
    kwargs: dict[str, Any] = dict(PRESETS[args.preset]) if args.preset else {}
    for key in ("arch", "seed", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "intermediate_size", "max_position_embeddings", "rope_theta",
                "tie_word_embeddings"):
        if getattr(args, key, None) is not None:
            kwargs[key] = getattr(args, key)
    try:
        out = make_model(args.out, **kwargs)
    except ValueError as e:
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    n = param_count(out)
    print(f"wrote {out} ({kwargs.get('arch', 'llama')}, {n:,} parameters = {n / 1e6:.2f}M)")
    return 0
