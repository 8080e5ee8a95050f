"""Writes animal_facts.jsonl, the local multiple-choice task of scripts/check_clients.sh:
facts from the demo model's training grammar (scripts/story_grammar.py), each with three
distractors taken from other animals. Deterministic; run it again after editing the grammar."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from story_grammar import ANIMALS, a_an  # noqa: E402

FACTS = (  # (question about one animal, the attribute that answers it)
    (lambda a: f"{a.many.capitalize()} live", "home"),
    (lambda a: f"{a.many.capitalize()} eat", "food"),
    (lambda a: f"{a_an(a.one).capitalize()} can", "can"),
    (lambda a: f"When {a_an(a.one)} talks, it says", "sound"),
    (lambda a: f"{a.many.capitalize()} are animals with", "looks"),
)


def items(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for ask, attr in FACTS:
        for a in ANIMALS:
            answer = getattr(a, attr)
            others = sorted({getattr(b, attr) for b in ANIMALS} - {answer})
            choices = rng.sample(others, 3) + [answer]
            rng.shuffle(choices)
            out.append({"question": ask(a), "choices": [f" {c}." for c in choices],
                        "label": choices.index(answer)})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("animal_facts.jsonl")
    path.write_text("".join(json.dumps(x) + "\n" for x in items()))
    print(f"wrote {path}")
