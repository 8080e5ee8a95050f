"""FP8 KV accuracy against the auto KV engine (part 3 of bench_kv_bytes.py).

``greedy_and_kl``: greedy agreement over N prompts x T tokens and the mean KL(auto || fp8) of
the next-token distributions at every position whose context is still the same.
``multiple_choice``: the animal_facts task (scripts/lm_eval_tasks) scored by lm-eval's
multiple-choice rule, computed in-process (lm-eval is not installed here, and the machine is
offline): each choice's log-likelihood is the sum of its tokens' prompt logprobs after the
question (the pair tokenised as lm-eval does: the choice's tokens are the whole's after the
question's); ``acc`` picks the largest, ``acc_norm`` the largest per character. Its FP8 run also
records every K/V write (``_WriteError``): the stored values' relative RMS error beside FP8's own
floor (each token and head quantised alone, with its own power-of-two scale: the per-block rule
cannot beat it in FP8) and how many values were clipped; equal figures and 0 clipped mean the
gap to auto is the format's, not the scale rule's.

    python scripts/kv_fp8_accuracy.py [--kv fp8_e4m3 --kv fp8_e5m2] [--prompts 64 --tokens 64]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Self

import torch

TASK = Path(__file__).resolve().parent / "lm_eval_tasks" / "animal_facts.jsonl"
FP8 = "fp8_e4m3"


def _logits_recorder(llm) -> list[torch.Tensor]:
    """Every compute_logits output of the engine (one row per step for one request)."""
    rows: list[torch.Tensor] = []
    model = llm.engine.runner.model
    real = model.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        out = real(hidden)
        rows.append(out.detach().float().cpu())
        return out
    model.compute_logits = record
    return rows


class _WriteError:
    """While active: every FP8 K/V write's stored values against the values written."""

    def __init__(self) -> None:
        self.sums = torch.zeros(2, 4, dtype=torch.float64)  # K/V: err², floor err², x², clipped
        self.count = 0

    def __enter__(self) -> Self:
        import kernels.reshape_and_cache as rc
        import pd_cluster.attention.torch_backend as tb
        self._sites = [(m, m.write_fp8) for m in (tb, rc)]  # both callers of the write
        real = self._sites[0][1]

        def write(key, value, kv_cache, slot_mapping, static_scales=None):
            real(key, value, kv_cache, slot_mapping, static_scales)
            self._measure(key, value, kv_cache, slot_mapping)
        for module, _ in self._sites:
            module.write_fp8 = write
        return self

    def __exit__(self, *exc) -> None:
        for module, fn in self._sites:
            module.write_fp8 = fn

    def _measure(self, key, value, kv_cache, slot_mapping) -> None:
        from kernels.kv_quant import fp8_max, pow2_scale, split
        slots = slot_mapping[:key.shape[0]].long()
        keep = slots >= 0
        data, scales = split(kv_cache, key.shape[-1])
        bs, top = data.shape[2], fp8_max(kv_cache.dtype)
        blk, off = slots[keep] // bs, slots[keep] % bs
        for part, x in enumerate((key[keep].float(), value[keep].float())):
            s = scales[part][blk][:, :, None]
            got = data[part][blk, off].float() * s
            own = pow2_scale(x.abs().amax(-1), top)[:, :, None]
            floor = (x / own).to(kv_cache.dtype).float() * own
            self.sums[part] += torch.tensor([(got - x).square().sum(), (floor - x).square().sum(),
                                             x.square().sum(), (x.abs() > s * top).sum()],
                                            dtype=torch.float64)
        self.count += int(keep.sum()) * key.shape[1] * key.shape[2]

    def figures(self, kv: str) -> dict[str, float]:
        out = {}
        for part, name in enumerate("kv"):
            err, floor, sig, clipped = self.sums[part].tolist()
            out |= {f"{kv}_{name}_rel_rms_err": (err / sig) ** 0.5,
                    f"{kv}_{name}_rel_rms_floor": (floor / sig) ** 0.5,
                    f"{kv}_{name}_clipped": clipped}
        print(f"{kv} stored K/V vs written (relative RMS error; floor: each token-head with its "
              f"own scale): " + ", ".join(
                  f"{n.upper()} {out[f'{kv}_{n}_rel_rms_err']:.4f} (floor "
                  f"{out[f'{kv}_{n}_rel_rms_floor']:.4f}, {out[f'{kv}_{n}_clipped']:.0f} clipped)"
                  for n in "kv") + f" of {self.count} values each")
        return out


