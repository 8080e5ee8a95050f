"""One MoE layer: our grouped experts vs transformers' MoE block, same weights, one run.

Mixtral-shaped routing (softmax, top-k, renormalised) over ``--experts`` experts; for each
batch size (decode-like small batches and a prefill-like large one) it times
  * HF ``MixtralSparseMoeBlock`` with its ``eager`` experts (a loop over the hit experts) and
    with ``grouped_mm`` (torch's grouped matmul: what HF models pick where it runs),
  * our ``SparseMoE`` on the torch grouped path (tokens sorted by expert, one matmul each),
  * on CUDA, our ``SparseMoE`` on the Triton kernel (kernels/fused_moe.py),
checks the outputs agree, and prints tokens/s per path and its ratio to HF's eager loop
(the paths take turns, medians of ``--iters`` calls).

Example:
    python scripts/bench_moe.py --hidden 1024 --intermediate 2048 --experts 8 --top-k 2
``--smoke``: tiny shapes and few iterations (seconds), for the test suite.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 64, 1024])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                   help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 iterations")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.intermediate, args.experts, args.top_k = 32, 48, 4, 2
        args.batches, args.iters = [4, 33], 2
    return args


def timed(fns: dict[str, Callable[[], torch.Tensor]], iters: int,
          cuda: bool) -> dict[str, float]:
    """Median seconds per call of each path, the paths taking turns (so a busy machine
    slows them alike), after one warm-up call each."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for it in range(iters + 1):
        for name, fn in fns.items():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            if it:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    args = parse_args()
    import transformers

    transformers.logging.set_verbosity_error()  # standalone blocks warn about their dispatch
    from pd_cluster.models.families.mixtral import mixtral_moe
    from pd_cluster.models.layers.linear import attach_weight_loaders
    from pd_cluster.models.layers.moe import SparseMoE
    from pd_cluster.models.layers.moe_experts import grouped_experts

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
        args.dtype or ("bf16" if cuda else "fp32")]
    cfg = transformers.MixtralConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                     num_local_experts=args.experts,
                                     num_experts_per_tok=args.top_k)
    block_class = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock
    torch.manual_seed(0)
    hf = block_class(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    hf = hf.to(dev, dtype).eval()
    # HF models pick torch's grouped_mm for their experts where it can run, else the eager
    # per-expert loop; a standalone block gets neither unless its config names one.
    hf_impls = {}
    for impl in ("eager", "grouped_mm"):
        cfg_i = transformers.MixtralConfig(**{**cfg.to_dict(), "experts_implementation": impl})
        cfg_i._experts_implementation = impl
        block = block_class(cfg_i).to(dev, dtype).eval()
        block.load_state_dict(hf.state_dict())
        hf_impls[f"hf_{impl}"] = block
    ours = SparseMoE(mixtral_moe(cfg.to_dict()))
    attach_weight_loaders(ours)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.weight_loader(ours.experts.gate_up_proj, hf.experts.gate_up_proj)
        ours.experts.weight_loader(ours.experts.down_proj, hf.experts.down_proj)
    ours = ours.to(dev, dtype).eval()
    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        name: (lambda x, b=block: b(x[None])[0]) for name, block in hf_impls.items()}
    paths.update({
        "ours_torch": lambda x: ours.experts(x, *ours.gate(x), grouped_experts)})
    if cuda:
        from kernels.fused_moe import fused_experts
        paths["ours_triton"] = lambda x: ours.experts(x, *ours.gate(x), fused_experts)
    print(f"device {dev}, {dtype}, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"experts {args.experts}, top-{args.top_k}")
    worst = 0.0
    with torch.inference_mode():
        for batch in args.batches:
            x = torch.randn(batch, args.hidden, device=dev, dtype=dtype)
            want = paths["hf_eager"](x).float()
            runnable = {}
            for name, fn in paths.items():
                try:
                    err = float((fn(x).float() - want).abs().max())
                except (RuntimeError, NotImplementedError) as e:  # grouped_mm off its devices
                    print(f"  {name} does not run here ({type(e).__name__}); skipped")
                    continue
                worst = max(worst, err / max(1e-6, float(want.abs().max())))
                runnable[name] = (lambda f=fn: f(x))
            secs = timed(runnable, args.iters, cuda)
            line = "  ".join(f"{name} {batch / s:,.0f} tok/s (x{secs['hf_eager'] / s:.2f})"
                             for name, s in secs.items())
            print(f"batch {batch:5d}: {line}")
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    print(f"max relative difference from hf: {worst:.2e} ({'ok' if worst <= tol else 'FAIL'})")
    return 0 if worst <= tol else 1


if __name__ == "__main__":
    sys.exit(main())
