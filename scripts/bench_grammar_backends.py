"""Which grammar backend: xgrammar, llguidance and outlines-core side by side on one JSON
schema, at a 32k and a 150k vocabulary (synthetic byte-level vocabularies: no model hub here).
Whitespace between JSON tokens is allowed by all three (the text walked has single spaces).
Per backend: compile time (tokenizer set-up apart), the mask fill time per decode step of one
request (host), and the cost to apply a batch-32 mask to fp32 logits. Prints ratios to
xgrammar. ``--smoke``: a 2k vocabulary, a few steps.

    flock /tmp/pd-bench.lock python scripts/bench_grammar_backends.py
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "pets": {"type": "array", "items": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]}, "name": {"type": "string"}},
        "required": ["kind", "name"], "additionalProperties": False}},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "pets", "ok"],
    "additionalProperties": False}
TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "pets": [
    {"kind": "cat", "name": "Tom"}, {"kind": "dog", "name": "Rex"}], "ok": True})
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \",:{}[]_-.'"


def vocab(size: int, seed: int = 0) -> list[str]:
    """256 ASCII-ish single characters first (every text tokenizes), then random pieces."""
    rng = random.Random(seed)
    tokens = [chr(i) for i in range(32, 127)] + [f"<x{i}>" for i in range(256 - 95)]
    seen = set(tokens)
    while len(tokens) < size - 1:
        t = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 8)))
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    return tokens + ["</s>"]


def path(tokens: list[str]) -> list[int]:
    index = {t: i for i, t in enumerate(tokens[:95])}
    return [index[c] for c in TEXT]  # one character per token: a valid walk through the grammar


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokens: list[str]) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo(tokens, vocab_type=xgr.VocabType.RAW,
                                 stop_token_ids=[len(tokens) - 1])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.v = len(tokens)

    def compile(self) -> Any:
        return self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.v)

    def fill(self, m: Any, mask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(mask, 0)

    def accept(self, m: Any, t: int) -> None:
        assert m.accept_token(t)

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, mask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokens: list[str]) -> None:
        import llguidance
        import llguidance.torch as lt
        self.ll, self.lt = llguidance, lt
        index = {t: i for i, t in enumerate(tokens[:95])}

        class Tok:
            eos_token_id, bos_token_id = len(tokens) - 1, None
            special_token_ids = [len(tokens) - 1]

            def __init__(self) -> None:
                self.tokens = [t.encode() for t in tokens]

            def __call__(self, s: Any) -> list[int]:
                s = s.decode() if isinstance(s, bytes) else s
                return [index[c] for c in s]

        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tok()))
        self.v = len(tokens)

    def compile(self) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
        m = self.ll.LLMatcher(self.tok, grammar)  # llguidance compiles lazily, per matcher
        assert not m.is_error(), m.get_error()
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.ll.LLMatcher(self.tok, compiled)

    def bitmask(self, n: int) -> torch.Tensor:
        return self.lt.allocate_token_bitmask(n, self.v)

    def fill(self, m: Any, mask: torch.Tensor) -> None:
        self.lt.fill_next_token_bitmask(m, mask, 0)

    def accept(self, m: Any, t: int) -> None:
        assert m.consume_token(t), m.get_error()

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.lt.apply_token_bitmask_inplace(logits, mask)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokens: list[str]) -> None:
        import outlines_core
        import outlines_core.kernels.torch as okt
        self.oc, self.okt = outlines_core, okt
        eos = len(tokens) - 1
        self.vocab = outlines_core.Vocabulary(eos, {t: [i] for i, t in enumerate(tokens)
                                                    if i != eos})
        self.v = len(tokens)

    def compile(self) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?")
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def bitmask(self, n: int) -> torch.Tensor:
        return self.okt.allocate_token_bitmask(self.v)

    def fill(self, m: Any, mask: torch.Tensor) -> None:
        self.okt.fill_next_token_bitmask(m, mask)

    def accept(self, m: Any, t: int) -> None:
        m.advance(t)

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.okt.apply_token_bitmask_inplace(logits, mask.expand(logits.shape[0], -1)
                                             .contiguous())


def measure(backend: Any, walk: list[int], batch: int) -> dict[str, float]:
    t0 = time.perf_counter()
    compiled = backend.compile()
    compile_ms = (time.perf_counter() - t0) * 1e3
    m = backend.matcher(compiled)
    mask = backend.bitmask(1)
    fills = []
    for t in walk:
        t0 = time.perf_counter()
        backend.fill(m, mask)
        fills.append(time.perf_counter() - t0)
        backend.accept(m, t)
    logits = torch.randn(batch, backend.v)
    masks = backend.bitmask(batch) if backend.name != "outlines-core" else mask
    applies = []
    for _ in range(20):
        t0 = time.perf_counter()
        backend.apply(logits, masks)
        applies.append(time.perf_counter() - t0)
    return {"compile_ms": compile_ms, "fill_us_p50": statistics.median(fills) * 1e6,
            "fill_us_mean": statistics.mean(fills) * 1e6,
            "apply_b%d_us" % batch: statistics.median(applies) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="*", default=[32000, 150000])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    sizes = [2048] if args.smoke else args.vocab
    torch.set_num_threads(1)
    for size in sizes:
        tokens = vocab(size)
        walk = path(tokens)[:20] if args.smoke else path(tokens)
        rows = {}
        for cls in (XGrammar, LLGuidance, OutlinesCore):
            t0 = time.perf_counter()
            try:
                backend = cls(tokens)
            except Exception as e:  # noqa: BLE001 - one backend failing is a result too
                print(f"vocab {size}: {cls.name}: unavailable ({e})")
                continue
            setup = (time.perf_counter() - t0) * 1e3
            rows[cls.name] = {"tokenizer_setup_ms": setup, **measure(backend, walk, args.batch)}
        base = rows.get("xgrammar")
        for name, row in rows.items():
            ratio = (f" fill_vs_xgrammar={row['fill_us_mean'] / base['fill_us_mean']:.2f}x"
                     f" compile_vs_xgrammar={row['compile_ms'] / base['compile_ms']:.2f}x"
                     if base else "")
            print(f"vocab {size:>6} {name:<13} " + " ".join(
                f"{k}={v:.1f}" for k, v in row.items()) + ratio)


if __name__ == "__main__":
    main()
