"""Chat messages to prompt tokens, shared by the offline ``LLM.chat`` and the HTTP proxy: the
tokenizer's chat template, text content only (a part that is an image, audio or a file is a
ValueError naming it, not a parse error about strings)."""
from __future__ import annotations

from typing import Any, Sequence

UNSUPPORTED_PARTS = "only text content is supported (images, audio, video and files are not)"


def content_text(content: Any, where: str = "content") -> str:
    """A message's content as text: a string, None, or a list of ``{"type": "text", "text":
    ...}`` parts (joined). ValueError naming ``where`` for any other part."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where}: expected a string or a list of content parts, got "
                         f"{type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        if kind != "text":
            raise ValueError(f"{where}[{i}]: content part of type {kind!r}: "
                             f"{UNSUPPORTED_PARTS}")
        text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
        if not isinstance(text, str):
            raise ValueError(f"{where}[{i}].text: expected a string")
        texts.append(text)
    return "".join(texts)


def check_content_parts(content: Any) -> Any:
    """For a pydantic ``mode="before"`` validator: ValueError on a part that is not text."""
    if isinstance(content, (list, tuple)):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind != "text":
                raise ValueError(f"content part {i} has type {kind!r}: {UNSUPPORTED_PARTS}")
    return content


def render_chat(tokenizer: Any, messages: Sequence[Any], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template: str | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """The prompt as text and token ids: the chat template rendered to text, then tokenized
    without adding special tokens again (the template writes them)."""
    if not messages:
        raise ValueError("messages: expected at least one message")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}]: expected a dict with 'role' and 'content'")
        plain.append({**m, "content": content_text(m.get("content"),
                                                   f"messages[{i}].content")})
    text = tokenizer.apply_chat_template(
        plain, tokenize=False, chat_template=chat_template,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
    return text, list(tokenizer.encode(text, add_special_tokens=False))
