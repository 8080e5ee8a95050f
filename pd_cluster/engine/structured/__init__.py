"""Structured outputs in the engine: grammars compiled off the step (compiler.py), one matcher
per request that follows its output tokens (request_grammar.py), and the batched masks the
sampler applies (masks.py)."""
from pd_cluster.engine.structured.compiler import GrammarCompilerPool
from pd_cluster.engine.structured.masks import apply_grammar_masks
from pd_cluster.engine.structured.request_grammar import RequestGrammar

__all__ = ["GrammarCompilerPool", "RequestGrammar", "apply_grammar_masks"]
