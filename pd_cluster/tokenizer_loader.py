"""A model's tokenizer, as transformers' AutoTokenizer builds it, without importing torch where
the answer is known from the files.

``AutoTokenizer`` imports transformers' model configs, and they import torch: seconds of CPU in
the proxy (which needs no torch at all) and about a second per engine at every start, on a
2-core machine beside everything else that is starting. For a directory whose
``tokenizer_config.json`` names the generic class (``PreTrainedTokenizerFast`` or
``TokenizersBackend``, no remote code) and whose ``config.json`` is a model type AutoTokenizer
leaves to that class (``_DIRECT_MODEL_TYPES``), AutoTokenizer returns
``TokenizersBackend.from_pretrained(path)``: we call that directly, and get the same object
(tests/test_tokenizer_loader.py checks the class, encodings, decodings and chat templates
against AutoTokenizer's). Anything else (model-specific classes, sentencepiece-only
checkpoints, remote code, hub ids) goes through AutoTokenizer as before.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# Model types whose registered tokenizer class AutoTokenizer overrides with a generic class the
# checkpoint names (transformers 5: not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, not a
# Mistral-format type); the test re-checks this against the installed transformers.
_DIRECT_MODEL_TYPES = frozenset({"llama"})


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of the model or tokenizer directory (or hub id) ``path``."""
    if loads_directly(path):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
        return TokenizersBackend.from_pretrained(str(path))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


def loads_directly(path: str | Path) -> bool:
    """Whether AutoTokenizer would build ``path``'s tokenizer as a plain TokenizersBackend from
    its tokenizer.json (so that it can be built without AutoTokenizer's imports)."""
    root = Path(path)
    if not (root / "tokenizer.json").is_file() or (root / "tekken.json").exists():
        return False  # hub ids, sentencepiece-only and Mistral-format checkpoints
    tok_config, config = _read(root / "tokenizer_config.json"), _read(root / "config.json")
    return (tok_config.get("tokenizer_class") in _GENERIC_CLASSES
            and "auto_map" not in tok_config and "auto_map" not in config
            and config.get("tokenizer_class") in (None, *_GENERIC_CLASSES)
            and config.get("model_type") in _DIRECT_MODEL_TYPES)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
