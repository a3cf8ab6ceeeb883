"""The decode loop every token-level decoder shares: draft, verify, commit, repeat.

Decoders differ only in the pieces plugged in here: the drafter (none for `ar`, a draft model for
`sd`, N-gram pools later) and the schedule (all sequences in one batch, or one at a time).
Autoregressive decoding is the case of an empty tree: the target scores the pending token and the
"bonus" token it samples is the next token.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from decoding.draft_tree import DraftTree
from decoding.kv_cache import RowKVCache
from decoding.sequence import Sequence
from decoding.stopping import Detokenizer
from decoding.target import Target
from decoding.types import DecodeStats
from decoding.verify import Verdict, verify


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


def begin(
    target: Target, drafter: Drafter, seqs: list[Sequence], stats: DecodeStats
) -> tuple[RowKVCache, list[list[int]]]:
    """Caches for a set of sequences (the target's, the drafter's) and each one's pending tokens."""
    t0 = time.perf_counter()
    capacity = max(len(s.prompt) + s.rule.max_new_tokens for s in seqs) + drafter.max_nodes + 1
    cache, pending = target.start([s.prompt for s in seqs], capacity)
    stats.verify_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    drafter.start(seqs, capacity)
    stats.draft_s += time.perf_counter() - t0
    return cache, pending


def verify_and_commit(
    target: Target,
    tokenizer: Detokenizer,
    cache: RowKVCache,
    seqs: list[Sequence],
    rows: list[int],
    cache_rows: list[int],
    trees: list[DraftTree],
    pending: list[list[int]],
) -> list[Verdict]:
    """Verify the trees of sequences `rows` (held in cache rows `cache_rows`) in one forward and
    commit what each accepted: tokens to the sequence, the accepted path to the cache."""
    packed, verdicts = verify(
        target,
        cache,
        [pending[i] for i in rows],
        trees,
        [seqs[i].params for i in rows],
        [seqs[i].generator for i in rows],
        rows=None if cache_rows == list(range(cache.batch)) else cache_rows,
    )
    for b, (i, pos, v) in enumerate(zip(rows, cache_rows, verdicts)):
        s = seqs[i]
        v.kept = s.commit(v.tokens, tokenizer, drafted=len(v.tree), accepted=len(v.path))
        if not s.done:
            cache.keep(pos, packed.committed(b, v.path))
            pending[i] = [v.token]
    return verdicts


def add_sequence_totals(stats: DecodeStats, seqs: list[Sequence]) -> DecodeStats:
    """A call's token counts are its sequences' (the time and forward counts are the call's own)."""
    stats.generated_tokens = sum(s.stats.generated_tokens for s in seqs)
    stats.drafted_tokens = sum(s.stats.drafted_tokens for s in seqs)
    stats.accepted_tokens = sum(s.stats.accepted_tokens for s in seqs)
    stats.verify_steps = sum(s.stats.verify_steps for s in seqs)
    return stats


class SpecDecoder:
    """Decodes sequences by rounds of draft-then-verify until each one stops.

    serial=False: every sequence in flight shares each target forward (`ar`, `stand`).
    serial=True: one sequence at a time, as SEED's SD / MCSD baselines run.
    """

    def __init__(self, name: str, target: Target, tokenizer: Detokenizer, drafter: Drafter, serial: bool = False):
        self.name = name
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.serial = serial

    def run(self, seqs: list[Sequence]) -> DecodeStats:
        stats = DecodeStats()
        for group in [[s] for s in seqs] if self.serial else [seqs]:
            self._decode(group, stats)
        return add_sequence_totals(stats, seqs)

    def _decode(self, seqs: list[Sequence], stats: DecodeStats) -> None:
        forwards = self.target.forwards
        cache, pending = begin(self.target, self.drafter, seqs, stats)
        live = list(range(len(seqs)))
        while live:
            t0 = time.perf_counter()
            trees = self.drafter.draft(live)
            assert all(len(t) <= self.drafter.max_nodes for t in trees), "a tree exceeds the drafter's max_nodes"
            t1 = time.perf_counter()
            positions = list(range(len(live)))  # finished rows leave the cache, so row b is live[b]
            verdicts = verify_and_commit(self.target, self.tokenizer, cache, seqs, live, positions, trees, pending)
            t2 = time.perf_counter()
            going = [b for b, i in enumerate(live) if not seqs[i].done]
            self.drafter.update(live, verdicts)
            if len(going) < len(live):
                # A finished row leaves the batch so it costs nothing in later forwards.
                cache.select_rows(torch.tensor(going, dtype=torch.long))
                live = [live[b] for b in going]
                self.drafter.retain(live)
            t3 = time.perf_counter()
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.other_s += t3 - t2
        stats.target_forwards += self.target.forwards - forwards
