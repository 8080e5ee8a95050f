"""Benchmark the paged decode attention kernel against the GPU's own copy bandwidth.

Decode attention is memory-bound: each step streams every cached K/V byte once. So the figure
of merit is achieved bandwidth (K/V + q + out bytes / kernel time) as a fraction of what a plain
device-to-device copy reaches on the same GPU in the same run.

CUDA only (``--smoke``: a tiny shape in a few seconds, on the CPU under the Triton interpreter
where there is no GPU, so CI notices an interface change). Example:
    python scripts/bench_kernels.py --batch 8 32 64 --context 4096 32768
The last line is ``decode_attention_bw_fraction=X`` (median over the measured shapes).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--context", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--num-splits", type=int, default=None, help="force split-K (default: auto)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--inner", type=int, default=5, help="launches per timed repeat")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    p.add_argument("--smoke", action="store_true",
                   help="one tiny shape, one timed call (on the CPU without a GPU; no figures)")
    args = p.parse_args()
    if args.smoke:
        args.batch, args.context, args.warmup, args.repeats, args.inner = [2], [40], 0, 1, 1
        args.num_q_heads, args.num_kv_heads, args.head_dim = 4, 2, 32
        if not torch.cuda.is_available():
            args.dtype = "fp32"  # the Triton interpreter mishandles bf16
    return args


def time_ms(fn, warmup: int, repeats: int, inner: int) -> float:
    """Median over repeats of the per-call time; each repeat times ``inner`` back-to-back calls
    so host launch overhead does not show up as GPU time."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():  # --smoke on the CPU: wall clock, nothing to compare
        t0 = time.perf_counter()
        for _ in range(repeats * inner):
            fn()
        return (time.perf_counter() - t0) * 1e3 / max(1, repeats * inner)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def copy_bandwidth(warmup: int, repeats: int, nbytes: int = 2 << 30,
                   device: str = "cuda") -> float:
    """Device-to-device copy GB/s (read + write bytes), the practical roofline here."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup, repeats, 1)
    del src, dst
    return 2 * nbytes / ms / 1e6


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "the Triton kernels are only benchmarked on real hardware (--smoke runs "
                 "a tiny shape on the CPU).")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
    from kernels.paged_decode_attention import (choose_num_splits, paged_decode_attention,
                                                paged_decode_attention_ref)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    hq, hkv, d, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    esize = torch.empty((), dtype=dtype).element_size()
    copy_gbs = copy_bandwidth(args.warmup, args.repeats, (2 << 30) if not args.smoke else 1 << 20,
                              dev.type)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (Triton interpreter)"
    print(f"device: {name}; copy bandwidth {copy_gbs:.0f} GB/s; "
          f"Hq={hq} Hkv={hkv} D={d} block_size={bs} dtype={args.dtype}")

    # One cache big enough for the largest shape, reused with fresh shuffled block tables.
    max_blocks_seq = -(-max(args.context) // bs)
    num_blocks = max(args.batch) * max_blocks_seq
    cache = torch.randn(2, num_blocks, bs, hkv, d, dtype=dtype, device=dev)
    scale = d ** -0.5
    hdr = f"{'B':>4} {'context':>8} {'splits':>6} {'time_us':>9} {'GB/s':>8} {'frac':>6}"
    print(hdr)
    print("-" * len(hdr))
    fracs = []
    checked = args.no_check
    for b in args.batch:
        for ctx in args.context:
            nblk = -(-ctx // bs)
            tables = torch.randperm(num_blocks, device=dev)[: b * nblk].view(b, nblk).int()
            seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
            q = torch.randn(b, hq, d, dtype=dtype, device=dev)
            out = torch.empty_like(q)
            if not checked:
                got = paged_decode_attention(q, cache, tables, seq_lens, scale,
                                             num_splits=args.num_splits, max_seq_len=ctx)
                want = paged_decode_attention_ref(q, cache, tables, seq_lens, scale)
                torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
                checked = True
            splits = args.num_splits or choose_num_splits(b, hkv, ctx, dev)

            def run() -> None:
                paged_decode_attention(q, cache, tables, seq_lens, scale,
                                       num_splits=args.num_splits, max_seq_len=ctx, out=out)
            ms = time_ms(run, args.warmup, args.repeats, args.inner)
            nbytes = 2 * b * ctx * hkv * d * esize + 2 * b * hq * d * esize + tables.numel() * 4
            gbs = nbytes / ms / 1e6
            fracs.append(gbs / copy_gbs)
            print(f"{b:>4} {ctx:>8} {splits:>6} {ms * 1e3:>9.1f} {gbs:>8.0f} {fracs[-1]:>6.2f}")
    print(f"decode_attention_bw_fraction={statistics.median(fracs):.3f}")


if __name__ == "__main__":
    main()
