"""A request's prompt as the model sees it: the chat template (when the model has one) around the
user's text, then the reply's first words (`GenRequest.prefix`). The in-process engine feeds the
token ids; the server backend sends the text, built the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rendered:
    text: str  # the prompt as text, chat template applied
    ids: list[int]  # its token ids, special tokens included
    special: bool  # whether the tokenizer adds its special tokens (BOS) to `text` to get `ids`


def render(tokenizer: Any, use_chat: bool, prompt: str | tuple[int, ...], prefix: str = "") -> Rendered:
    if not isinstance(prompt, str):
        ids = list(prompt) + (tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else [])
        return Rendered(tokenizer.decode(list(prompt), skip_special_tokens=False) + prefix, ids, False)
    if use_chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        text += prefix
        return Rendered(text, tokenizer(text, add_special_tokens=False)["input_ids"], False)
    return Rendered(prompt + prefix, tokenizer(prompt + prefix)["input_ids"], True)
