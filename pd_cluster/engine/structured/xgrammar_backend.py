"""The xgrammar backend: a spec -> its compiled grammar (tokenizer-bound), and a spec checked
without a tokenizer (the proxy's 400s). Chosen by measurement: scripts/bench_grammar_backends.py.
"""
from __future__ import annotations

import json
from typing import Any

from pd_cluster.structured_outputs import StructuredOutputsParams


_ANY_OBJECT = '{"type": "object"}'


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string escapes are valid EBNF string literal escapes in xgrammar.
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _json_schema(spec: str) -> str:
    json.loads(spec)  # a clear "invalid JSON" before xgrammar's own message
    return spec


def check_spec(params: StructuredOutputsParams, no_whitespace: bool = False) -> None:
    """ValueError (the backend's message) unless ``params`` compiles to a grammar."""
    import xgrammar as xgr
    kind, spec = params.kind, params.spec()
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(_json_schema(spec), any_whitespace=not no_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(_choice_ebnf(spec))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError) as e:
        raise ValueError(_short(e)) from None


def _short(e: Exception) -> str:
    """xgrammar's message without its '[time] /project/cpp/file.cc:line: ' prefix."""
    text = str(e).strip()
    head, sep, rest = text.partition(".cc:")
    if sep:
        text = rest.split(": ", 1)[-1]
    return text.splitlines()[0][:500] if text else type(e).__name__


class XGrammarBackend:
    """Compiles specs for one tokenizer (thread safe: xgrammar's compiler caches and locks)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 threads: int, max_whitespace_cnt: int | None = None) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids or None)
        self.vocab_size = vocab_size
        self._max_whitespace = max_whitespace_cnt
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, params: StructuredOutputsParams, no_whitespace: bool) -> Any:
        c, kind, spec = self._compiler, params.kind, params.spec()
        # The whitespace between JSON tokens: none, or at most the cap (per gap)
        ws: dict[str, Any] = ({"any_whitespace": False} if no_whitespace else
                              {"any_whitespace": True, "max_whitespace_cnt": self._max_whitespace})
        try:
            if kind == "json":
                return c.compile_json_schema(_json_schema(spec), **ws)
            if kind == "json_object":  # an object, as OpenAI's json_object promises
                return c.compile_json_schema(_ANY_OBJECT, **ws)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                return c.compile_grammar(_choice_ebnf(spec))
            return c.compile_grammar(spec)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"structured_outputs.{kind}: {_short(e)}") from None

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, rows: int) -> Any:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill_bitmask(self, matchers: list[Any], bitmask: Any, rows: list[int]) -> None:
        """Row ``rows[i]`` of ``bitmask`` (on the host) gets matcher i's allowed tokens."""
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def accepts(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def is_terminated(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())

    def apply_bitmask(self, logits: Any, bitmask: Any, rows: list[int]) -> None:
        """Rows ``rows`` of ``logits`` (on its device) lose every token their mask bans."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                              vocab_size=self.vocab_size, indices=rows)
