"""What a JSON schema costs per decode step: the engine's time per output token (TPOT) with
and without a schema at batch 1 and 32, fp32, side by side in one run, and the grammar mask's
share of each step (fill on the host + apply on the logits). Prints ratios.

    flock /tmp/pd-bench.lock python scripts/bench_structured.py [--model DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import pd_cluster.engine.step_output as step_output
from pd_cluster import LLM, SamplingParams
from pd_cluster.serving.cluster.cluster_config import resolve_model
from pd_cluster.structured_outputs import StructuredOutputsParams

# Long enough that every request decodes max_tokens tokens (strings of up to 40 characters).
SCHEMA = {"type": "object", "properties": {"notes": {
    "type": "array", "items": {"type": "string"}, "minItems": 40, "maxItems": 40}},
    "required": ["notes"], "additionalProperties": False}


class MaskTimer:
    """Wraps the sampler's grammar mask step and sums its time per engine step."""

    def __init__(self) -> None:
        self.real = step_output.apply_grammar_masks
        self.seconds = 0.0

    def __call__(self, logits: torch.Tensor, requests: list[Any]) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.real(logits, requests)
        self.seconds += time.perf_counter() - t0
        return out


def run(llm: LLM, batch: int, max_tokens: int, schema: bool, timer: MaskTimer
        ) -> tuple[float, float]:
    """(median decode step seconds with the whole batch decoding, mask seconds per step)."""
    engine = llm.engine
    so = StructuredOutputsParams(json=json.dumps(SCHEMA)) if schema else None
    prompt = llm.get_tokenizer().encode("Notes:")
    for i in range(batch):
        engine.add_request(f"r{i}", prompt, SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=not schema,
            structured_outputs=so))
    steps, masks, done = [], [], 0
    while done < batch:
        timer.seconds = 0.0
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        full = len(engine.scheduler.running) == batch and all(
            r.is_decoding for r in engine.scheduler.running)
        if full and outs:
            steps.append(dt)
            masks.append(timer.seconds)
        done += sum(o.finished for o in outs)
    engine.check_no_leaks()
    return statistics.median(steps), statistics.mean(masks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.max_tokens = [2], 12
    timer = MaskTimer()
    step_output.apply_grammar_masks = timer
    with LLM(model=resolve_model(args.model), dtype="float32", device="cpu",
             num_kv_blocks=1024, max_model_len=1024,
             structured_outputs={"disable_any_whitespace": True}) as llm:
        run(llm, 1, 4, True, timer)  # warm: the grammar compiles once, as in a server
        for batch in args.batches:
            plain, _ = run(llm, batch, args.max_tokens, False, timer)
            guided, mask = run(llm, batch, args.max_tokens, True, timer)
            print(f"batch={batch} tpot_plain_ms={plain * 1e3:.2f} "
                  f"tpot_schema_ms={guided * 1e3:.2f} mask_ms_per_step={mask * 1e3:.3f} "
                  f"mask_share={mask / guided:.3f} tpot_ratio={guided / plain:.2f}")


if __name__ == "__main__":
    main()
