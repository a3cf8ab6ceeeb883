"""What a drafter is to the schedules: the `Drafter` protocol, and the empty drafter of `ar`."""

from __future__ import annotations

from typing import Protocol

from decoding.drafters.plugin import BuildConfig
from decoding.speculation.draft_tree import DraftTree
from decoding.speculation.slot import Slot
from decoding.speculation.verify import Verdict


class Drafter(Protocol):
    """Proposes a draft tree per live sequence and learns from what the target accepted.

    The scheduler owns a `Slot` per live sequence (its row of the target's KV pool, its pending
    tokens, each drafter's state for it): `admit` hears of slots as their sequences join the running
    batch, `draft` and `update` receive some of the live slots, and `release` the slots whose
    sequences left (their rows may be admitted again). A drafter keeps what it learns across
    sequences (pools, tables) itself, and what it keeps per sequence in `Slot.own`.
    """

    max_nodes: int
    # The top-k of the target's distributions along each accepted path that `update` reads
    # (`Verdict.top`, computed beside the sampling), 0 where it reads none.
    learns_top: int

    def admit(self, slots: list[Slot]) -> None: ...

    def draft(self, slots: list[Slot]) -> list[DraftTree]: ...

    def update(self, slots: list[Slot], verdicts: list[Verdict]) -> None: ...

    def release(self, slots: list[Slot], live: list[Slot]) -> None:
        """The slots whose sequences left; `live`: the slots still live that it has admitted (what
        memory it gives back must keep)."""
        ...

    def peak_cache_bytes(self) -> int:
        """The largest KV cache the drafter's own model has held (0 for model-free drafters)."""
        ...


class NoDrafter:
    """Empty trees: plain autoregressive decoding through the same loop."""

    max_nodes = 0
    learns_top = 0

    def admit(self, slots: list[Slot]) -> None:
        """No state: nothing to set up."""

    def draft(self, slots: list[Slot]) -> list[DraftTree]:
        return [DraftTree() for _ in slots]

    def update(self, slots: list[Slot], verdicts: list[Verdict]) -> None:
        """Nothing to learn."""

    def release(self, slots: list[Slot], live: list[Slot]) -> None:
        """No per-row state to drop."""

    def peak_cache_bytes(self) -> int:
        return 0  # no model, no KV cache


def build(config: BuildConfig, *_: object) -> NoDrafter:
    """`none`'s drafter (decoding/drafters/builtin.py declares it)."""
    return NoDrafter()
