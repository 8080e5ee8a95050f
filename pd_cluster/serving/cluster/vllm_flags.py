"""`vllm serve` flags that mean nothing here, and the hint for a flag `serve` does not know.

A vLLM user's command line should run unchanged where it can: a flag whose job this cluster
does another way (or always) is accepted and named in one line on stderr; one that would change
what is served and cannot is an error in one line. Anything else gets `serve`'s usage and the
nearest flag or `--set` key, not argparse's bare "unrecognized arguments".
"""
from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class Ignored:
    flag: str
    why: str
    takes_value: bool = False
    # A value that changes what is served and cannot be honoured here: an error, not a note.
    only: str | None = None


IGNORED = (
    Ignored("--trust-remote-code", "models run on this project's own implementations "
            "(docs/models.md); no repository code is executed"),
    Ignored("--disable-log-requests", "requests are not logged beyond the access log"),
    Ignored("--enable-log-requests", "requests are not logged beyond the access log (see "
            "--log-level DEBUG)"),
    Ignored("--swap-space", "no CPU swap space: preempted requests recompute; "
            "--kv-offloading-size keeps evicted prefix blocks in host memory", True),
    Ignored("--pipeline-parallel-size", "no pipeline parallelism; use --tensor-parallel-size "
            "and --prefill/--decode replicas", True, only="1"),
    Ignored("--distributed-executor-backend", "engines always run as Ray actors", True),
    Ignored("--enable-chunked-prefill", "prefill is always chunked (--max-num-batched-tokens)"),
    Ignored("--disable-frontend-multiprocessing", "the API runs in its own Ray actor"),
    Ignored("--uvicorn-log-level", "use pd-cluster --log-level", True),
    Ignored("--disable-uvicorn-access-log", "the access log is pd_cluster.access (--log-level "
            "WARNING silences it)"),
    Ignored("--max-log-len", "prompts are not logged", True),
    Ignored("--tokenizer-mode", "tokenizers load through transformers' AutoTokenizer", True),
    Ignored("--load-format", "checkpoints load from safetensors", True, only="auto"),
    Ignored("--download-dir", "Hugging Face ids use the hub cache: set HF_HUB_CACHE", True),
    Ignored("--quantization", "checkpoints' own quantization config decides (docs/models.md)",
            True),
)
BY_FLAG = {i.flag: i for i in IGNORED}


class _Ignore(argparse.Action):
    """Collects (flag, value) pairs; the flag is then named in a note, not applied."""
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        given = list(getattr(namespace, self.dest) or [])
        given.append((option_string, None if values == [] else values))
        setattr(namespace, self.dest, given)


def add_ignored(p: argparse.ArgumentParser) -> None:
    """Accept each flag (so its value is not taken for MODEL), hidden from --help: the epilog
    lists them."""
    for item in IGNORED:
        p.add_argument(item.flag, dest="vllm_ignored", action=_Ignore, default=None,
                       nargs=None if item.takes_value else 0, help=argparse.SUPPRESS)


def ignored_notes(given: list[tuple[str, str | None]] | None) -> list[str]:
    """One line per flag given; ValueError (one line) for a value that cannot be honoured."""
    return [_note(BY_FLAG[flag], value) for flag, value in given or []]


def epilog() -> str:
    return ("vLLM flags accepted and ignored (no meaning here): "
            + ", ".join(i.flag for i in IGNORED) + ".\n")


def _note(item: Ignored, value: str | None) -> str:
    if item.only is not None and value is not None and value != item.only:
        raise ValueError(f"{item.flag} {value}: not available here ({item.why})")
    return f"note: {item.flag} has no meaning here ({item.why}); ignored"


def nearest(flag: str, options: list[str], keys: list[str]) -> str:
    """`did you mean --x?` or `did you mean --set key=VALUE?` for an unknown ``flag`` (the
    closest of serve's flags and the YAML keys' last parts), or where to look."""
    word = flag.lstrip("-").replace("-", "_")
    candidates = {o.lstrip("-").replace("-", "_"): o for o in options}
    for key in keys:  # a flag of serve wins a tie with a key
        candidates.setdefault(key.rsplit(".", 1)[-1], f"--set {key}=VALUE")
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    if close:
        return f"did you mean {candidates[close[0]]}?"
    return "`pd-cluster serve --help` lists the flags; --set KEY=VALUE sets any config key"
