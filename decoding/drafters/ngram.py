"""STAND's logit N-gram module (STAND, section 4.1): what the target predicted after each context.

Tables for 1- to 4-gram contexts map to the target's top-10 next-token probabilities seen after
that context. A context seen again merges by running average (old weight k/(k+1), new 1/(k+1),
tokens absent from one side count as 0) and is cut back to the top 10. Lookups take the longest
matching context. Memory is bounded: each table is an LRU dictionary, and a pool holds at most
`capacity` entries in all (about 0.5 KB each in CPython: two 10-slot arrays, the key tuple, the
dictionary slot), evicting the least recently updated.

Learning is deferred to where it is read, in two stages, and a read sees exactly the tables that
merging each addition at once would have built: additions wait in a queue until the pool is next
read (`lookup`, `tables`, `size`) or the queue is long, so a pool nobody drafts from (rows the step
planner leaves undrafted, a ToT step that ends first) costs an append per committed position; the
queue is then filed under each context's entry (its LRU place updated), and an entry merges what
waits under it, in order, only when a lookup reads it: most contexts a run sees are never looked up
again (a fold merged into four tables at 28 us an addition, most of a drafted row's cost at one
problem).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter

QUEUE = 4096  # additions held before they are folded in anyway (bounds a pool's memory)
WAITING = 16  # distributions filed under one entry before it merges them anyway


@dataclass
class Entry:
    ids: array[int]  # int32 token ids, most probable first
    probs: array[float]  # float32, summing to at most 1 (mass beyond the top 10 is dropped)
    count: int  # distributions averaged into this entry
    # Distributions filed since the entry was last read, merged in order when it is (`settle`).
    waiting: list[tuple[Sequence[int], Sequence[float]]] | None = None


def merge(entry: Entry, ids: Sequence[int], probs: Sequence[float], top: int) -> Entry:
    """Running average of `entry` (the mean of entry.count distributions) and one new distribution."""
    k = entry.count
    k1 = k + 1
    mixed = {i: p * k / k1 for i, p in zip(entry.ids, entry.probs)}
    get = mixed.get
    for i, p in zip(ids, probs):
        mixed[i] = get(i, 0.0) + p / k1
    best = sorted(mixed.items(), key=itemgetter(1), reverse=True)[:top]  # stable: ties keep their order
    kept_ids, kept_probs = zip(*best)
    return Entry(array("i", kept_ids), array("f", kept_probs), k1)


class LogitNGram:
    def __init__(self, max_n: int = 4, top: int = 10, capacity: int = 200_000) -> None:
        if max_n < 1 or top < 1 or capacity < 1:
            raise ValueError("max_n, top and capacity must be positive")
        self.max_n = max_n
        self.top = top
        self.capacity = capacity
        self._tables: list[OrderedDict[tuple[int, ...], Entry]] = [OrderedDict() for _ in range(max_n)]
        self._size = 0
        self._queue: list[tuple[tuple[int, ...], Sequence[int], Sequence[float]]] = []

    @property
    def tables(self) -> list[OrderedDict[tuple[int, ...], Entry]]:
        self._fold()
        for table in self._tables:
            for entry in table.values():
                if entry.waiting:
                    self._settle(entry)
        return self._tables

    @property
    def size(self) -> int:
        self._fold()
        return self._size

    def add(self, context: Sequence[int], ids: Sequence[int], probs: Sequence[float]) -> None:
        """Record that after `context` the target gave these top next-token probabilities."""
        self._queue.append((tuple(context[-self.max_n :]), ids, probs))
        if len(self._queue) >= QUEUE:
            self._fold()

    def _fold(self) -> None:
        queue, self._queue = self._queue, []
        for context, ids, probs in queue:
            self._add(context, ids, probs)

    def _add(self, context: tuple[int, ...], ids: Sequence[int], probs: Sequence[float]) -> None:
        if len(ids) > self.top or any(probs[j] < probs[j + 1] for j in range(len(probs) - 1)):
            order = sorted(range(len(ids)), key=lambda j: -probs[j])[: self.top]
            ids, probs = [ids[j] for j in order], [probs[j] for j in order]
        for n in range(1, min(self.max_n, len(context)) + 1):
            table = self._tables[n - 1]
            key = context[-n:]
            old = table.pop(key, None)
            if old is None:
                table[key] = Entry(array("i", ids), array("f", probs), 1)
                self._size += 1
                continue
            table[key] = old
            if old.waiting is None:
                old.waiting = [(ids, probs)]
            else:
                old.waiting.append((ids, probs))
                if len(old.waiting) >= WAITING:
                    self._settle(old)
        while self._size > self.capacity:
            self._evict()

    def _settle(self, entry: Entry) -> Entry:
        """Merge what waits under `entry` into it, in the order it came."""
        waiting, entry.waiting = entry.waiting, None
        for ids, probs in waiting or ():
            merged = merge(entry, ids, probs, self.top)
            entry.ids, entry.probs, entry.count = merged.ids, merged.probs, merged.count
        return entry

    def _evict(self) -> None:
        # The longest contexts are the most numerous and the least reusable: evict from them first.
        for table in reversed(self._tables):
            if table:
                table.popitem(last=False)
                self._size -= 1
                return

    def lookup(self, context: Sequence[int]) -> Entry | None:
        """The entry of the longest stored context that `context` ends with (4-gram down to unigram)."""
        self._fold()
        for n in range(min(self.max_n, len(context)), 0, -1):
            entry = self._tables[n - 1].get(tuple(context[-n:]))
            if entry is not None:
                return self._settle(entry) if entry.waiting else entry
        return None

    def prime(self, tokens: Sequence[int], start: int = 0) -> None:
        """Let drafts copy from a text (a prompt): each of its tokens from `start` on as a certain
        next token."""
        for t in range(max(1, start), len(tokens)):
            self.add(tokens[max(0, t - self.max_n) : t], [tokens[t]], [1.0])
