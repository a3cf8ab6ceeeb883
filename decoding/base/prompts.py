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


@dataclass(frozen=True)
class Seam:
    """What a follow-up turn adds after a finished reply: the reply's end of turn, then the text
    before and after the new user message (through the next reply's header)."""

    end_of_turn: str
    before: str
    after: str

    def text(self, message: str, prefix: str, closed: str = "") -> str:
        """The follow-up's text after a reply that already ends with `closed` (its EOS token's text)."""
        end = self.end_of_turn[len(closed) :] if closed and self.end_of_turn.startswith(closed) else self.end_of_turn
        return end + self.before + message + self.after + prefix


# Without a chat template a follow-up is plain text: the reply, a blank line, the message, a blank line.
PLAIN_SEAM = Seam("", "\n\n", "\n\n")
_MARKS = ("\x01X\x01", "\x01Y\x01", "\x01M\x01")  # text no template alters, to find the seam by


def chat_seam(tokenizer: Any) -> Seam:
    """The seam of the tokenizer's chat template, read off renderings of [user], [user, assistant]
    and [user, assistant, user]; a ValueError saying why when the template does not keep an earlier
    reply as it was generated (one that strips reasoning from past turns, say), since a follow-up
    must extend the very tokens the model produced."""
    x, y, m = _MARKS
    user, reply, follow = (
        {"role": "user", "content": x},
        {"role": "assistant", "content": y},
        {"role": "user", "content": m},
    )
    asked = tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
    answered = tokenizer.apply_chat_template([user, reply], tokenize=False)
    again = tokenizer.apply_chat_template([user, reply, follow], add_generation_prompt=True, tokenize=False)
    if not answered.startswith(asked + y):
        raise ValueError("its chat template does not render an earlier reply after the prompt as it was generated")
    if not again.startswith(answered) or again.count(m) != 1:
        raise ValueError("its chat template renders a conversation's earlier turns differently once a turn follows")
    before, after = again[len(answered) :].split(m)
    return Seam(answered[len(asked + y) :], before, after)


def render_follow_up(
    tokenizer: Any, seam: Seam, context: tuple[int, ...], message: str, prefix: str, eos_ids: frozenset[int]
) -> Rendered:
    """A new turn after a finished sequence: its ids as they were (`context`: prompt and reply, so
    that their stored keys and values serve the follow-up), then the seam's text tokenised alone."""
    ids = list(context)
    closed = ""
    if ids and ids[-1] in eos_ids:
        if seam is PLAIN_SEAM:
            ids.pop()  # plain text has no turns for an EOS to close
        else:
            closed = tokenizer.decode(ids[-1:], skip_special_tokens=False)
    text = seam.text(message, prefix, closed)
    return Rendered(
        tokenizer.decode(ids, skip_special_tokens=False) + text,
        ids + tokenizer(text, add_special_tokens=False)["input_ids"],
        False,
    )