def greedy_and_kl(model: str, label: str, n_prompts: int, n_tokens: int,
                  fp8: str = FP8) -> dict[str, float]:
    from pd_cluster import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(4, vocab, (24 + i % 9,), generator=gen).tolist()
               for i in range(n_prompts)]
    runs = {}
    for kv in ("auto", fp8):
        llm = LLM(model=model, kv_cache_dtype=kv, num_kv_blocks=64, enable_prefix_caching=False)
        try:
            rows = _logits_recorder(llm)
            toks, dists = [], []
            for prompt in prompts:  # one at a time: each step's logits row is this request's
                start = len(rows)
                toks.append(llm.generate([prompt], [params])[0].outputs[0].token_ids)
                dists.append(torch.cat(rows[start:]).log_softmax(-1))
                del rows[start:]
            runs[kv] = (toks, dists)
        finally:
            llm.close()
    same_seq = agree = total = 0
    kls = []
    for a_toks, a_lp, b_toks, b_lp in zip(*runs["auto"], *runs[fp8]):
        n = next((i for i, (x, y) in enumerate(zip(a_toks, b_toks)) if x != y), len(a_toks))
        same_seq += n == len(a_toks)
        agree += sum(x == y for x, y in zip(a_toks, b_toks))
        total += len(a_toks)
        upto = min(n + 1, len(a_toks))  # positions whose context is still the same
        kls.append((a_lp[:upto].exp() * (a_lp[:upto] - b_lp[:upto])).sum(-1))
    kl = torch.cat(kls).mean().item()
    print(f"{label:>12}: greedy tokens agreeing {agree / total:.4f}, sequences identical "
          f"{same_seq}/{n_prompts}, mean KL(auto||fp8) {kl:.2e} nats over "
          f"{sum(len(k) for k in kls)} positions")
    return {f"{label}_agreement": agree / total, f"{label}_kl": kl}


def _choice_scores(llm, docs: list[dict]) -> list[list[float]]:
    """Each doc's per-choice log-likelihood, all pairs in one generate call."""
    from pd_cluster import SamplingParams
    tok = llm.get_tokenizer()
    prompts, spans = [], []
    for doc in docs:
        ctx = tok(doc["question"])["input_ids"]
        for choice in doc["choices"]:
            whole = tok(doc["question"] + choice)["input_ids"]
            prompts.append(whole)
            spans.append(len(ctx))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(prompts, [params] * len(prompts))
    lls = [sum(lp[t] for t, lp in zip(p[start:], o.prompt_logprobs[start:]))
           for p, start, o in zip(prompts, spans, outs)]
    it = iter(lls)
    return [[next(it) for _ in doc["choices"]] for doc in docs]


def multiple_choice(model: str, limit: int | None = None, fp8: str = FP8) -> dict[str, float]:
    """animal_facts acc and acc_norm, auto and fp8 KV, and their differences in points; the
    FP8 run's stored error against its floor (``_WriteError``)."""
    from pd_cluster import LLM
    docs = [json.loads(line) for line in TASK.read_text().splitlines() if line.strip()]
    docs = docs[:limit] if limit else docs
    out = {}
    for kv in ("auto", fp8):
        llm = LLM(model=model, kv_cache_dtype=kv, num_kv_blocks=256)
        try:
            with _WriteError() as werr:
                scores = _choice_scores(llm, docs)
        finally:
            llm.close()
        if kv != "auto":
            out |= werr.figures(kv)
        acc = sum(max(range(len(s)), key=s.__getitem__) == d["label"]
                  for s, d in zip(scores, docs))
        norm = sum(max(range(len(s)), key=lambda i: s[i] / len(d["choices"][i]))
                   == d["label"] for s, d in zip(scores, docs))
        out[f"animal_facts_acc_{kv}"] = 100 * acc / len(docs)
        out[f"animal_facts_acc_norm_{kv}"] = 100 * norm / len(docs)
    for m in ("acc", "acc_norm"):
        out[f"animal_facts_{m}_fp8_minus_auto"] = (out[f"animal_facts_{m}_{fp8}"]
                                                   - out[f"animal_facts_{m}_auto"])
    print(f"animal_facts ({len(docs)} questions, one is {100 / len(docs):.2f} points; "
          "lm-eval's multiple-choice rule in-process): " + ", ".join(
              f"{k.removeprefix('animal_facts_')} {v:.1f}" for k, v in out.items()
              if k.startswith("animal_facts_")))
    return out


def main() -> None:
    from pd_cluster.checkpoints.maker import default_model_path
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", action="append", choices=["fp8_e4m3", "fp8_e5m2"],
                    help="FP8 KV dtype(s) against auto (default: both)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--bench-model", default="bench-50m", help="a preset or checkpoint dir")
    args = ap.parse_args()
    tiny = str(default_model_path("tiny-llama"))
    big = args.bench_model
    big = big if Path(big).is_dir() else str(default_model_path(big))
    for fp8 in args.kv or ["fp8_e4m3", "fp8_e5m2"]:
        greedy_and_kl(tiny, f"tiny-llama {fp8}", args.prompts, args.tokens, fp8)
        greedy_and_kl(big, f"{Path(big).name} {fp8}", args.prompts, args.tokens, fp8)
        multiple_choice(tiny, fp8=fp8)


if __name__ == "__main__":
    main()
