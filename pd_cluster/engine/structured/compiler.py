"""Grammars compile here, on their own threads, never on the engine's step: a request waits
for its grammar (the engine holds it back from the scheduler), the batch does not."""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pd_cluster.config import StructuredOutputsConfig
from pd_cluster.engine.structured.request_grammar import RequestGrammar
from pd_cluster.structured_outputs import StructuredOutputsParams

_CACHE_SIZE = 512


class GrammarCompilerPool:
    """One backend per engine (built on first use: a large vocabulary takes a while), compiles
    on ``config.compile_threads`` threads; equal specs share one compiled grammar."""

    def __init__(self, config: StructuredOutputsConfig, tokenizer: Any, vocab_size: int,
                 stop_token_ids: list[int]) -> None:
        self.config = config
        self._tokenizer, self._vocab_size, self._stop = tokenizer, vocab_size, stop_token_ids
        self._backend: Any = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        # Compiled grammars by spec, most recent last, at most _CACHE_SIZE (clients repeat a
        # few schemas; one-off schemas must not grow the engine without bound).
        self._cache: OrderedDict[tuple, Future] = OrderedDict()

    @property
    def backend(self) -> Any:
        with self._lock:  # first use may come from two compile threads at once
            if self._backend is None:
                from pd_cluster.engine.structured.xgrammar_backend import XGrammarBackend
                self._backend = XGrammarBackend(self._tokenizer, self._vocab_size, self._stop,
                                                self.config.compile_threads,
                                                self.config.max_whitespace_cnt)
            return self._backend

    def start(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A request's grammar, compiling (or compiled: a spec seen before) off this thread."""
        key = params.cache_key(self.config.disable_any_whitespace)
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.config.compile_threads,
                                                thread_name_prefix="grammar-compile")
            future = self._pool.submit(self._compile, params, key[-1])
            self._cache[key] = future
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)  # requests holding it keep their own ref
        self._cache.move_to_end(key)
        return RequestGrammar(self, future)

    def _compile(self, params: StructuredOutputsParams, no_whitespace: bool) -> Any:
        return self.backend.compile(params, no_whitespace)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
