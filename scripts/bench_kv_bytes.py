"""KV bytes per request, held and shipped: sliding-window families and an FP8 KV cache.

Part 1 (from the layer specs, the engine's own arithmetic: kv_spec page bytes and
connectors/window_shipping.py): for Gemma 3 (5 of 6 layers local, window 1024), gpt-oss
(every other layer, window 128), Mistral with a window (4096) and a full-attention Llama, at
prompts of 2k/8k/32k tokens: blocks held per request, requests that fit a fixed KV budget, and
KV bytes shipped per request, bf16 (auto on a GPU) against fp8_e4m3, before and after window
shipping. "held" is measured on the engine's block allocator (BlockManager driven through a
prompt in chunks of ``CHUNK`` tokens, then one decode step, as the scheduler calls it): with
per-layer-kind block tables (KV cache groups, a sliding group releasing what left its window)
against one table for every layer (groups off, the layout before them); bytes are the block ids
held (``ids``) times the bytes of one id (a page of the group's layers, or of every layer).
Bytes shipped are computed by the producer's own rule (pd_producer._send_unheld: each layer's
blocks from window_shipping.first_shipped_token on), "before" being every block of every layer.

Part 2 (measured): the same through a real in-process P/D pair on the tiny presets (bf16
models on CPU, block 16, head dim 16: FP8's per-block scales cost the most at small head dims),
bytes the producer sent (the connector's kv_bytes_sent counter; KV cache groups on in both
engines), bf16 and fp8 KV, against every block of every layer, and the fp8/bf16
ratios of bytes held per token and bytes sent.

Part 3 (measured): FP8 KV accuracy against the auto KV engine: greedy agreement over N prompts
x T tokens and the mean KL(auto || fp8) of the next-token distributions at every position whose
context is still the same, on tiny-llama and a ~50M model (/work/models/llama-58m if present,
else the bench-50m preset), and scripts/lm_eval_tasks/animal_facts on tiny-llama (the model
trained on those facts) by lm-eval's multiple-choice rule (scripts/kv_fp8_accuracy.py).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from connectors.window_shipping import first_shipped_token  # noqa: E402
from kv_fp8_accuracy import greedy_and_kl, multiple_choice  # noqa: E402
from pd_cluster.engine.block_manager import BlockManager  # noqa: E402
from pd_cluster.engine.cache_engine import KVCacheSpec  # noqa: E402
from pd_cluster.engine.kv_groups import make_groups  # noqa: E402
from pd_cluster.engine.kv_spec import attention_spec  # noqa: E402
from pd_cluster.request import Request  # noqa: E402
from pd_cluster.sampling_params import SamplingParams  # noqa: E402

BS = 16
CHUNK = 2048  # prompt tokens per step (max_num_batched_tokens)
BUDGET = 16 * 2**30  # bytes of KV per engine for "requests that fit"
# (layers, kv heads, head dim, window per layer) of each family's real shapes.
FAMILIES = {
    "gemma3": (48, 8, 256, lambda i: None if i % 6 == 5 else 1024),
    "gpt-oss": (24, 8, 64, lambda i: 128 if i % 2 == 0 else None),
    "mistral-window": (32, 8, 128, lambda i: 4096),
    "llama-full": (32, 8, 128, lambda i: None),
}


def allocator_held(specs: tuple, prompt: int, groups: bool) -> tuple[int, int, int]:
    """(bytes held after the prompt and one decode step, the peak on the way, block ids held
    then) by one request, measured on the engine's block allocator as the scheduler drives
    it (an id is a page of its group's layers: of every layer without groups)."""
    spec = KVCacheSpec(BS, specs, make_groups(specs, groups))
    bm = BlockManager(len(spec.kv_groups) * (-(-(prompt + 1) // BS)) + 1, BS,
                      enable_prefix_caching=False, groups=spec.kv_groups)
    r = Request("r", list(range(prompt)), SamplingParams(max_tokens=2))
    bm.allocate(r, max_new_tokens=CHUNK)
    peak = bm.num_used_blocks
    while r.num_computed_tokens < r.num_tokens:
        n = min(CHUNK, r.num_tokens - r.num_computed_tokens)
        if r.num_computed_tokens:
            bm.append_slots(r, n)
        peak = max(peak, bm.num_used_blocks)
        r.num_computed_tokens += n
        bm.cache_full_blocks(r)
    r.output_token_ids.append(1)  # one decode step
    bm.append_slots(r, 1)
    r.num_computed_tokens += 1
    bm.cache_full_blocks(r)
    held = bm.num_used_blocks
    bm.free(r)
    bm.check_no_leaks()
    return held * spec.block_bytes, max(peak, held) * spec.block_bytes, held


def family_bytes(name: str, prompt: int, dtype: torch.dtype) -> dict[str, float]:
    layers, heads, dim, window_of = FAMILIES[name]
    specs = tuple(attention_spec(heads, dim, dtype, window_of(i)) for i in range(layers))
    blocks = -(-prompt // BS)
    held, _, ids_before = allocator_held(specs, prompt, groups=False)
    grouped, peak, ids = allocator_held(specs, prompt, groups=True)
    # What the producer ships per layer: the connector's own rule (pd_producer._send_unheld
    # applies window_shipping.first_shipped_token to each layer's blocks), computed here.
    shipped = sum((blocks - first_shipped_token(prompt, getattr(layer, "window", None), BS) // BS)
                  * layer.page_bytes(BS) for layer in specs)
    all_blocks = blocks * sum(layer.page_bytes(BS) for layer in specs)
    return {"held_before": held, "held": grouped, "held_peak": peak,
            "shipped_before": all_blocks, "shipped_after": shipped,
            "fits_before": BUDGET // held, "fits": BUDGET // grouped, "blocks": blocks,
            "ids_before": ids_before, "ids": ids}


def part1(prompts: list[int]) -> dict[str, float]:
    print(f"# part 1: per request, from the layer specs (block {BS}, budget "
          f"{BUDGET / 2**30:.0f} GiB)")
    print(f"{'family':>15} {'prompt':>6} {'kv':>5} {'held_before_MiB':>15} {'held_MiB':>9} "
          f"{'held/before':>11} {'ids_before':>10} {'ids':>5} {'peak_MiB':>9} "
          f"{'fit_before':>10} {'fit':>5} "
          f"{'ship_before_MiB':>15} {'ship_after_MiB':>14} {'after/before':>12}")
    out = {}
    for name in FAMILIES:
        for prompt in prompts:
            rows = {}
            for kv, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
                r = rows[kv] = family_bytes(name, prompt, dtype)
                print(f"{name:>15} {prompt:>6} {kv:>5} {r['held_before'] / 2**20:>15.1f} "
                      f"{r['held'] / 2**20:>9.1f} {r['held'] / r['held_before']:>11.3f} "
                      f"{r['ids_before']:>10} {r['ids']:>5} "
                      f"{r['held_peak'] / 2**20:>9.1f} {r['fits_before']:>10} {r['fits']:>5} "
                      f"{r['shipped_before'] / 2**20:>15.1f} "
                      f"{r['shipped_after'] / 2**20:>14.1f} "
                      f"{r['shipped_after'] / r['shipped_before']:>12.3f}")
            key = f"{name}_{prompt}"
            bf16 = rows["bf16"]
            out[f"{key}_ship_ratio"] = bf16["shipped_after"] / bf16["shipped_before"]
            out[f"{key}_fp8_held_ratio"] = rows["fp8"]["held"] / rows["bf16"]["held"]
            out[f"{key}_fp8_ship_ratio"] = (rows["fp8"]["shipped_after"]
                                           / rows["bf16"]["shipped_after"])
            out[f"{key}_groups_held_ratio"] = bf16["held"] / bf16["held_before"]
        print(f"{name:>15} fp8/bf16 bytes: held {out[f'{key}_fp8_held_ratio']:.4f} shipped "
              f"{out[f'{key}_fp8_ship_ratio']:.4f}")
    return out


def pd_bytes_sent(model: str, prompt: list[int], kv: str) -> tuple[int, float]:
    """(bytes the producer sent, the consumer's KV bytes per token) for one request through
    an in-process P/D pair; checks it arrived and nothing leaked."""
    from connectors.transfer_params import RecvKV, SendKV
    from pd_cluster import SamplingParams
    from pd_cluster.config import EngineConfig
    from pd_cluster.engine.llm_engine import LLMEngine

    def make(role: str) -> LLMEngine:
        return LLMEngine(EngineConfig(
            model=model, dtype="bfloat16", block_size=BS,
            num_kv_blocks=4 * (len(prompt) // BS + 4), kv_cache_dtype=kv, kv_transfer={"role": role, "kv_transfer_timeout": 30.0}))
    p, d = make("producer"), make("consumer")
    try:
        p.connect_kv_peer(d.kv_endpoint())
        d.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=2), RecvKV())
        p.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1),
                      SendKV(to=d.kv_endpoint()))
        deadline = time.monotonic() + 120
        while p.has_unfinished_requests() or d.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError("the P/D pair did not finish in 120 s")
            p.step(), d.step()
            time.sleep(0.001)  # the ACKs travel on the pipes' own threads
        assert d.stats()["kv_fallbacks"] == 0, "the KV did not arrive"
        p.check_no_leaks(), d.check_no_leaks()
        return p.stats()["kv_bytes_sent"], d.stats()["kv_bytes_per_token"]
    finally:
        p.close(), d.close()


def part2(prompt_len: int, models: tuple[str, ...]) -> dict[str, float]:
    from pd_cluster.checkpoints.maker import default_model_path
    print(f"# part 2: measured through an in-process P/D pair, prompt {prompt_len} tokens, "
          f"block {BS}, bf16 models on CPU")
    prompt = [5 + (7 * i) % 400 for i in range(prompt_len)]
    print(f"{'model':>20} {'kv':>9} {'sent_bytes':>10} {'all_blocks_bytes':>16} {'ratio':>6} "
          f"{'held_bytes/token':>16}")
    out = {}
    for name in models:
        model = str(default_model_path(name))
        sent, held = {}, {}
        for kv in ("auto", "fp8_e4m3"):
            sent[kv], held[kv] = pd_bytes_sent(model, prompt, kv)
            full = held[kv] * -(-prompt_len // BS) * BS
            print(f"{name:>20} {kv:>9} {sent[kv]:>10} {full:>16.0f} {sent[kv] / full:>6.3f} "
                  f"{held[kv]:>16.2f}")
        out[f"{name}_fp8_held_ratio"] = held["fp8_e4m3"] / held["auto"]
        out[f"{name}_fp8_ship_ratio"] = sent["fp8_e4m3"] / sent["auto"]
        print(f"{name:>20} fp8/bf16 bytes: held {out[f'{name}_fp8_held_ratio']:.4f} sent "
              f"{out[f'{name}_fp8_ship_ratio']:.4f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script runs")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: 2,3")
    args = ap.parse_args()
    skip = set(args.skip.split(",")) - {""}
    from connectors.secret import has_secret, install, new_secret
    if not has_secret():  # the P/D pairs below prove it to each other
        install(new_secret())
    t0 = time.monotonic()
    ratios = part1([256] if args.smoke else [2048, 8192, 32768])
    if "2" not in skip:
        measured = part2(40, ("tiny-gemma3",)) if args.smoke else part2(
            128, ("tiny-gemma3", "tiny-mistral-window", "tiny-random-llama"))
        # The worst fp8/bf16 ratio measured (the target: half, whatever the model).
        ratios["measured_fp8_ratio_max"] = max(measured.values())
    acc = {}
    if "3" not in skip:
        from pd_cluster.checkpoints.maker import default_model_path
        n, t = (2, 4) if args.smoke else (args.prompts, args.tokens)
        tiny = str(default_model_path("tiny-llama"))
        acc |= greedy_and_kl(tiny, "tiny-llama", n, t)
        if not args.smoke:
            big = "/work/models/llama-58m"
            big = big if os.path.isdir(big) else str(default_model_path("bench-50m"))
            acc |= greedy_and_kl(big, "bench-50m", n, t)
        acc |= multiple_choice(tiny, limit=4 if args.smoke else None)
    print(f"# {time.monotonic() - t0:.0f} s")
    prompt = 256 if args.smoke else 8192
    long = 256 if args.smoke else 32768
    print(f"gpt_oss_ship_ratio_{prompt}={ratios[f'gpt-oss_{prompt}_ship_ratio']:.3f} "
          f"gemma3_groups_held_ratio_{long}="
          f"{ratios[f'gemma3_{long}_groups_held_ratio']:.3f} "
          f"fp8_held_ratio={ratios[f'llama-full_{prompt}_fp8_held_ratio']:.3f} "
          f"fp8_ship_ratio={ratios[f'llama-full_{prompt}_fp8_ship_ratio']:.3f}"
          + (f" measured_fp8_ratio_max={ratios['measured_fp8_ratio_max']:.4f}"
             if "measured_fp8_ratio_max" in ratios else "")
          + "".join(f" {k}={v:.4g}" for k, v in acc.items()))
    assert math.isfinite(ratios[f"gpt-oss_{prompt}_ship_ratio"])


if __name__ == "__main__":
    main()
