"""A live sequence's place in the running batch: the one record of everything per row.

The scheduler, the step planner and the drafters keep no table of rows: whatever they know of a
row lives in its slot, so releasing the slot forgets the row everywhere, and a reused row starts clean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from decoding.speculation.draft_tree import DraftTree
from decoding.speculation.sequence import Sequence

if TYPE_CHECKING:
    from decoding.runtime.kv_cache import KVCache
    from decoding.speculation.verify import Verdict

T = TypeVar("T")

# SEED's rounds: a row drafts, its draft waits in the verify queue, the target verifies it, and the
# row drafts again; exactly one of these at a time, so no row is drafted twice before a verdict.
Phase = Literal["drafting", "queued", "verifying"]


@dataclass
class Estimate:
    """What the step planner knows of one row (decoding/schedules/planner.py)."""

    worth: float | None = None  # what its kept nodes were worth lately, in tokens (None: not drafted yet)
    idle: int = 0  # steps since it was last drafted


@dataclass(eq=False)
class Slot:
    """Owned by the scheduler from admission to release."""

    row: int  # its row of the target's KV pool
    seq: Sequence
    pending: list[int] = field(default_factory=list)  # committed tokens the row's cache lacks
    # With ModelRunner.capture_hidden: the hidden states [S, H] of the prompt prefix its admission
    # computed or shared (an EDD drafter's soft prompt starts with them). They come with the slot:
    # a later admission, before a drafter thread hears of this one, cannot swap them.
    start_hidden: torch.Tensor | None = None
    cache: KVCache | None = None  # the pool `row` is a row of
    phase: Phase = "drafting"
    draft: DraftTree | None = None  # while queued: the tree waiting for the target
    queued_at: float = 0.0  # when it was queued (the queue wait the statistics report)
    verdict: Verdict | None = None  # its latest verdict, until the drafter has heard it
    heard: bool = False  # the drafter has admitted it (and must release it)
    estimate: Estimate = field(default_factory=Estimate)
    _drafters: dict[object, Any] = field(default_factory=dict)  # each drafter's own state for the row

    @property
    def committed(self) -> int:
        """Tokens in the row's cache: a view of the pool's lengths, never a copy."""
        assert self.cache is not None, "a slot outside a pool has no cache row"
        return int(self.cache.lens[self.row])

    def own(self, drafter: object, new: Callable[[], T]) -> T:
        """`drafter`'s state for this slot, made by `new` the first time it asks."""
        if drafter not in self._drafters:
            self._drafters[drafter] = new()
        state: T = self._drafters[drafter]
        return state

    def state(self, drafter: object) -> Any:
        """`drafter`'s state for this slot (set by `put` or `own`)."""
        return self._drafters[drafter]

    def put(self, drafter: object, value: Any) -> None:
        self._drafters[drafter] = value

    def take(self, drafter: object) -> Any:
        """`drafter`'s state, removed (None if it had none)."""
        return self._drafters.pop(drafter, None)

    def holds(self, drafter: object) -> bool:
        return drafter in self._drafters
