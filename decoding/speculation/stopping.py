"""When a sequence ends: EOS, a stop string, or its token budget. One rule for every decoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from decoding.base.values import FinishReason


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class StopRule:
    eos_ids: frozenset[int]
    stop: tuple[str, ...]
    max_new_tokens: int

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
            if self.stop and self._ends_in_stop(generated[: i + 1], tokenizer):
                return i + 1, "stop"
            if i + 1 >= self.max_new_tokens:
                return i + 1, "length"
        return len(generated), None

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
