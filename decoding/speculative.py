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
        pass

    def draft(self, rows: list[int]) -> list[DraftTree]:
        return [DraftTree() for _ in rows]

    def update(self, rows: list[int], verdicts: list[Verdict]) -> None:
        pass

    def retain(self, rows: list[int]) -> None:
        pass


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
        stats.generated_tokens = sum(s.stats.generated_tokens for s in seqs)
        stats.drafted_tokens = sum(s.stats.drafted_tokens for s in seqs)
        stats.accepted_tokens = sum(s.stats.accepted_tokens for s in seqs)
        stats.verify_steps = sum(s.stats.verify_steps for s in seqs)
        return stats

    def _decode(self, seqs: list[Sequence], stats: DecodeStats) -> None:
        forwards = self.target.forwards
        t0 = time.perf_counter()
        capacity = max(len(s.prompt) + s.rule.max_new_tokens for s in seqs) + self.drafter.max_nodes + 1
        cache, pending = self.target.start([s.prompt for s in seqs], capacity)
        stats.verify_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.drafter.start(seqs, capacity)
        stats.draft_s += time.perf_counter() - t0
        live = list(range(len(seqs)))
        while live:
            t0 = time.perf_counter()
            trees = self.drafter.draft(live)
            assert all(len(t) <= self.drafter.max_nodes for t in trees), "a tree exceeds the drafter's max_nodes"
            t1 = time.perf_counter()
            packed, verdicts = verify(
                self.target,
                cache,
                [pending[i] for i in live],
                trees,
                [seqs[i].params for i in live],
                [seqs[i].generator for i in live],
            )
            t2 = time.perf_counter()
            going = []
            for b, (i, v) in enumerate(zip(live, verdicts)):
                s = seqs[i]
                v.kept = s.commit(v.tokens, self.tokenizer, drafted=len(v.tree), accepted=len(v.path))
                if not s.done:
                    cache.keep(b, packed.committed(b, v.path))
                    pending[i] = [v.token]
                    going.append(b)
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
