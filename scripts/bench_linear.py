"""The linear layers' GEMM rate inside the engine's steps, eager and compiled, as a fraction of
this machine's own GEMM rate, measured in one run.

For each engine (``engine.compile`` false, then true) it runs one prefill step of
``--prompts`` prompts of ``--prompt-len`` tokens and ``--decode-steps`` decode steps of that
batch under ``torch.profiler``, and sums the time and FLOPs of the steps' matrix products
(``aten::mm``/``addmm``/``bmm`` and the prepacked MKL/oneDNN linears inductor may emit; 2*M*N*K
each). The machine's rate is the best of a few square GEMMs of ``--gemm-size`` in the same
dtype and threads. Last line: ``linear_gemm_fraction_eager=X linear_gemm_fraction_compiled=Y``
(the prefill's and the decode's fractions are printed above it).

    python scripts/bench_linear.py                # bench-50m, fp32, torch's default threads
    python scripts/bench_linear.py --dtype bf16 --threads 1
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
_GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "mkl::_mkl_linear", "mkldnn::_linear_pointwise")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help='checkpoint dir (default: the "bench-50m" preset)')
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--gemm-size", type=int, default=2048)
    p.add_argument("--smoke", action="store_true", help="a tiny model and load (seconds)")
    args = p.parse_args()
    if args.smoke:
        args.prompts, args.prompt_len, args.decode_steps, args.gemm_size = 2, 16, 2, 256
    return args


def gemm_flops(name: str, shapes: list) -> int:
    """2*M*N*K of one recorded matrix product (0 if its shapes are not recorded)."""
    try:
        if name == "aten::mm":
            (m, k), (_, n) = shapes[0], shapes[1]
        elif name == "aten::addmm":
            (m, k), (_, n) = shapes[1], shapes[2]
        elif name == "aten::bmm":
            (b, m, k), (_, _, n) = shapes[0], shapes[1]
            return 2 * b * m * n * k
        else:  # prepacked linear: (x [.., K], packed, original weight [N, K], ...)
            x, w = shapes[0], shapes[2] if name.startswith("mkl::") else shapes[1]
            m, k, n = math.prod(x[:-1]), x[-1], w[0]
        return 2 * m * n * k
    except (IndexError, TypeError, ValueError):
        return 0


def profiled_rate(run: Any) -> tuple[float, float]:
    """(GEMM FLOP/s, GEMM seconds) of ``run()``'s matrix products."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    flops = seconds = 0.0
    for ev in prof.events():
        if ev.name in _GEMMS:
            flops += gemm_flops(ev.name, ev.input_shapes)
            seconds += ev.self_cpu_time_total / 1e6
    return (flops / seconds if seconds else 0.0), seconds


def machine_rate(size: int, dtype: Any) -> float:
    import torch

    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * size ** 3 / best


def measure(model_dir: str, args: argparse.Namespace, compile: bool) -> tuple[float, float]:
    """(prefill GEMM FLOP/s, decode GEMM FLOP/s) of one engine."""
    import random

    from pd_cluster.llm import LLM
    from pd_cluster.sampling_params import SamplingParams

    llm = LLM(model=model_dir, dtype=DTYPES[args.dtype], compile=compile,
              max_num_batched_tokens=max(2048, args.prompts * args.prompt_len),
              kv_cache_memory=1 << 28)
    engine, rng = llm.engine, random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.decode_steps + 3, ignore_eos=True)

    def add(tag: str) -> None:
        for i in range(args.prompts):
            engine.add_request(f"{tag}{i}", [rng.randrange(4, engine.vocab_size)
                                             for _ in range(args.prompt_len)], params)

    add("warm")  # the first steps compile (and warm the allocator): not measured
    while engine.has_unfinished_requests():
        engine.step()
    add("r")
    prefill, _ = profiled_rate(engine.step)
    decode, _ = profiled_rate(lambda: [engine.step() for _ in range(args.decode_steps)])
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_no_leaks()
    llm.close()
    return prefill, decode


def main() -> int:
    args = parse_args()
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.smoke:
        import tempfile

        from pd_cluster.checkpoints.maker import make_model
        model_dir = str(make_model(os.path.join(tempfile.mkdtemp(prefix="bench-linear-"), "m"),
                                   arch="llama", vocab_size=512, hidden_size=64, num_layers=2,
                                   num_heads=4, num_kv_heads=2, intermediate_size=128))
    else:
        from pd_cluster.checkpoints.maker import default_model_path
        model_dir = args.model or str(default_model_path("bench-50m"))
    dtype = getattr(torch, DTYPES[args.dtype])
    peak = machine_rate(args.gemm_size, dtype)
    print(f"model={model_dir} dtype={args.dtype} threads={torch.get_num_threads()} "
          f"prompts={args.prompts}x{args.prompt_len} decode_steps={args.decode_steps}")
    print(f"machine_gemm_gflops={peak / 1e9:.1f} ({args.gemm_size}^3)")
    fractions = {}
    for label, compile in (("eager", False), ("compiled", True)):
        prefill, decode = measure(model_dir, args, compile)
        fractions[label] = prefill / peak
        print(f"{label}: prefill {prefill / 1e9:.1f} GFLOP/s ({prefill / peak:.2f} of the "
              f"machine), decode {decode / 1e9:.1f} GFLOP/s ({decode / peak:.2f})")
    print(f"linear_gemm_fraction_eager={fractions['eager']:.2f} "
          f"linear_gemm_fraction_compiled={fractions['compiled']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
