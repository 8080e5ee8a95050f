"""Train the built-in demo model (the ``tiny-llama`` preset) so it writes readable English.

Everything is offline and deterministic: the text comes from a small grammar of stories,
animal facts, dialogues and chat turns (scripts/story_grammar.py, fixed seed); a byte-level BPE
tokenizer is trained on that text with the model maker's pipeline and chat template; a small
Llama is trained on one CPU thread with fixed seeds; the fp32 checkpoint is written with the
model maker's writer (pd_cluster/assets/tiny-llama by default, shipped as package data).

    python scripts/train_tiny_model.py              # a few minutes on one CPU core
It shows a progress bar, then greedy samples and, last, the final training and held-out loss.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread is deterministic
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pd_cluster.checkpoints.maker import (PRESETS, build_config, build_tokenizer,  # noqa: E402
                                    save_checkpoint)
from story_grammar import corpus  # noqa: E402

PRESET = "tiny-llama"
SAMPLE_PROMPTS = ("Once upon a time", "The quick brown fox")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "pd_cluster" / "assets" / PRESET)
    p.add_argument("--docs", type=int, default=40000, help="training documents")
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def tokenize(tokenizer: Any, docs: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """All documents as one token stream, each followed by </s>; and where each one starts."""
    eos = tokenizer.eos_token_id
    ids, starts = [], []
    for doc_ids in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        starts.append(len(ids))
        ids.extend(doc_ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(starts, dtype=torch.long)


def batch(stream: torch.Tensor, starts: torch.Tensor, size: int, seq_len: int,
          gen: torch.Generator) -> torch.Tensor:
    """size windows of seq_len + 1 tokens, each starting where a document starts (prompts at
    inference time start at position 0 with no </s> before them, like these windows)."""
    usable = starts[starts < len(stream) - seq_len - 1]
    pick = usable[torch.randint(len(usable), (size,), generator=gen)]
    return torch.stack([stream[s:s + seq_len + 1] for s in pick.tolist()])


def lr_at(step: int, steps: int, peak: float, warmup: int = 30, decay: float = 0.4) -> float:
    """Warm up, hold the peak, then decay linearly to 10% over the last ``decay`` of the steps:
    copying names from earlier in the story is learned late, and only while the rate is high."""
    if step < warmup:
        return peak * (step + 1) / warmup
    start = int(steps * (1 - decay))
    if step < start:
        return peak
    return peak * (1 - 0.9 * (step - start) / max(1, steps - start))


def mean_loss(model: Any, stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> float:
    gen = torch.Generator().manual_seed(1)
    losses = []
    with torch.no_grad():
        for _ in range(8):
            w = batch(stream, starts, 16, seq_len, gen)
            logits = model(input_ids=w[:, :-1]).logits
            losses.append(float(torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), w[:, 1:].flatten())))
    return sum(losses) / len(losses)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()

    t0 = time.monotonic()
    shape = PRESETS[PRESET]
    docs = corpus(args.docs, seed=args.seed)
    tokenizer, n_real = build_tokenizer(shape["vocab_size"], docs)
    stream, starts = tokenize(tokenizer, docs)
    held_stream, held_starts = tokenize(tokenizer, corpus(400, seed=args.seed + 1))
    print(f"corpus: {len(docs)} documents, {len(stream):,} tokens; tokenizer: {n_real} "
          f"trained tokens of {shape['vocab_size']}")

    config = build_config(tokenizer, **shape)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, {shape}")
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices; not norms
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    recent: list[float] = []
    bar = tqdm(range(args.steps), desc="train", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        w = batch(stream, starts, args.batch_size, args.seq_len, gen)
        logits = model(input_ids=w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = (recent + [float(loss)])[-20:]
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}")
    bar.close()

    model.eval()
    final = sum(recent) / len(recent)
    held = mean_loss(model, held_stream, held_starts, args.seq_len)
    out = save_checkpoint(model, tokenizer, args.out, dict(
        preset=PRESET, trained_by="scripts/train_tiny_model.py", seed=args.seed, docs=args.docs,
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        tokenizer_trained_vocab=n_real, final_loss=round(final, 4),
        held_out_loss=round(held, 4)))
    print(f"wrote {out} in {time.monotonic() - t0:.0f}s")
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            new = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=40)[0, ids.shape[1]:]
        print(f"sample: {prompt!r} -> {tokenizer.decode(new, skip_special_tokens=True)!r}")
    print(f"final loss {final:.4f} (mean of the last {len(recent)} steps), held-out loss {held:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
