"""What a checkpoint's generation_config.json says the engine must honour (EOS ids)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_eos_token_ids(model_dir: str, hf_config: dict[str, Any],
                       tokenizer_eos: int | None) -> tuple[int, ...]:
    """Every id that ends generation, as HF's generate reads them: generation_config.json's
    ``eos_token_id`` (an int or a list: Llama 3 lists <|end_of_text|>, <|eom_id|> and
    <|eot_id|>), else config.json's, else the tokenizer's."""
    value: Any = None
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("eos_token_id")
    if value is None:
        value = hf_config.get("eos_token_id")
    if value is None:
        value = tokenizer_eos
    ids = [] if value is None else [value] if isinstance(value, int) else list(value)
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id {value!r} in {model_dir!r} is not a token id or a list of them")
    return tuple(dict.fromkeys(ids))
