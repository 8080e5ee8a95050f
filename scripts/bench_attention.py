"""CPU attention: the paged C++ kernel (``cpu`` backend) against the torch reference (``torch``
backend, which copies each request's context out of the blocks), side by side in one run.

Two parts, each printing both figures and their ratio (torch time / cpu time, or cpu tokens/s /
torch tokens/s: above 1 means the kernel is faster):
  * kernel: one attention layer's call on batches shaped like bench_offline's model (decode
    batches, a prompt prefilled from its start, a chunk after a cached prefix, a mixed batch);
  * offline: bench_offline's request mix through ``LLM.generate`` on an engine of each backend
    (same requests, greedy; prints whether the outputs agree).
The last line is ``cpu_attention_offline_ratio_vs_torch=X`` (or ``..._kernel_ratio_vs_torch=X``,
the median over the kernel cases, with ``--skip-offline``).

Example:  python scripts/bench_attention.py --threads 1
``--smoke``: a tiny model and shapes (seconds), for the test suite.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help='checkpoint dir (default: the "bench-50m" preset)')
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 384], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[8, 96], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heads", type=int, nargs=3, default=[8, 4, 64], metavar=("HQ", "HKV", "D"),
                   help="kernel part: query heads, KV heads, head dim")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="fp32",
                   help="kernel part: comma-separated query/cache dtypes (fp32, bf16, fp16)")
    p.add_argument("--repeats", type=int, default=10, help="kernel part: calls per timing")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--skip-offline", action="store_true", help="only the kernel part")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and model (seconds)")
    args = p.parse_args()
    if args.smoke:
        args.num_requests, args.prompt_len, args.output_len = 4, [4, 40], [2, 6]
        args.heads, args.repeats = [4, 2, 16], 2
    return args


def kernel_cases(args: argparse.Namespace) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (new tokens per request, context length per request); decodes first. The
    "offline" cases are shaped like bench_vs_vllm's offline load in steady state: a decode
    batch of all requests with contexts of half to all of a long prompt plus its output, and
    a full prefill step of whole prompts (up to 2048 tokens)."""
    rng = random.Random(args.seed)
    lo, hi = args.prompt_len[0], args.prompt_len[1] + args.output_len[1]
    ctx = [rng.randint(lo, hi) for _ in range(max(args.num_requests, 1))]
    p = args.prompt_len[1]
    steady = [rng.randint(hi // 2, hi - hi // 10) for _ in range(max(args.num_requests, 1))]
    prompts: list[int] = []
    while sum(prompts) < 2048 * p // 384:
        prompts.append(rng.randint(*args.prompt_len))
    prompts[-1] -= sum(prompts) - 2048 * p // 384  # stays > 0: the sum was short before it
    return {
        f"offline decode x{len(steady)} ctx {min(steady)}-{max(steady)}": ([1] * len(steady),
                                                                          steady),
        f"offline prefill {sum(prompts)} in {len(prompts)}": (prompts, prompts),
        f"decode x{len(ctx)}": ([1] * len(ctx), ctx),
        f"decode x{max(len(ctx) // 6, 1)}": ([1] * max(len(ctx) // 6, 1), ctx[:max(len(ctx) // 6, 1)]),
        f"prefill {p} from start": ([p], [p]),
        f"chunk {p // 4} after {p}": ([p // 4], [p + p // 4]),
        "mixed 8 decodes + 2 prompts": ([1] * 8 + [p // 2, p // 3], ctx[:8] + [p // 2, p // 2]),
    }


def time_backends(backends: dict[str, Any], call_args: tuple, repeats: int) -> dict[str, float]:
    """Best-of-three mean ms per call, the backends interleaved."""
    best = {name: float("inf") for name in backends}
    for _ in range(3):
        for name, backend in backends.items():
            backend.forward(*call_args)
            t = time.perf_counter()
            for _ in range(repeats):
                backend.forward(*call_args)
            best[name] = min(best[name], (time.perf_counter() - t) / repeats * 1e3)
    return best


def kernel_part(args: argparse.Namespace) -> list[float]:
    import torch

    from pd_cluster.attention import create_backend

    backends = {n: create_backend(n, torch.device("cpu")) for n in ("torch", "cpu")}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    ratios = []
    for dt in args.dtype.split(","):
        ratios += kernel_cases_for(args, backends, dtypes[dt], dt)
    return ratios


def kernel_cases_for(args: argparse.Namespace, backends: dict[str, Any], dtype: Any,
                     dtype_name: str) -> list[float]:
    import torch

    from pd_cluster.attention import AttentionMetadata, AttentionOptions

    hq, hkv, d = args.heads
    bs = args.block_size
    ratios = []
    for name, (q_lens, seq_lens) in kernel_cases(args).items():
        num_blocks = sum(-(-s // bs) for s in seq_lens) + 1
        order = torch.randperm(num_blocks - 1).tolist()  # scattered blocks, as in a real cache
        tables, first = [], 0
        for s in seq_lens:
            tables.append(order[first:first + -(-s // bs)])
            first += len(tables[-1])
        width = max(len(t) for t in tables)
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(starts[-1], dtype=torch.long),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32),
            num_decodes=sum(1 for q in q_lens if q == 1), max_query_len=max(q_lens),
            max_seq_len=max(seq_lens), block_size=bs, query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens)
        cache = torch.randn(2, num_blocks, bs, hkv, d).to(dtype)
        query = torch.randn(starts[-1], hq, d).to(dtype)
        ms = time_backends(backends, (query, cache, meta, AttentionOptions(d ** -0.5)),
                           args.repeats)
        ratios.append(ms["torch"] / ms["cpu"])
        # K/V bytes the kernel must read (each visible key once per KV head) and its FLOPs
        # (q.k and p.v per query head and visible key, causal for new tokens).
        kv_bytes = sum(seq_lens) * hkv * 2 * d * cache.element_size()
        keys = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(q_lens, seq_lens))
        gflops = 4 * keys * hq * d / (ms["cpu"] * 1e6)
        print(f"kernel {dtype_name} {name:34s} torch={ms['torch']:8.3f} ms  "
              f"cpu={ms['cpu']:8.3f} ms  speedup={ratios[-1]:5.2f}  "
              f"kv={kv_bytes / (ms['cpu'] * 1e6):5.1f} GB/s  {gflops:5.1f} GFLOP/s")
    return ratios


def offline_part(args: argparse.Namespace) -> float:
    from bench_offline import make_requests, run_ours, smoke_model

    from pd_cluster.checkpoints.maker import default_model_path
    from pd_cluster.llm import LLM

    model_dir = args.model or (smoke_model() if args.smoke
                               else str(default_model_path("bench-50m")))
    tps, outputs = {}, {}
    for backend in ("torch", "cpu"):
        with LLM(model=model_dir, block_size=args.block_size, max_num_seqs=64,
                 max_num_batched_tokens=2048, kv_cache_memory=1 << 30,
                 attention_backend=backend) as llm:
            reqs = make_requests(args, llm.engine.vocab_size)
            run_ours(llm, [(reqs[0][0][:16], 4)])  # warm-up
            outputs[backend] = []
            seconds, tokens, _ = run_ours(llm, reqs, outputs[backend])
            tps[backend] = tokens / seconds
            print(f"offline {backend}: {seconds:.2f}s output_tokens={tokens} "
                  f"output_tokens_per_s={tps[backend]:.1f} requests={len(reqs)}")
    print(f"greedy_outputs_equal={outputs['torch'] == outputs['cpu']}")
    return tps["cpu"] / tps["torch"]


def main() -> int:
    args = parse_args()
    import torch

    from kernels.cpu_build import load_cpu_kernels, load_error

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not load_cpu_kernels():
        print(f"the CPU kernel is unavailable: {load_error()}", file=sys.stderr)
        return 1
    print(f"threads={torch.get_num_threads()} load={os.getloadavg()[0]:.2f}")
    ratios = kernel_part(args)
    if args.skip_offline:
        print(f"cpu_attention_kernel_ratio_vs_torch={statistics.median(ratios):.2f}")
        return 0
    ratio = offline_part(args)
    print(f"load={os.getloadavg()[0]:.2f}")
    print(f"cpu_attention_offline_ratio_vs_torch={ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
