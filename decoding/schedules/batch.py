"""The decode loop every token-level decoder shares: draft, verify, commit, repeat.

Decoders differ only in the pieces plugged in here: the drafter (none for `ar`, a draft model for
`sd`, N-gram pools for `stand`) and the schedule (all sequences in one batch, or one at a time).
Autoregressive decoding is the case of an empty tree: the target scores the pending token and the
"bonus" token it samples is the next token.
"""

from __future__ import annotations

import time

import torch

from decoding.core.runner import ModelRunner
from decoding.core.sequence import Sequence
from decoding.core.stopping import Detokenizer
from decoding.core.values import DecodeStats
from decoding.drafters.base import Drafter
from decoding.schedules.base import VerifyOptions, add_sequence_totals, begin, verify_and_commit


class BatchDecoder:
    """Decodes sequences by rounds of draft-then-verify until each one stops.

    serial=False: every sequence in flight shares each target forward (`ar`, `stand`).
    serial=True: one sequence at a time, as SEED's SD / MCSD baselines run.
    """

    def __init__(
        self,
        name: str,
        target: ModelRunner,
        tokenizer: Detokenizer,
        drafter: Drafter,
        serial: bool = False,
        verify: VerifyOptions | None = None,  # None: no cap on a forward's tokens
    ):
        self.name = name
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.serial = serial
        self.budget = None if verify is None else verify.budget(target.device)

    def run(self, seqs: list[Sequence]) -> DecodeStats:
        stats = DecodeStats()
        for group in [[s] for s in seqs] if self.serial else [seqs]:
            self._decode(group, stats)
        return add_sequence_totals(stats, seqs)

    def _decode(self, seqs: list[Sequence], stats: DecodeStats) -> None:
        forwards, rows = self.target.forwards, self.target.rows
        cache, pending = begin(self.target, self.drafter, seqs, stats)
        live = list(range(len(seqs)))
        # A finished row must cost nothing in later forwards: an attention that reads the verified
        # rows in place just leaves it out (cache row b stays sequence b); otherwise it leaves the
        # cache, which copies every other row.
        in_place = self.target.reads_rows_in_place
        while live:
            t0 = time.perf_counter()
            trees = self.drafter.draft(live)
            assert all(len(t) <= self.drafter.max_nodes for t in trees), "a tree exceeds the drafter's max_nodes"
            t1 = time.perf_counter()
            positions = live if in_place else list(range(len(live)))
            verdicts = verify_and_commit(
                self.target, self.tokenizer, cache, seqs, live, positions, trees, pending, self.budget
            )
            t2 = time.perf_counter()
            going = [b for b, i in enumerate(live) if not seqs[i].done]
            self.drafter.update(live, verdicts)
            if len(going) < len(live):
                if not in_place:
                    cache.select_rows(torch.tensor(going, dtype=torch.long))
                live = [live[b] for b in going]
                self.drafter.retain(live)
            t3 = time.perf_counter()
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.other_s += t3 - t2
        if in_place:  # every row still holds what it committed: later prompts may extend it
            self.target.remember(cache, [s.prompt + s.generated for s in seqs])
        stats.target_forwards += self.target.forwards - forwards
        stats.target_rows += self.target.rows - rows
