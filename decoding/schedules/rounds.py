"""SEED's rounds (Algorithm 1): the live slots, their FCFS verify queue and the pool's free rows.

Each live slot is in one phase: drafting (the drafter may draft it), queued (its draft waits for the
target), or verifying. A slot drafts again only after its draft was verified, and the queue is
served in arrival order, so none is starved. The drafter hears of slots that arrived, verdicts and
slots that left when it next drafts (in its own thread with `seed.overlap`, hence the lock); a left
slot's row is free for a new sequence once the drafter has let it go. Without the thread the lock
is `Unlocked`.
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from dataclasses import dataclass, field

from decoding.schedules.options import RoundsOptions as RoundsOptions  # its home is the options' module
from decoding.speculation.draft_tree import DraftTree
from decoding.speculation.row_sampling import SamplingTable
from decoding.speculation.slot import Slot
from decoding.speculation.verify import Verdict

LOG_EVENTS = 100_000


@dataclass
class News:
    """What the drafter has not heard yet, taken at once."""

    arrived: list[Slot]  # admitted: the drafter admits them
    verified: list[Slot]  # their `verdict` is new: the drafter learns from it
    left: list[Slot]  # done: the drafter releases them
    drafting: list[Slot]  # the slots waiting to be drafted
    live: list[Slot]  # every live slot (what a drafter's memory must keep once others left)


class Unlocked:
    """The rounds' lock where one thread alone drafts and verifies (no `seed.overlap`): the default
    step carries no locking."""

    def __enter__(self) -> Unlocked:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def notify_all(self) -> None:
        return None

    def wait(self) -> None:
        raise RuntimeError("the rounds wait only for a drafting thread (seed.overlap)")


@dataclass
class Rounds:
    live: dict[int, Slot] = field(default_factory=dict)  # row -> its slot, for every live sequence
    queue: deque[Slot] = field(default_factory=deque)
    arrived: list[Slot] = field(default_factory=list)  # not yet heard of by the drafter
    verified: list[Slot] = field(default_factory=list)
    left: list[Slot] = field(default_factory=list)
    free: list[int] = field(default_factory=list)  # a heap: rows to admit into, lowest first
    size: int = 0  # rows the pool has handed out so far
    freed: bool = False  # rows released since the last `trim`: only then may memory go back
    sampling: SamplingTable = field(default_factory=SamplingTable)  # each row's settings, copied at admission
    cond: threading.Condition | Unlocked = field(default_factory=threading.Condition)
    # (event, row), for tests: the latest LOG_EVENTS to LOG_EVENTS * 2 of them (a whole log would grow
    # by a few entries a token for as long as the engine lives).
    log: list[tuple[str, int]] = field(default_factory=list)

    def _note(self, event: tuple[str, int]) -> None:
        self.log.append(event)
        if len(self.log) > 2 * LOG_EVENTS:
            del self.log[:-LOG_EVENTS]

    @property
    def finished(self) -> bool:
        """No live slot and nothing left for the drafter to hear."""
        return not (self.live or self.arrived or self.verified or self.left)

    def take_row(self) -> int:
        with self.cond:
            if self.free:
                return heapq.heappop(self.free)
            self.size += 1
            return self.size - 1

    def arrive(self, slots: list[Slot]) -> None:
        with self.cond:
            self.sampling.admit([s.row for s in slots], [s.seq for s in slots])
            for slot in slots:
                slot.phase = "drafting"
                self.live[slot.row] = slot
                self._note(("admitted", slot.row))
            self.arrived.extend(slots)
            self.cond.notify_all()

    def news(self, wait: bool) -> News:
        """What the drafter has not heard, and the slots to draft; blocks until there is some if `wait`."""
        with self.cond:
            while wait and not self.finished and not self._for_drafter():
                self.cond.wait()
            live = list(self.live.values())
            news = News(self.arrived, self.verified, self.left, [s for s in live if s.phase == "drafting"], live)
            self.arrived, self.verified, self.left = [], [], []
            return news

    def _for_drafter(self) -> bool:
        return bool(self.arrived or self.verified or self.left) or any(
            s.phase == "drafting" for s in self.live.values()
        )

    def enqueue(self, slots: list[Slot], trees: list[DraftTree], now: float) -> None:
        with self.cond:
            for slot, tree in zip(slots, trees):
                assert slot.phase == "drafting", f"row {slot.row} drafted while {slot.phase}"
                slot.phase, slot.draft, slot.queued_at = "queued", tree, now
                self.queue.append(slot)
                self._note(("queued", slot.row))
            self.cond.notify_all()

    def take_queued(self, k: int | None, wait: bool) -> list[Slot]:
        """Up to k queued slots (None: all) from the front (blocks until one is there if `wait`)."""
        with self.cond:
            while wait and not self.queue and self.live:
                self.cond.wait()
            n = len(self.queue) if k is None else min(k, len(self.queue))
            batch = [self.queue.popleft() for _ in range(n)]
            for slot in batch:
                assert slot.phase == "queued"
                slot.phase = "verifying"
                self._note(("verifying", slot.row))
            return batch

    def verified_now(self, slots: list[Slot], verdicts: list[Verdict]) -> None:
        """The verdicts are in: done slots leave, the others draft again."""
        with self.cond:
            for slot, v in zip(slots, verdicts):
                assert slot.phase == "verifying"
                slot.verdict, slot.draft = v, None
                self.verified.append(slot)
                if slot.seq.done:
                    del self.live[slot.row]
                    self.left.append(slot)
                else:
                    slot.phase = "drafting"
                self._note(("done" if slot.seq.done else "drafting", slot.row))
            self.cond.notify_all()

    def released(self, slots: list[Slot]) -> None:
        with self.cond:
            for slot in slots:
                heapq.heappush(self.free, slot.row)
            self.freed = self.freed or bool(slots)

    def trim(self) -> int:
        """Drop the free rows at the top of the pool's numbering (rows are handed out lowest first,
        so live rows gather at the bottom); the rows still handed out."""
        with self.cond:
            self.freed = False
            free = set(self.free)
            while self.size - 1 in free:
                self.size -= 1
                free.discard(self.size)
            if len(free) < len(self.free):
                self.free = sorted(free)  # a sorted list is a heap
            return self.size

    def fail(self) -> None:
        """Wake and stop everyone: the drafter thread failed (or the batch is dropped)."""
        with self.cond:
            self.live.clear()
            self.queue.clear()
            self.arrived, self.verified, self.left = [], [], []
            self.cond.notify_all()
