"""FP8 KV accuracy against the auto KV engine (part 3 of bench_kv_bytes.py).

``greedy_and_kl``: greedy agreement over N prompts x T tokens and the mean KL(auto || fp8) of
the next-token distributions at every position whose context is still the same.
``multiple_choice``: the animal_facts task (scripts/lm_eval_tasks) scored by lm-eval's
multiple-choice rule, computed in-process (lm-eval is not installed here, and the machine is
offline): each choice's log-likelihood is the sum of its tokens' prompt logprobs after the
question (the pair tokenised as lm-eval does: the choice's tokens are the whole's after the
question's); ``acc`` picks the largest, ``acc_norm`` the largest per character.
"""
from __future__ import annotations

import json
from pathlib import Path

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


def greedy_and_kl(model: str, label: str, n_prompts: int, n_tokens: int) -> dict[str, float]:
    from pd_cluster import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    prompts = [torch.randint(4, vocab, (24 + i % 9,), generator=gen).tolist()
               for i in range(n_prompts)]
    runs = {}
    for kv in ("auto", FP8):
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
    for a_toks, a_lp, b_toks, b_lp in zip(*runs["auto"], *runs[FP8]):
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


def multiple_choice(model: str, limit: int | None = None) -> dict[str, float]:
    """animal_facts acc and acc_norm, auto and fp8 KV, and their differences in points."""
    from pd_cluster import LLM
    docs = [json.loads(line) for line in TASK.read_text().splitlines() if line.strip()]
    docs = docs[:limit] if limit else docs
    out = {}
    for kv in ("auto", FP8):
        llm = LLM(model=model, kv_cache_dtype=kv, num_kv_blocks=256)
        try:
            scores = _choice_scores(llm, docs)
        finally:
            llm.close()
        acc = sum(max(range(len(s)), key=s.__getitem__) == d["label"]
                  for s, d in zip(scores, docs))
        norm = sum(max(range(len(s)), key=lambda i: s[i] / len(d["choices"][i]))
                   == d["label"] for s, d in zip(scores, docs))
        out[f"animal_facts_acc_{kv}"] = 100 * acc / len(docs)
        out[f"animal_facts_acc_norm_{kv}"] = 100 * norm / len(docs)
    for m in ("acc", "acc_norm"):
        out[f"animal_facts_{m}_fp8_minus_auto"] = (out[f"animal_facts_{m}_{FP8}"]
                                                   - out[f"animal_facts_{m}_auto"])
    print(f"animal_facts ({len(docs)} questions, lm-eval's multiple-choice rule in-process): "
          + ", ".join(f"{k.removeprefix('animal_facts_')} {v:.1f}" for k, v in out.items()))
    return out
