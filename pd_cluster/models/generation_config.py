"""A checkpoint's generation_config.json: the one reader of the file, and the EOS ids it says
the engine must honour (its sampling fields are request defaults: pd_cluster/generation_defaults.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILE_NAME = "generation_config.json"


def read_generation_config(folder: str | Path) -> dict[str, Any] | None:
    """The JSON object in ``folder``/generation_config.json, or None when the folder has none;
    ValueError naming the file when it is not a JSON object."""
    path = Path(folder) / FILE_NAME
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_eos_token_ids(model_dir: str, hf_config: dict[str, Any],
                       tokenizer_eos: int | None) -> tuple[int, ...]:
    """Every id that ends generation, as HF's generate reads them: generation_config.json's
    ``eos_token_id`` (an int or a list: Llama 3 lists <|end_of_text|>, <|eom_id|> and
    <|eot_id|>), else config.json's, else the tokenizer's."""
    value: Any = (read_generation_config(model_dir) or {}).get("eos_token_id")
    if value is None:
        value = hf_config.get("eos_token_id")
    if value is None:
        value = tokenizer_eos
    ids = [] if value is None else [value] if isinstance(value, int) else list(value)
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id {value!r} in {model_dir!r} is not a token id or a list of them")
    return tuple(dict.fromkeys(ids))
