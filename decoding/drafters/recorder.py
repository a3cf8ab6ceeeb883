"""The calibration recorder both draft-tree tools use (`python -m tot.calibrate_tree`).

It drafts through another drafter that fills a static calibration shape and records, per verified
tree, what the target accepted: how often each node of the shape was on the accepted path (STAND's
data-driven pruning keeps the most accepted nodes) and, per sibling rank, how often a child was
tried and accepted (Sequoia's acceptance vector), and the time drafting took per tree level.
"""

from __future__ import annotations

import time
from collections import Counter

from decoding.core.draft_tree import DraftTree
from decoding.core.sequence import Sequence
from decoding.core.verify import Verdict
from decoding.drafters.base import Drafter
from decoding.trees.sequoia import RankCounts


class CalibrationRecorder:
    """A `Drafter` that drafts through `inner`; `rank_slots[d]` is how many children the calibration
    shape gives a node at depth d (Sequoia's rank counts need it; None: count hits only)."""

    def __init__(self, inner: Drafter, rank_slots: tuple[int, ...] | None = None) -> None:
        self.inner = inner
        self.rank_slots = rank_slots
        self.max_nodes = inner.max_nodes
        self.hits: Counter[int] = Counter()  # shape node -> times on an accepted path
        self.ranks = RankCounts()
        self.steps = 0  # verified trees
        self.draft_s = 0.0
        self.levels = 0  # draft levels over all calls (the deepest tree of a call: levels are batched)
        self.trees: dict[int, tuple[DraftTree, int]] = {}
        self.seqs: dict[int, Sequence] = {}

    def admit(self, rows: list[int], seqs: list[Sequence]) -> None:
        self.seqs.update(zip(rows, seqs))
        self.inner.admit(rows, seqs)

    def draft(self, rows: list[int]) -> list[DraftTree]:
        rooms = [self.seqs[i].room for i in rows]
        t0 = time.perf_counter()
        trees = self.inner.draft(rows)
        levels = max((max(t.depths(), default=0) for t in trees), default=0)
        if levels:
            self.draft_s += time.perf_counter() - t0
            self.levels += levels
        for i, tree, room in zip(rows, trees, rooms):
            self.trees[i] = (tree, room)
        return trees

    def update(self, rows: list[int], verdicts: list[Verdict]) -> None:
        for i, v in zip(rows, verdicts):
            if i not in self.trees:  # a row the scheduler did not draft this step
                continue
            tree, room = self.trees.pop(i)
            self.hits.update(tree.shape_nodes[n] for n in v.drafted_path)
            if self.rank_slots is not None:
                self.ranks.observe(tree, v.drafted_path, self.rank_slots, room)
            self.steps += 1
        self.inner.update(rows, verdicts)

    def release(self, rows: list[int]) -> None:
        for row in rows:
            del self.seqs[row]
            self.trees.pop(row, None)
        self.inner.release(rows)

    def peak_cache_bytes(self) -> int:
        return self.inner.peak_cache_bytes()

    @property
    def draft_ms_per_level(self) -> float:
        return 1000 * self.draft_s / self.levels if self.levels else 0.0
