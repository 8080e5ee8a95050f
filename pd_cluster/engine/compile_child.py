"""The process that compiles an engine's decoder while the engine serves eagerly
(engine/background_compile.py): it loads the same model the same way (same rank slice, CPU
GEMM layout, thread count: the same artifact key), compiles it into the on-disk artifact
(compiled_model.py) and exits; the engine then loads the artifact.

Exit codes: 0 the artifact is on disk; 2 the compile failed (logged here: the engine stays
eager); 3 the parent is gone; 4 the key differs from the engine's (a setting the child does
not reproduce: nothing it compiled would be loaded).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

logger = logging.getLogger("pd_cluster.engine.compile_child")


class _TracedGroup:
    """Stands for the engine's tensor-parallel process group: tracing runs the collectives'
    fake forms only (models/layers/paged_call.py), so no group is ever used here."""


def compile_artifact(config_json: str, rank: int, size: int, expect: str) -> int:
    from pd_cluster.config import EngineConfig, read_hf_config
    from pd_cluster.engine.compiled_model import CompiledModel
    from pd_cluster.models.layers.cpu_gemm import prepare_model
    from pd_cluster.models.layers.tp import TPGroup
    from pd_cluster.models.loader import load_model

    config = EngineConfig.model_validate_json(config_json)
    device, dtype = config.torch_device, config.torch_dtype
    tp = TPGroup(rank, size, _TracedGroup() if size > 1 else None)
    model = load_model(config.model, read_hf_config(config.model), dtype, device, tp=tp)
    prepare_model(model, dtype, device, config.cpu_gemm)
    compiled = CompiledModel(model, device, expect_path=Path(expect))
    if compiled.path != Path(expect):
        return 4
    return 0 if compiled.ready else 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--size", type=int, default=1)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--nice", type=int, default=0)
    parser.add_argument("--expect", required=True, help="the engine's artifact path")
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args()
    from pd_cluster.engine.worker import _watch_parent
    _watch_parent(args.parent)  # an engine killed outright leaves no compile behind
    os.nice(args.nice)  # the engine's steps first (inductor's workers and compilers inherit it)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s compile-child %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)  # in the key: inductor bakes it into its C++
    try:
        code = compile_artifact(args.config, args.rank, args.size, args.expect)
    except Exception:
        logger.exception("the background compile failed")
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown (inductor's worker pool): the artifact is written


if __name__ == "__main__":
    main()
