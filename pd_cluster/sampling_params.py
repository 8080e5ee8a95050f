"""Per-request sampling parameters (a vLLM-compatible subset).

The params travel between processes (API server -> prefill/decode workers), so
they serialise to a plain msgpack-able dict via ``to_dict`` / ``from_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pd_cluster.structured_outputs import StructuredOutputsParams

# Below this temperature sampling is treated as greedy: dividing logits by a
# near-zero temperature overflows and is numerically meaningless anyway.
_GREEDY_EPS = 1e-5
# Same cap as vLLM's default max_logprobs; keeps the per-token payload small.
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 disables top-k
    max_tokens: int | None = 16
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = field(default=None)
    ignore_eos: bool = False
    logprobs: int | None = None
    # Top-k logprobs of every prompt token (the first has none), computed by the engine that
    # prefills the prompt; such a request bypasses the prefix cache (cached tokens have no logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # The output must match a grammar (JSON schema, regex, choice, EBNF): masks in the sampler.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Normalise first so that validation and every consumer see one shape.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == 0:
            self.top_k = -1  # one canonical "disabled" value
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, cond: str, value: Any) -> ValueError:
            return ValueError(f"{name} must be {cond}, got {value!r}")

        if _is_bool(self.n) or not isinstance(self.n, int) or self.n != 1:
            raise bad("n", "1 (only n=1 is supported)", self.n)
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", ">= 0", self.temperature)
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if _is_bool(self.top_k) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "-1 (disabled), 0 (disabled) or >= 1", self.top_k)
        if self.max_tokens is not None and (
            _is_bool(self.max_tokens) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", ">= 1 or None", self.max_tokens)
        if self.seed is not None and (_is_bool(self.seed) or not isinstance(self.seed, int)):
            raise bad("seed", "an int or None", self.seed)
        if not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", "a str or a list of str", self.stop)
        if any(s == "" for s in self.stop):
            raise bad("stop", "non-empty strings", self.stop)
        if not all(isinstance(t, int) and not _is_bool(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of int", self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (_is_bool(k) or not isinstance(k, int)
                                  or not 0 <= k <= MAX_LOGPROBS):
                raise bad(name, f"in [0, {MAX_LOGPROBS}] or None", k)
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "in [-2, 2]", getattr(self, name))
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "> 0", self.repetition_penalty)
        if self.logit_bias is not None and not all(
                isinstance(t, int) and not _is_bool(t) and _is_number(b) and -100 <= b <= 100
                for t, b in self.logit_bias.items()):
            raise bad("logit_bias", "a map of token id -> bias in [-100, 100]", self.logit_bias)
        if _is_bool(self.min_tokens) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "a StructuredOutputsParams", self.structured_outputs)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "a bool", getattr(self, name))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def max_stop_len(self) -> int:
        """Longest stop string; bounds the text window searched per step."""
        return max((len(s) for s in self.stop), default=0)  # type: ignore[union-attr]

    def to_dict(self) -> dict[str, Any]:
        # Only builtin scalars / lists, so msgpack and json can carry it as-is.
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, StructuredOutputsParams):
                v = {k.name: getattr(v, k.name) for k in fields(v)}
            out[f.name] = list(v) if isinstance(v, list) else v
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            # Silently dropping keys would hide client typos (e.g. "top-p").
            raise ValueError(f"unknown SamplingParams field(s): {', '.join(unknown)}")
        so = d.get("structured_outputs")
        if isinstance(so, dict):
            d = {**d, "structured_outputs": StructuredOutputsParams(**so)}
        return cls(**d)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
