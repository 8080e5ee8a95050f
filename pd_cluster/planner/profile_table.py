"""The measured cost table (`pd-cluster profile` writes it, `plan`, the controller and the
simulator read it): prefill seconds and KV bytes per prompt length, decode step seconds per
batch size x context length, KV transfer seconds per prompt's KV bytes, keyed by the model,
dtype, tensor parallelism, device and KV pipe they were measured with.

The raw points are kept; smooth fits over them answer queries (and extrapolate past the grid):
prefill ``a + b n + c n^2`` (attention is quadratic in the prompt), decode step
``a + b B + c B ctx`` (weights once per step, each request's KV read per step), transfer
``a + bytes / rate``. Coefficients are clamped at >= 0 so a noisy grid cannot predict a
negative or falling cost."""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

FORMAT_VERSION = 1


class ProfileKey(BaseModel):
    """What a profile is valid for: a table measured for another key predicts nothing."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    model: str
    dtype: str
    tensor_parallel_size: int = Field(1, ge=1)
    device: str  # "cpu (N threads)" or the GPU's name
    pipe: str  # kv_transfer pipe/transport, e.g. "zmq/tcp"


class PrefillPoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: int = Field(ge=1)
    seconds: float = Field(gt=0)
    kv_bytes: int = Field(ge=0)


class DecodePoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    batch: int = Field(ge=1)
    context: int = Field(ge=1)
    seconds: float = Field(gt=0)  # one decode step of the whole batch


class TransferPoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kv_bytes: int = Field(ge=0)
    seconds: float = Field(ge=0)  # prefill done on P -> first output on D


class Profile(BaseModel):
    """A measured cost table; ``Profile.load(path)`` / ``profile.save(path)``."""
    model_config = ConfigDict(extra="forbid")
    version: int = FORMAT_VERSION
    key: ProfileKey
    block_size: int = Field(16, ge=1)
    max_num_seqs: int = Field(64, ge=1)  # the engines' batch cap when profiled
    max_num_batched_tokens: int = Field(2048, ge=1)
    prefill: list[PrefillPoint] = Field(min_length=1)
    decode: list[DecodePoint] = Field(min_length=1)
    transfer: list[TransferPoint] = Field(default_factory=list)

    # ---- files ---------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.model_dump(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"--profile: no file {p}")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--profile: {p} is not JSON ({e})") from None
        if isinstance(data, dict) and data.get("version", FORMAT_VERSION) != FORMAT_VERSION:
            raise ValueError(f"--profile: {p} is format version {data.get('version')}, "
                             f"this pd-cluster reads {FORMAT_VERSION}: profile again")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise ValueError(f"--profile: {p}: {loc}: {err['msg']}") from None

    # ---- fits ----------------------------------------------------------------------------
    @cached_property
    def _prefill_fit(self) -> np.ndarray:
        n = np.array([p.tokens for p in self.prefill], dtype=float)
        t = np.array([p.seconds for p in self.prefill])
        return _nonneg_fit(np.stack([np.ones_like(n), n, n * n], 1), t)

    @cached_property
    def _kv_per_token(self) -> float:
        return sum(p.kv_bytes for p in self.prefill) / sum(p.tokens for p in self.prefill)

    @cached_property
    def _decode_fit(self) -> np.ndarray:
        b = np.array([p.batch for p in self.decode], dtype=float)
        c = np.array([p.context for p in self.decode], dtype=float)
        t = np.array([p.seconds for p in self.decode])
        return _nonneg_fit(np.stack([np.ones_like(b), b, b * c], 1), t)

    @cached_property
    def _transfer_fit(self) -> np.ndarray:
        if not self.transfer:
            return np.zeros(2)
        x = np.array([p.kv_bytes for p in self.transfer], dtype=float)
        t = np.array([p.seconds for p in self.transfer])
        return _nonneg_fit(np.stack([np.ones_like(x), x], 1), t)

    def prefill_seconds(self, tokens: float) -> float:
        """One prompt of ``tokens`` prefilled alone."""
        a, b, c = self._prefill_fit
        return float(a + b * tokens + c * tokens * tokens)

    def kv_bytes(self, tokens: float) -> float:
        return self._kv_per_token * tokens

    def decode_step_seconds(self, batch: float, context: float) -> float:
        """One decode step of ``batch`` requests of mean context ``context`` tokens."""
        a, b, c = self._decode_fit
        batch = max(batch, 1.0)
        return float(a + b * batch + c * batch * context)

    def transfer_seconds(self, tokens: float) -> float:
        """What the KV transfer adds to TTFT after P's prefill (0 when unmeasured)."""
        a, b = self._transfer_fit
        return float(a + b * self.kv_bytes(tokens))

    def transfer_rate(self) -> float | None:
        """Bytes/s of the pipe as measured (None: not measured or too fast to tell)."""
        b = self._transfer_fit[1]
        return float(1 / b) if b > 0 else None

    def summary(self) -> dict[str, Any]:
        return {"key": self.key.model_dump(), "prefill_points": len(self.prefill),
                "decode_points": len(self.decode), "transfer_points": len(self.transfer),
                "kv_bytes_per_token": round(self._kv_per_token),
                "transfer_bytes_per_s": self.transfer_rate()}


def _nonneg_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (drop a negative one and refit: a handful of
    terms, so the active-set loop ends in as many rounds)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef
