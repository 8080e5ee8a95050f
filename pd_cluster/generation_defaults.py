"""Request defaults from a generation config, as vLLM's ``--generation-config`` and
``--override-generation-config`` make them.

``generation_config``: ``auto`` (vLLM's default) reads the model's generation_config.json;
``vllm`` reads nothing (this API's own defaults); any other value is a folder holding a
generation_config.json. Of the file (then the override, which wins key by key) the sampling
keys count: temperature, top_p, top_k and repetition_penalty become the defaults of requests
that do not set them; max_new_tokens is the default max_tokens and, as in vLLM, a server-wide
cap on every HTTP request's max_tokens. The offline ``LLM`` uses them when ``generate`` is
given no SamplingParams (vLLM's ``get_default_sampling_params``).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pd_cluster.models.generation_config import FILE_NAME, read_generation_config
from pd_cluster.sampling_params import SamplingParams

MODES = ("auto", "vllm")
# The file's keys vLLM reads as sampling defaults, and the SamplingParams field of each.
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "repetition_penalty": "repetition_penalty", "min_p": "min_p",
                 "max_new_tokens": "max_tokens"}
# Keys vLLM reads that this server cannot honour: a file's is noted, an override's refused.
UNSUPPORTED = {"min_p": "this server's sampler has no min_p"}


@dataclass(frozen=True)
class GenerationDefaults:
    """What requests get for the sampling fields they leave unset."""
    values: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    source: str = "none"  # where they came from, for the start-up line
    ignored: dict[str, str] = field(default_factory=dict)  # file key -> why not applied

    @property
    def max_tokens(self) -> int | None:
        """The file's max_new_tokens: the default max_tokens and the cap of every request's."""
        return self.values.get("max_tokens")

    def fill(self, given: dict[str, Any]) -> dict[str, Any]:
        """``given`` (SamplingParams keyword arguments) with each default whose key is unset
        (absent or None) added; max_tokens is the caller's (see ``cap``)."""
        out = dict(given)
        for name, value in self.values.items():
            if name != "max_tokens" and out.get(name) is None:
                out[name] = value
        return out

    def cap(self, max_tokens: int) -> int:
        """vLLM's server-wide limit: a request's max_tokens, at most the file's max_new_tokens."""
        return max_tokens if self.max_tokens is None else min(max_tokens, self.max_tokens)

    def sampling_params(self) -> SamplingParams:
        """The offline API's SamplingParams for a ``generate`` given none."""
        return SamplingParams(**self.values)

    def summary(self) -> str | None:
        """The start-up line naming each default and its source, and any key of the file
        not applied (None when there is neither)."""
        lines = []
        if self.values:
            shown = ", ".join(f"{k}={v}" for k, v in self.values.items())
            cap = ("; max_tokens also caps every request's" if self.max_tokens is not None
                   else "")
            lines.append(f"default sampling params from {self.source}: {shown} (a request's "
                         f"own values win{cap}; generation_config vllm: none)")
        lines += [f"generation config: {k} not applied ({why})" for k, why in self.ignored.items()]
        return "\n".join(lines) or None


def load_generation_defaults(model_dir: str, generation_config: str = "auto",
                             override: dict[str, Any] | None = None) -> GenerationDefaults:
    """The request defaults ``generation_config`` and ``override`` describe for the checkpoint
    in ``model_dir``; ValueError naming the key (or the folder) when they are not usable."""
    override = dict(override or {})
    try:
        check_override(override)
    except ValueError as e:
        raise ValueError(f"override_generation_config: {e}") from None
    found: dict[str, Any] = {}
    source = "none"
    if generation_config == "vllm":
        pass
    elif generation_config == "auto":
        found = read_generation_config(model_dir) or {}
        source = f"the model's {FILE_NAME} ({model_dir})"
    else:
        folder = Path(generation_config).expanduser()
        if not folder.is_dir():
            raise ValueError(f"generation_config: {generation_config!r} is not a folder (expected "
                             f"auto, vllm or a folder holding {FILE_NAME})")
        gen = read_generation_config(folder)
        if gen is None:
            raise ValueError(f"generation_config: {generation_config!r} has no {FILE_NAME}")
        found, source = gen, f"{folder / FILE_NAME}"
    try:
        from_file = _sampling(found, None)
    except ValueError as e:
        raise ValueError(f"generation_config: {source}: {e} (generation_config vllm ignores "
                         f"the file's sampling keys)") from None
    from_override = _sampling(override, None)
    ignored = {k: UNSUPPORTED[k] for k in from_file if k in UNSUPPORTED}
    values = {SAMPLING_KEYS[k]: v for k, v in {**from_file, **from_override}.items()
              if k not in UNSUPPORTED}
    sources = ([source] if set(from_file) - set(from_override) - set(UNSUPPORTED) else []) \
        + (["override_generation_config"] if from_override else [])
    return GenerationDefaults(values, " and ".join(sources) or "none", ignored)


def check_override(override: dict[str, Any]) -> None:
    """ValueError naming the key of ``override`` that is not a usable sampling key."""
    for key in override:
        if key in SAMPLING_KEYS and key not in UNSUPPORTED:
            continue
        if key in UNSUPPORTED:
            raise ValueError(f"{key}: {UNSUPPORTED[key]}")
        close = difflib.get_close_matches(key, list(SAMPLING_KEYS) + ["max_tokens"], n=1)
        hint = ("; the file's name for max_tokens is max_new_tokens" if key == "max_tokens"
                else f"; did you mean {close[0]}?" if close else "")
        raise ValueError(f"unknown key {key!r} (one of "
                         f"{', '.join(k for k in SAMPLING_KEYS if k not in UNSUPPORTED)}{hint})")
    _sampling(override, None)


def _sampling(config: dict[str, Any], where: str | None) -> dict[str, Any]:
    """The sampling keys ``config`` sets (null counts as unset, as in vLLM), each checked by
    SamplingParams' own rules: ValueError naming ``where`` (if any) and the key."""
    out = {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None}
    for key, value in out.items():
        if key in UNSUPPORTED:
            continue
        try:
            SamplingParams(**{SAMPLING_KEYS[key]: value})
        except ValueError as e:
            prefix = f"{where}: " if where else ""
            raise ValueError(f"{prefix}{key}: {_reason(e, SAMPLING_KEYS[key])}") from None
    return out


def _reason(error: ValueError, field_name: str) -> str:
    """SamplingParams' message about ``field_name`` told with the file's key name."""
    text = str(error)
    return text[len(field_name) + 1:] if text.startswith(field_name + " ") else text
