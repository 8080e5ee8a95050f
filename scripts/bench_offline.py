"""Offline throughput: our engine's ``LLM.generate`` vs Hugging Face ``generate``, one run.

The same requests (mixed prompt and output lengths, fixed seed) go through
  * ``LLM.generate`` (continuous batching, paged KV, chunked prefill), and
  * HF ``generate`` used as a user would: batches of ``--hf-batch-size`` prompts, left padding,
    greedy, ``max_new_tokens`` = the longest requested output in the batch; only the tokens
    each request asked for count as useful output.
Both ignore EOS so they produce the requested number of tokens.

Also measures batch-1 decode latency of our engine against the memory-bandwidth bound
``weight bytes / bandwidth``, with the bandwidth measured in the same run (a large tensor copy:
bytes read + written / time).

Example:
    python scripts/bench_offline.py --num-requests 64
The last line is ``throughput_ratio_vs_hf=X`` (ours / HF useful output tokens per second).

With ``--tensor-parallel-size N`` (N > 1) it instead runs the same requests on a TP1 and a TPN
engine and prints their throughput and batch-1 decode latency side by side (on CPUs, Gloo: the
cost of the collectives; on GPUs, NCCL: the speed-up), and whether their greedy outputs agree.
With ``--compare-compile`` it runs the same requests on an eager and a compiled engine
(``engine.compile``) side by side; the last line is ``compiled_throughput_ratio_vs_eager=X``.
``--smoke``: a tiny model and a few requests (seconds), for the test suite.
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

DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help='checkpoint dir (default: the "bench-50m" preset, made on first use)')
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: fp32 on CPU, bf16 on CUDA (the engine's auto)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30,
                   help="CPU KV cache budget in bytes (ignored on CUDA)")
    p.add_argument("--batch1-prompt-len", type=int, default=32)
    p.add_argument("--batch1-tokens", type=int, default=64, help="decode steps timed at batch 1")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="tensor size for the copy test")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's default, i.e. all cores)")
    p.add_argument("--skip-hf", action="store_true", help="only run our engine")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="N > 1: compare a TP1 and a TPN engine side by side (no HF run)")
    p.add_argument("--compare-compile", action="store_true",
                   help="run the requests eager and compiled (engine.compile) side by side")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, a few short requests, no HF (a few seconds)")
    args = p.parse_args()
    if args.smoke:
        args.num_requests, args.prompt_len, args.output_len = 6, [4, 40], [4, 12]
        args.batch1_tokens, args.bandwidth_mib, args.skip_hf = 4, 8, True
    return args


def smoke_model() -> str:
    import tempfile

    from pd_cluster.checkpoints.maker import make_model
    out = os.path.join(tempfile.mkdtemp(prefix="bench-offline-smoke-"), "model")
    return str(make_model(out, arch="llama", vocab_size=512, hidden_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, intermediate_size=128))


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    reqs = []
    for _ in range(args.num_requests):
        n = rng.randint(*args.prompt_len)
        out = rng.randint(*args.output_len)
        reqs.append(([rng.randrange(4, vocab_size) for _ in range(n)], out))
    return reqs


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_bandwidth(device: Any, mib: int, repeats: int = 10) -> float:
    """Bytes/s of a large tensor copy (read + write), best of ``repeats``."""
    import torch

    n = mib * (1 << 20) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    del src, dst
    return 2 * n * 4 / best


def run_ours(llm: Any, reqs: list[tuple[list[int], int]], outputs: list | None = None
             ) -> tuple[float, int, int]:
    from pd_cluster.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True) for _, out in reqs]
    sync(llm.engine.runner.device)
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=True)
    sync(llm.engine.runner.device)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = sum(out for _, out in reqs)
    assert produced == expected, f"engine produced {produced} tokens, expected {expected}"
    llm.engine.check_no_leaks()
    if outputs is not None:
        outputs.extend(o.outputs[0].token_ids for o in outs)
    return elapsed, produced, sum(len(p) for p, _ in reqs)


def run_hf(model: Any, reqs: list[tuple[list[int], int]], batch_size: int, pad_id: int,
           device: Any) -> tuple[float, int, int]:
    import torch
    from tqdm import tqdm

    useful = generated = 0
    batches = [reqs[i:i + batch_size] for i in range(0, len(reqs), batch_size)]
    sync(device)
    t = time.perf_counter()
    for batch in tqdm(batches, desc="hf generate"):
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        max_new = max(out for _, out in batch)
        with torch.inference_mode():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=max_new, eos_token_id=[], pad_token_id=pad_id)
        generated += (out.shape[1] - width) * len(batch)
        useful += sum(n for _, n in batch)
    sync(device)
    return time.perf_counter() - t, useful, generated


def batch1_decode_ms(llm: Any, prompt: list[int], num_tokens: int) -> float:
    """Median wall time of one decode step with a single running request."""
    from pd_cluster.sampling_params import SamplingParams

    engine = llm.engine
    device = engine.runner.device
    engine.add_request("batch1", prompt, SamplingParams(temperature=0, max_tokens=num_tokens + 1,
                                                        ignore_eos=True))
    engine.step()  # prefill + first token
    times = []
    while engine.has_unfinished_requests():
        sync(device)
        t = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t)
    engine.check_no_leaks()
    return statistics.median(times) * 1e3


def side_by_side(args: argparse.Namespace, model_dir: str, engine_args: dict[str, Any],
                 variants: dict[str, dict[str, Any]]) -> dict[str, tuple[float, float, list]]:
    """The same requests on one engine per variant (label -> extra engine arguments), one
    after the other in one run: label -> (output tokens/s, batch-1 ms per token, outputs)."""
    from pd_cluster.llm import LLM

    results: dict[str, tuple[float, float, list]] = {}
    for label, extra in variants.items():
        t = time.perf_counter()
        with LLM(model=model_dir, **engine_args, **extra) as llm:
            reqs = make_requests(args, llm.engine.vocab_size)
            prompt1 = make_requests(argparse.Namespace(**{
                **vars(args), "num_requests": 1, "prompt_len": [args.batch1_prompt_len] * 2}),
                llm.engine.vocab_size)[0][0]
            run_ours(llm, [(reqs[0][0][:16], 4)])  # warm-up (and compilation)
            ready_s = time.perf_counter() - t
            b1_ms = batch1_decode_ms(llm, prompt1, args.batch1_tokens)
            outputs: list = []
            seconds, tokens, _ = run_ours(llm, reqs, outputs)
            results[label] = (tokens / seconds, b1_ms, outputs)
            print(f"{label}: device={llm.engine.runner.device} dtype={llm.engine.runner.dtype} "
                  f"{seconds:.2f}s output_tokens={tokens} requests={len(reqs)} "
                  f"ready_after_s={ready_s:.1f} (load + warm-up)")
    return results


def compare_tp(args: argparse.Namespace, model_dir: str, engine_args: dict[str, Any]) -> int:
    """The same requests on a TP1 and a TPN engine, one after the other, in one run."""
    size = args.tensor_parallel_size
    results = side_by_side(args, model_dir, engine_args, {
        "tp1": {"tensor_parallel_size": 1}, f"tp{size}": {"tensor_parallel_size": size}})
    (tps1, b1, out1), (tpsn, bn, outn) = results["tp1"], results[f"tp{size}"]
    print(f"output_tokens_per_s: tp1={tps1:.1f} tp{size}={tpsn:.1f}")
    print(f"batch1_decode_ms_per_token: tp1={b1:.3f} tp{size}={bn:.3f}")
    print(f"greedy_outputs_equal={out1 == outn}")
    print(f"tp{size}_throughput_ratio_vs_tp1={tpsn / tps1:.2f}")
    return 0


def compare_compile(args: argparse.Namespace, model_dir: str,
                    engine_args: dict[str, Any]) -> int:
    """The same requests eager and compiled (engine.compile), one after the other."""
    results = side_by_side(args, model_dir, engine_args,
                           {"eager": {"compile": False}, "compiled": {"compile": True}})
    (tps_e, b1_e, out_e), (tps_c, b1_c, out_c) = results["eager"], results["compiled"]
    print(f"output_tokens_per_s: eager={tps_e:.1f} compiled={tps_c:.1f}")
    print(f"batch1_decode_ms_per_token: eager={b1_e:.3f} compiled={b1_c:.3f}")
    print(f"greedy_outputs_equal={out_e == out_c}")
    print(f"batch1_speedup_compiled_vs_eager={b1_e / b1_c:.2f}")
    print(f"compiled_throughput_ratio_vs_eager={tps_c / tps_e:.2f}")
    return 0


def main() -> int:
    args = parse_args()
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    import transformers
    from transformers import AutoModelForCausalLM

    from pd_cluster.llm import LLM
    from pd_cluster.checkpoints.maker import default_model_path

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    model_dir = args.model or (smoke_model() if args.smoke
                               else str(default_model_path("bench-50m")))
    engine_args: dict[str, Any] = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                       max_num_batched_tokens=args.max_num_batched_tokens,
                                       kv_cache_memory=args.kv_cache_memory)
    if args.dtype:
        engine_args["dtype"] = DTYPES[args.dtype]
    if args.tensor_parallel_size > 1:
        return compare_tp(args, model_dir, engine_args)
    if args.compare_compile:
        return compare_compile(args, model_dir, engine_args)
    llm = LLM(model=model_dir, **engine_args)
    device, dtype = llm.engine.runner.device, llm.engine.runner.dtype
    vocab = llm.engine.vocab_size
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    reqs = make_requests(args, vocab)
    n_prompt = sum(len(p) for p, _ in reqs)
    n_out = sum(o for _, o in reqs)
    print(f"model={model_dir} params={weight_bytes / dtype.itemsize / 1e6:.1f}M dtype={dtype} "
          f"device={device} threads={torch.get_num_threads()}")
    print(f"requests={len(reqs)} prompt_tokens={n_prompt} requested_output_tokens={n_out} "
          f"prompt_len={args.prompt_len} output_len={args.output_len} seed={args.seed}")

    # Warm-up (lazy init, allocator) outside the timed runs.
    run_ours(llm, [(reqs[0][0][:16], 4)])

    bw = memory_bandwidth(device, args.bandwidth_mib)
    bound_ms = weight_bytes / bw * 1e3
    prompt1 = make_requests(argparse.Namespace(**{**vars(args), "num_requests": 1,
                                                  "prompt_len": [args.batch1_prompt_len] * 2}),
                            vocab)[0][0]
    b1_ms = batch1_decode_ms(llm, prompt1, args.batch1_tokens)

    ours_s, ours_tokens, _ = run_ours(llm, reqs)
    ours_tps = ours_tokens / ours_s
    print(f"ours: {ours_s:.2f}s  output_tokens={ours_tokens}  output_tokens_per_s={ours_tps:.1f}  "
          f"total_tokens_per_s={(ours_tokens + n_prompt) / ours_s:.1f}  "
          f"preemptions={llm.engine.stats()['num_preemptions']}")

    hf_tps = None
    if not args.skip_hf:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        hf.generation_config.eos_token_id = None
        pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
        run_hf(hf, [(reqs[0][0][:16], 4)], 1, pad_id, device)  # warm-up
        hf_s, hf_useful, hf_generated = run_hf(hf, reqs, args.hf_batch_size, pad_id, device)
        hf_tps = hf_useful / hf_s
        print(f"hf:   {hf_s:.2f}s  useful_output_tokens={hf_useful} "
              f"(generated {hf_generated} incl. padding rows)  "
              f"output_tokens_per_s={hf_tps:.1f}  batch_size={args.hf_batch_size}")

    print(f"memory_bandwidth_gb_per_s={bw / 1e9:.2f}  weight_bytes={weight_bytes}")
    print(f"batch1_decode_ms_per_token={b1_ms:.3f}")
    print(f"bound_ms_per_token={bound_ms:.3f}")
    print(f"batch1_ratio_to_bound={b1_ms / bound_ms:.2f}")
    print(f"ours_output_tokens_per_s={ours_tps:.1f}")
    if hf_tps is not None:
        print(f"hf_output_tokens_per_s={hf_tps:.1f}")
        print(f"throughput_ratio_vs_hf={ours_tps / hf_tps:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
