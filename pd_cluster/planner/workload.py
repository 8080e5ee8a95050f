"""A workload to size for: samples of (prompt tokens, output tokens) per request, from flags
(a length and a +- range, as `vllm bench serve --random-range-ratio`) or from a JSONL of
requests (one object a line with ``input_len``/``prompt_tokens``/``prompt_token_ids`` and
``output_len``/``max_tokens``; an access log of the proxy's usage lines reads the same)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_IN_KEYS = ("input_len", "prompt_tokens", "prompt_len")
_OUT_KEYS = ("output_len", "completion_tokens", "max_tokens")


@dataclass(frozen=True)
class Workload:
    input_lens: np.ndarray  # prompt tokens per request (a sample of the distribution)
    output_lens: np.ndarray  # output tokens per request (>= 1)

    def __post_init__(self) -> None:
        if len(self.input_lens) == 0 or len(self.input_lens) != len(self.output_lens):
            raise ValueError("workload: needs one output length per input length, at least one")
        if self.input_lens.min() < 1 or self.output_lens.min() < 1:
            raise ValueError("workload: lengths must be >= 1 token")

    @classmethod
    def from_lengths(cls, input_len: int, output_len: int, range_ratio: float = 0.0,
                     samples: int = 512, seed: int = 0) -> "Workload":
        if input_len < 1:
            raise ValueError(f"--input-len: must be >= 1, got {input_len}")
        if output_len < 1:
            raise ValueError(f"--output-len: must be >= 1, got {output_len}")
        if not 0 <= range_ratio < 1:
            raise ValueError(f"--range-ratio: must be in [0, 1), got {range_ratio}")
        rng = np.random.default_rng(seed)

        def draw(mean: int) -> np.ndarray:
            lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
            return rng.integers(lo, hi + 1, samples)
        return cls(draw(input_len), draw(output_len))

    @classmethod
    def from_pairs(cls, pairs: list[tuple[int, int]]) -> "Workload":
        arr = np.array(pairs, dtype=np.int64).reshape(-1, 2)
        return cls(arr[:, 0], np.maximum(arr[:, 1], 1))

    @classmethod
    def from_jsonl(cls, path: str | Path) -> "Workload":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"--requests: no file {p}")
        pairs = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"--requests: {p}:{i}: not JSON") from None
            pairs.append((_length(row, _IN_KEYS, p, i), _length(row, _OUT_KEYS, p, i)))
        if not pairs:
            raise ValueError(f"--requests: {p} holds no requests")
        return cls.from_pairs(pairs)

    @property
    def mean_input(self) -> float:
        return float(self.input_lens.mean())

    @property
    def mean_output(self) -> float:
        return float(self.output_lens.mean())

    def decode_context(self) -> float:
        """Mean context of a decode step's requests: each request weighs by its output
        tokens (the steps it is in), at its mid-output context."""
        o = self.output_lens.astype(float)
        return float((o * (self.input_lens + o / 2)).sum() / o.sum())

    def quantile_input(self, q: float) -> float:
        return float(np.quantile(self.input_lens, q))


def _length(row: object, keys: tuple[str, ...], path: Path, line: int) -> int:
    if isinstance(row, dict):
        for key in keys:
            value = row.get(key)
            if isinstance(value, list):  # prompt_token_ids
                return len(value)
            if isinstance(value, int) and value >= 1:
                return value
        if keys is _IN_KEYS and isinstance(row.get("prompt_token_ids"), list):
            return len(row["prompt_token_ids"])
    raise ValueError(f"--requests: {path}:{line}: needs one of {', '.join(keys)} (a positive "
                     f"integer)")
