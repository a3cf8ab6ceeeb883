"""A live sequence's place in the running batch: the one record of it that the scheduler and the drafters share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from decoding.core.sequence import Sequence

T = TypeVar("T")


@dataclass(eq=False)
class Slot:
    """Owned by the scheduler from admission to release: the sequence, its row of the target's KV
    pool, the committed tokens that row's cache lacks (`pending`), and each drafter's own state for
    the row (`state`, keyed by the drafter; `own` makes it on first use). Drafters receive slots,
    so none keeps a table of rows: a released slot takes its drafters' state with it, and a reused
    row starts clean."""

    row: int
    seq: Sequence
    pending: list[int] = field(default_factory=list)
    # With ModelRunner.capture_hidden: the hidden states [S, H] of the prompt prefix its admission
    # computed or shared (an EDD drafter's soft prompt starts with them). They come with the slot:
    # a later admission, before a drafter thread hears of this one, cannot swap them.
    start_hidden: torch.Tensor | None = None
    state: dict[object, Any] = field(default_factory=dict)

    def own(self, drafter: object, new: Callable[[], T]) -> T:
        """`drafter`'s state for this slot, made by `new` the first time it asks."""
        if drafter not in self.state:
            self.state[drafter] = new()
        return self.state[drafter]
