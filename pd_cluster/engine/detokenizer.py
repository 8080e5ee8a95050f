"""Incremental detokenization (vLLM's ``detokenize_incrementally`` scheme).

Decoding each new token on its own is wrong for byte-level BPE (a multi-byte
UTF-8 character can span several tokens) and for tokenizers whose decoders
add/strip spaces depending on neighbours. Re-decoding the whole output each
step is right but O(n) per token. Instead keep two offsets into the token
list:

    prefix_offset .. read_offset   tokens whose text was already emitted
                                   (kept only as decoding *context*)
    read_offset ..                 tokens not yet emitted

Each step decodes ``tokens[prefix_offset:]`` and ``tokens[prefix_offset:read_offset]``
and emits the difference, unless the result ends in U+FFFD (an unfinished
UTF-8 sequence: wait for more bytes). Both slices stay a handful of tokens
long, so the per-token cost is O(1).

Limitation (shared with vLLM): if the prompt itself ends mid-character, the
first output bytes complete that prompt character and the first delta is
not well defined.
"""

from __future__ import annotations

from typing import Any

# How many already-emitted tokens to keep as context (vLLM uses 5; the prompt
# tail is taken with +2 slack in case some of it are skipped special tokens).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of output token ids into a stream of text deltas.

    ``tokenizer`` is a ``transformers`` tokenizer (fast tokenizers are the
    intended case): only ``convert_ids_to_tokens``, ``convert_tokens_to_string``
    and ``len()`` are used.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._vocab_size = len(tokenizer)
        # Seed the context with the prompt tail so the first output token is
        # decoded as a continuation (e.g. keeps the leading space of "Ġworld"
        # or SentencePiece's "▁world", which a standalone decode would strip).
        tail = list(prompt_token_ids[-(INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2):])
        self._tokens: list[str] = self._convert(tail)
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, 0)
        self._output_token_ids: list[int] = []
        self._text = ""

    @property
    def text(self) -> str:
        """Output text emitted so far (prompt excluded)."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    def _convert(self, ids: list[int]) -> list[str]:
        if not ids:
            return []
        toks = self._tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=self._skip_special_tokens)
        return [toks] if isinstance(toks, str) else list(toks)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.convert_tokens_to_string(self._tokens[start:end])

    def append(self, token_id: int) -> str:
        """Add one generated token; return the newly decodable text (maybe "")."""
        self._output_token_ids.append(token_id)
        if 0 <= token_id < self._vocab_size:
            self._tokens.extend(self._convert([token_id]))
        # else: out-of-vocab id (padded lm_head rows): contributes no text.

        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Nothing new, or a UTF-8 character is still incomplete: hold back.
            # A U+FFFD in the *middle* is a genuinely invalid sequence and is
            # emitted once something valid follows it.
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._text += delta
        return delta

    def flush(self) -> str:
        """Emit any held-back text (e.g. a trailing invalid byte sequence).

        Call once when the request finishes so that the final text matches a
        full ``tokenizer.decode`` even if generation ended mid-character.
        """
        if self._read_offset >= len(self._tokens):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._text += delta
        return delta

    def truncate(self, length: int) -> None:
        """Cut the output text (used when a stop string is matched)."""
        self._text = self._text[:length]
