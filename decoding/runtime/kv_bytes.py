"""What a KV pool of rows takes, one class per layout: rows of their own (every row as long as the
longest prompt and the largest room need) and paged blocks (each row's own blocks, a prompt block that
siblings share counted once). Admission (decoding/schedules/admission.py) compares it with the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from decoding.runtime.paged_kv import BLOCK, blocks_for

# Positions a row needs while rows with these prompt lengths decode, `room` past each (the runner's).
RowCapacity = Callable[[list[int], int], int]


@dataclass(frozen=True)
class Need:
    """What a row of the pool must hold: its prompt, and `room` positions past it."""

    prompt: int
    room: int
    tokens: tuple[int, ...] = ()  # the prompt: paged, a block of it that other rows' prompts share counts once


class Tally(Protocol):
    """A pool's bytes as rows join it, one row at a time (each only grows it)."""

    def add(self, need: Need) -> int:
        """The pool's bytes once `need`'s row has joined the rows added before."""
        ...


class KVBytes(Protocol):
    def tally(self, rows: list[Need]) -> Tally:
        """A tally that holds `rows` already."""
        ...


T = TypeVar("T", bound=Tally)


def _holding(tally: T, rows: list[Need]) -> T:
    for n in rows:
        tally.add(n)
    return tally


def pool_bytes(layout: KVBytes, rows: list[Need]) -> int:
    """What a pool of these rows takes."""
    tally, total = layout.tally([]), 0
    for n in rows:
        total = tally.add(n)
    return total


@dataclass(frozen=True)
class RowBytes:
    """Rows of their own: each as long as the longest prompt and the largest room need (and a bucketed
    forward's spare row is one more)."""

    position_bytes: int  # keys and values of one position, all layers
    row_capacity: RowCapacity
    spare_rows: int = 0

    def tally(self, rows: list[Need]) -> _RowTally:
        return _holding(_RowTally(self), rows)


@dataclass
class _RowTally:
    layout: RowBytes
    rows: int = 0
    longest: int = 0
    room: int = 0

    def add(self, need: Need) -> int:
        self.rows, self.longest, self.room = self.rows + 1, max(self.longest, need.prompt), max(self.room, need.room)
        capacity = self.layout.row_capacity([self.longest], self.room)
        return (self.rows + self.layout.spare_rows) * capacity * self.layout.position_bytes


@dataclass(frozen=True)
class PagedBytes:
    """Paged blocks: each row's prompt blocks that no earlier row's prompt shares (siblings hold one
    copy), and its own blocks past them."""

    block_bytes: int
    row_capacity: RowCapacity

    def tally(self, rows: list[Need]) -> _PagedTally:
        return _holding(_PagedTally(self), rows)


@dataclass
class _PagedTally:
    layout: PagedBytes
    blocks: int = 0
    seen: set[tuple[int, ...]] = field(default_factory=set)  # prompt blocks counted, by the tokens to their end

    def add(self, need: Need) -> int:
        whole = (need.prompt - 1) // BLOCK  # (the prompt's last token is fed with the first step)
        fresh = whole
        if need.tokens:
            keys = {need.tokens[: (i + 1) * BLOCK] for i in range(whole)}
            fresh = len(keys - self.seen)
            self.seen |= keys
        self.blocks += fresh + blocks_for(self.layout.row_capacity([need.prompt], need.room)) - whole
        return self.blocks * self.layout.block_bytes
