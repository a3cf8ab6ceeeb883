"""The calibration recorder both draft-tree tools use (`python -m tuning.calibrate_tree`).

It drafts through another drafter that fills a static calibration shape and records, per verified
tree, what the target accepted: how often each node of the shape was on the accepted path (STAND's
data-driven pruning keeps the most accepted nodes) and, per sibling rank, how often a child was
tried and accepted (Sequoia's acceptance vector), and the time drafting took per tree level.
"""

from __future__ import annotations

import time
from collections import Counter

from decoding.drafters.base import Drafter
from decoding.speculation.draft_tree import DraftTree
from decoding.speculation.slot import Slot
from decoding.speculation.verify import Verdict
from decoding.trees.sequoia import RankCounts


class CalibrationRecorder:
    """A `Drafter` that drafts through `inner`; `rank_slots[d]` is how many children the calibration
    shape gives a node at depth d (Sequoia's rank counts need it; None: count hits only)."""

    def __init__(self, inner: Drafter, rank_slots: tuple[int, ...] | None = None) -> None:
        self.inner = inner
        self.rank_slots = rank_slots
        self.max_nodes = inner.max_nodes
        self.learns_top = inner.learns_top
        self.hits: Counter[int] = Counter()  # shape node -> times on an accepted path
        self.ranks = RankCounts()
        self.steps = 0  # verified trees
        self.draft_s = 0.0
        self.levels = 0  # draft levels over all calls (the deepest tree of a call: levels are batched)

    def admit(self, slots: list[Slot]) -> None:
        self.inner.admit(slots)

    def draft(self, slots: list[Slot]) -> list[DraftTree]:
        rooms = [slot.seq.room for slot in slots]
        t0 = time.perf_counter()
        trees = self.inner.draft(slots)
        levels = max((max(t.depths(), default=0) for t in trees), default=0)
        if levels:
            self.draft_s += time.perf_counter() - t0
            self.levels += levels
        for slot, tree, room in zip(slots, trees, rooms):
            slot.put(self, (tree, room))
        return trees

    def update(self, slots: list[Slot], verdicts: list[Verdict]) -> None:
        for slot, v in zip(slots, verdicts):
            drafted = slot.take(self)
            if drafted is None:  # a row the scheduler did not draft this step
                continue
            tree, room = drafted
            self.hits.update(tree.shape_nodes[n] for n in v.drafted_path)
            if self.rank_slots is not None:
                self.ranks.observe(tree, v.drafted_path, self.rank_slots, room)
            self.steps += 1
        self.inner.update(slots, verdicts)

    def release(self, slots: list[Slot], live: list[Slot]) -> None:
        self.inner.release(slots, live)

    def peak_cache_bytes(self) -> int:
        return self.inner.peak_cache_bytes()

    @property
    def draft_ms_per_level(self) -> float:
        return 1000 * self.draft_s / self.levels if self.levels else 0.0
