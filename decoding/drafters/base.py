"""What a drafter is to the schedules: the `Drafter` protocol, and the empty drafter of `ar`."""

from __future__ import annotations

from typing import Protocol

from decoding.core.draft_tree import DraftTree
from decoding.core.sequence import Sequence
from decoding.core.verify import Verdict


class Drafter(Protocol):
    """Proposes a draft tree per live sequence and learns from what the target accepted.

    Rows are the indices of sequences in the list given to `start`; `draft` and `update` receive
    the live rows in the order of the target cache's rows, and `retain` the rows that go on.
    """

    max_nodes: int

    def start(self, seqs: list[Sequence], capacity: int) -> None: ...

    def draft(self, rows: list[int]) -> list[DraftTree]: ...

    def update(self, rows: list[int], verdicts: list[Verdict]) -> None: ...

    def retain(self, rows: list[int]) -> None: ...

    def peak_cache_bytes(self) -> int:
        """The largest KV cache the drafter's own model has held (0 for model-free drafters)."""
        ...


class NoDrafter:
    """Empty trees: plain autoregressive decoding through the same loop."""

    max_nodes = 0

    def start(self, seqs: list[Sequence], capacity: int) -> None:
        """No state: nothing to set up."""

    def draft(self, rows: list[int]) -> list[DraftTree]:
        return [DraftTree() for _ in rows]

    def update(self, rows: list[int], verdicts: list[Verdict]) -> None:
        """Nothing to learn."""

    def retain(self, rows: list[int]) -> None:
        """No per-row state to drop."""

    def peak_cache_bytes(self) -> int:
        return 0  # no model, no KV cache
