"""When a sequence ends: EOS, a stop string, or its token budget. One rule for every decoder."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

from decoding.base.values import FinishReason


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class TokenTexts:
    """Each token's own text (decoded alone, special tokens skipped), decoded once per tokenizer (an
    engine holds one): the stop check decodes a sequence's tail only after a token that can end a stop
    string, not twice for every token of every row."""

    texts: dict[int, str] = field(default_factory=dict)

    def of(self, token: int, tokenizer: Detokenizer) -> str:
        text = self.texts.get(token)
        if text is None:
            text = self.texts[token] = tokenizer.decode([token], skip_special_tokens=True)
        return text


@dataclass(frozen=True)
class StopRule:
    eos_ids: frozenset[int]
    stop: tuple[str, ...]
    max_new_tokens: int
    texts: TokenTexts | None = field(default=None, compare=False)  # None: every token's tail is decoded

    def check(self, generated: list[int], tokenizer: Detokenizer, start: int = 0) -> tuple[int, FinishReason | None]:
        """Where the sequence ends, if it has.

        Returns (n, reason): keep the first n generated tokens; reason is None while it goes on.
        Checked left to right so a decoder that commits several tokens at once (speculative
        decoding) stops exactly where one-token-at-a-time decoding would have. Tokens before `start` were
        checked by an earlier call.
        """
        for i in range(start, len(generated)):
            t = generated[i]
            if t in self.eos_ids:
                return i + 1, "eos"
            if self.stop and self._can_end(t, tokenizer) and self._ends_in_stop(generated[: i + 1], tokenizer):
                return i + 1, "stop"
            if i + 1 >= self.max_new_tokens:
                return i + 1, "length"
        return len(generated), None

    @functools.cached_property
    def _last_chars(self) -> str | None:
        """The stop strings' last characters where a token's own text tells whether it can end one
        (each ASCII, not a space); None where it cannot, and every token is checked in full."""
        ends = {s[-1] for s in self.stop if s}  # an empty stop string never matches (it is in every prev)
        return "".join(sorted(ends)) if all(c.isascii() and c != " " for c in ends) else None

    def _can_end(self, token: int, tokenizer: Detokenizer) -> bool:
        """Whether a stop string can first appear with `token`. Its occurrence ends in what the token
        adds: the token's bytes, or a character they complete (a multi-byte one). An ASCII last
        character is then one of the token's own bytes, which its text alone shows (an ASCII byte
        decodes as itself wherever it stands; detokenizers' clean-up only drops spaces), except a space,
        which a SentencePiece decoder strips from the start of a text: stop strings ending in one, or
        in a non-ASCII character, are checked after every token."""
        ends = self._last_chars
        if ends is None or self.texts is None:
            return True
        text = self.texts.of(token, tokenizer)
        return any(c in text for c in ends)

    def _ends_in_stop(self, ids: list[int], tokenizer: Detokenizer) -> bool:
        # A stop string can only have appeared with the last token, so look at a tail long enough
        # to hold the longest stop string (each token decodes to at least one character, or to a
        # partial byte that the next token completes).
        longest = max(len(s) for s in self.stop)
        tail = tokenizer.decode(ids[-(longest + 2) :], skip_special_tokens=True)
        prev = tokenizer.decode(ids[-(longest + 2) : -1], skip_special_tokens=True) if len(ids) > 1 else ""
        return any(s in tail and s not in prev for s in self.stop)


def final_text(generated: list[int], reason: FinishReason | None, stop: tuple[str, ...], tokenizer: Detokenizer) -> str:
    """The text a caller sees: special tokens dropped, and cut before the stop string that ended it."""
    text = tokenizer.decode(generated, skip_special_tokens=True)
    if reason == "stop":
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
        text = text[:cut]
    return text


def reply_ids(generated: list[int], reason: FinishReason | None, text: str, tokenizer: Detokenizer) -> list[int]:
    """The generated ids a follow-up continues: all of them, unless a stop string ended the reply;
    then the fewest whose text covers the reply's (the stop string's tokens dropped, a token that
    straddles the end of the reply kept whole)."""
    if reason != "stop":
        return list(generated)
    lo, hi = 0, len(generated)
    while lo < hi:  # the shortest prefix whose decoding starts with the reply's text
        mid = (lo + hi) // 2
        if tokenizer.decode(generated[:mid], skip_special_tokens=True).startswith(text):
            hi = mid
        else:
            lo = mid + 1
    return list(generated[:lo])
