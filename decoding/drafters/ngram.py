"""STAND's logit N-gram module (STAND, section 4.1): what the target predicted after each context.

Tables for 1- to 4-gram contexts map to the target's top-10 next-token probabilities seen after
that context. A context seen again merges by running average (old weight k/(k+1), new 1/(k+1),
tokens absent from one side count as 0) and is cut back to the top 10. Lookups take the longest
matching context. Memory is bounded: each table is an LRU dictionary, and a pool holds at most
`capacity` entries in all (about 0.5 KB each in CPython: two 10-slot arrays, the key tuple, the
dictionary slot), evicting the least recently updated.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Entry:
    ids: array  # int32 token ids, most probable first
    probs: array  # float32, summing to at most 1 (mass beyond the top 10 is dropped)
    count: int  # distributions averaged into this entry


def merge(entry: Entry, ids: Sequence[int], probs: Sequence[float], top: int) -> Entry:
    """Running average of `entry` (the mean of entry.count distributions) and one new distribution."""
    k = entry.count
    mixed: dict[int, float] = {}
    for i, p in zip(entry.ids, entry.probs):
        mixed[i] = p * k / (k + 1)
    for i, p in zip(ids, probs):
        mixed[i] = mixed.get(i, 0.0) + p / (k + 1)
    best = sorted(mixed.items(), key=lambda kv: -kv[1])[:top]
    return Entry(array("i", [i for i, _ in best]), array("f", [p for _, p in best]), k + 1)


class LogitNGram:
    def __init__(self, max_n: int = 4, top: int = 10, capacity: int = 200_000) -> None:
        if max_n < 1 or top < 1 or capacity < 1:
            raise ValueError("max_n, top and capacity must be positive")
        self.max_n = max_n
        self.top = top
        self.capacity = capacity
        self.tables: list[OrderedDict[tuple[int, ...], Entry]] = [OrderedDict() for _ in range(max_n)]
        self.size = 0

    def add(self, context: Sequence[int], ids: Sequence[int], probs: Sequence[float]) -> None:
        """Record that after `context` the target gave these top next-token probabilities."""
        order = sorted(range(len(ids)), key=lambda j: -probs[j])[: self.top]
        ids = [int(ids[j]) for j in order]
        probs = [float(probs[j]) for j in order]
        for n in range(1, min(self.max_n, len(context)) + 1):
            table = self.tables[n - 1]
            key = tuple(context[-n:])
            old = table.pop(key, None)
            if old is None:
                table[key] = Entry(array("i", ids), array("f", probs), 1)
                self.size += 1
            else:
                table[key] = merge(old, ids, probs, self.top)
        while self.size > self.capacity:
            self._evict()

    def _evict(self) -> None:
        # The longest contexts are the most numerous and the least reusable: evict from them first.
        for table in reversed(self.tables):
            if table:
                table.popitem(last=False)
                self.size -= 1
                return

    def lookup(self, context: Sequence[int]) -> Entry | None:
        """The entry of the longest stored context that `context` ends with (4-gram down to unigram)."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            entry = self.tables[n - 1].get(tuple(context[-n:]))
            if entry is not None:
                return entry
        return None

    def prime(self, tokens: Sequence[int]) -> None:
        """Let drafts copy from a text (a prompt): each of its tokens as a certain next token."""
        for t in range(1, len(tokens)):
            self.add(tokens[:t][-self.max_n :], [tokens[t]], [1.0])
