"""What a drafter is to the schedules: the `Drafter` protocol, and the empty drafter of `ar`."""

from __future__ import annotations

from typing import Protocol

from decoding.core.draft_tree import DraftTree
from decoding.core.sequence import Sequence
from decoding.core.verify import Verdict


class Drafter(Protocol):
    """Proposes a draft tree per live sequence and learns from what the target accepted.

    Rows are the target KV pool's rows: `admit` gives sequences their rows as they join the running
    batch, `draft` and `update` receive some of the live rows, and `release` the rows whose
    sequences left (a later `admit` may reuse them).
    """

    max_nodes: int

    def admit(self, rows: list[int], seqs: list[Sequence]) -> None: ...

    def draft(self, rows: list[int]) -> list[DraftTree]: ...

    def update(self, rows: list[int], verdicts: list[Verdict]) -> None: ...

    def release(self, rows: list[int]) -> None: ...

    def peak_cache_bytes(self) -> int:
        """The largest KV cache the drafter's own model has held (0 for model-free drafters)."""
        ...


class NoDrafter:
    """Empty trees: plain autoregressive decoding through the same loop."""

    max_nodes = 0

    def admit(self, rows: list[int], seqs: list[Sequence]) -> None:
        """No state: nothing to set up."""

    def draft(self, rows: list[int]) -> list[DraftTree]:
        return [DraftTree() for _ in rows]

    def update(self, rows: list[int], verdicts: list[Verdict]) -> None:
        """Nothing to learn."""

    def release(self, rows: list[int]) -> None:
        """No per-row state to drop."""

    def peak_cache_bytes(self) -> int:
        return 0  # no model, no KV cache
