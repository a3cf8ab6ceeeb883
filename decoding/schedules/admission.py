"""Which waiting sequences join the live ones: as many, in order, as the KV budget holds."""

from __future__ import annotations

from decoding.runtime.kv_bytes import KVBytes, Need


def rows_that_fit(layout: KVBytes, budget: int | None, live: list[Need], waiting: list[Need]) -> int:
    """How many of `waiting` (in order) can join `live` with the pool's bytes (`layout`) inside
    `budget` (None: unbounded): one pass, since each row taken only grows the pool."""
    if budget is None:
        return len(waiting)
    tally = layout.tally(live)
    for k, n in enumerate(waiting):
        if tally.add(n) > budget:
            return k
    return len(waiting)
