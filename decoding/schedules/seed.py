"""`decoder=seed`: SEED's rounds-scheduled speculative decoding (SEED, section 4 and Algorithm 1).

Every sequence of a call drafts with its draft model; one target verifies the drafts first come,
first served; a verified sequence goes back to drafting ("rounds") until it stops. The drafts of
all sequences waiting to draft advance together, one batched draft forward per tree level; with
`overlap` they are made in a thread beside the verifier, as SEED's parallel draft processes are.
Verification and acceptance are the shared core (decoding/core/verify.py), so output is lossless.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from decoding.core.draft_tree import DraftTree
from decoding.core.errors import ConfigError
from decoding.core.kv_cache import RowKVCache
from decoding.core.runner import ModelRunner
from decoding.core.sequence import Sequence
from decoding.core.stopping import Detokenizer
from decoding.core.values import DecodeStats
from decoding.core.verify import Verdict
from decoding.drafters.base import Drafter
from decoding.schedules.base import VerifyOptions, add_sequence_totals, begin, verify_and_commit

State = Literal["drafting", "queued", "verifying", "done"]


@dataclass(frozen=True)
class SeedOptions:
    verify_batch: int = 8  # queued drafts verified per target forward (1: the paper's schedule)
    overlap: bool = False  # draft in a thread while the target verifies

    def __post_init__(self) -> None:
        if isinstance(self.verify_batch, bool) or not isinstance(self.verify_batch, int) or self.verify_batch < 1:
            raise ConfigError(
                f"seed.verify_batch={self.verify_batch} must be a positive integer (1: the paper's schedule)"
            )


@dataclass
class _Queued:
    row: int
    tree: DraftTree
    since: float


@dataclass
class Rounds:
    """Algorithm 1's draft label map and FCFS verify queue, safe to share between two threads.

    Each sequence is in exactly one state: drafting (its draft model may run), queued (its draft
    waits for the target), verifying, or done. A sequence drafts again only after its draft has
    been verified, and the queue is served in arrival order, so none is starved.
    """

    state: list[State]
    queue: deque[_Queued] = field(default_factory=deque)
    verdicts: dict[int, Verdict] = field(default_factory=dict)  # verified, not yet seen by the drafter
    cond: threading.Condition = field(default_factory=threading.Condition)
    log: list[tuple[str, int]] = field(default_factory=list)  # (event, row), for tests

    @classmethod
    def start(cls, n: int) -> Rounds:
        return cls(state=["drafting"] * n)

    @property
    def finished(self) -> bool:
        return all(s == "done" for s in self.state)

    def take_drafting(self, wait: bool) -> tuple[list[int], dict[int, Verdict]]:
        """The rows waiting to draft and the verdicts the drafter has not seen (blocks if `wait`)."""
        with self.cond:
            while wait and not self.finished and "drafting" not in self.state and not self.verdicts:
                self.cond.wait()
            rows = [i for i, s in enumerate(self.state) if s == "drafting"]
            verdicts, self.verdicts = self.verdicts, {}
            return rows, verdicts

    def enqueue(self, rows: list[int], trees: list[DraftTree]) -> None:
        now = time.perf_counter()
        with self.cond:
            for row, tree in zip(rows, trees):
                assert self.state[row] == "drafting", f"row {row} drafted while {self.state[row]}"
                self.state[row] = "queued"
                self.queue.append(_Queued(row, tree, now))
                self.log.append(("queued", row))
            self.cond.notify_all()

    def take_queued(self, k: int, wait: bool) -> list[_Queued]:
        """Up to k drafts from the front of the queue (blocks until one is there if `wait`)."""
        with self.cond:
            while wait and not self.queue and not self.finished:
                self.cond.wait()
            batch = [self.queue.popleft() for _ in range(min(k, len(self.queue)))]
            for q in batch:
                assert self.state[q.row] == "queued"
                self.state[q.row] = "verifying"
                self.log.append(("verifying", q.row))
            return batch

    def verified(self, rows: list[int], verdicts: list[Verdict], done: list[bool]) -> None:
        with self.cond:
            for row, v, d in zip(rows, verdicts, done):
                assert self.state[row] == "verifying"
                self.state[row] = "done" if d else "drafting"
                self.verdicts[row] = v
                self.log.append(("done" if d else "drafting", row))
            self.cond.notify_all()


class SeedDecoder:
    def __init__(
        self,
        target: ModelRunner,
        tokenizer: Detokenizer,
        drafter: Drafter,
        options: SeedOptions,
        name: str = "seed",
        verify: VerifyOptions | None = None,  # None: no cap on a forward's tokens
    ) -> None:
        self.name = name
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.options = options
        self.budget = None if verify is None else verify.budget(target.device)
        self.last_rounds: Rounds | None = None

    def run(self, seqs: list[Sequence]) -> DecodeStats:
        stats = DecodeStats()
        forwards, rows = self.target.forwards, self.target.rows
        cache, pending = begin(self.target, self.drafter, seqs, stats)
        rounds = Rounds.start(len(seqs))
        self.last_rounds = rounds
        draft_stats = DecodeStats()
        failure: list[BaseException] = []
        if self.options.overlap:
            thread = threading.Thread(target=self._draft_loop, args=(rounds, draft_stats, failure), daemon=True)
            thread.start()
        while not rounds.finished:
            if not self.options.overlap:
                self._draft_once(rounds, draft_stats, wait=False)
            batch = rounds.take_queued(self.options.verify_batch, wait=self.options.overlap)
            if failure:
                raise failure[0]
            if batch:
                self._verify(batch, seqs, cache, pending, rounds, stats)
        if self.options.overlap:
            thread.join()
            if failure:
                raise failure[0]
        self._draft_once(rounds, draft_stats, wait=False)  # the last verdicts, for drafters that learn
        stats += draft_stats
        self.target.remember(cache, [s.prompt + s.generated for s in seqs])  # rows never left the cache
        stats.target_forwards += self.target.forwards - forwards
        stats.target_rows += self.target.rows - rows
        return add_sequence_totals(stats, seqs)

    def _draft_loop(self, rounds: Rounds, stats: DecodeStats, failure: list[BaseException]) -> None:
        try:
            while not rounds.finished:
                self._draft_once(rounds, stats, wait=True)
        except BaseException as e:  # surfaced in the verifying thread
            failure.append(e)
            with rounds.cond:
                rounds.state = ["done"] * len(rounds.state)
                rounds.cond.notify_all()

    def _draft_once(self, rounds: Rounds, stats: DecodeStats, wait: bool) -> None:
        rows, verdicts = rounds.take_drafting(wait)
        t0 = time.perf_counter()
        if verdicts:
            # The drafter learns what was accepted before it drafts those rows again.
            self.drafter.update(list(verdicts), list(verdicts.values()))
        if rows:
            trees = self.drafter.draft(rows)
            assert all(len(t) <= self.drafter.max_nodes for t in trees), "a tree exceeds the drafter's max_nodes"
            stats.draft_calls += 1
            stats.drafted_rows += len(rows)
        stats.draft_s += time.perf_counter() - t0
        if rows:
            rounds.enqueue(rows, trees)

    def _verify(
        self,
        batch: list[_Queued],
        seqs: list[Sequence],
        cache: RowKVCache,
        pending: list[list[int]],
        rounds: Rounds,
        stats: DecodeStats,
    ) -> None:
        t0 = time.perf_counter()
        rows = [q.row for q in batch]
        stats.queue_wait_s += sum(t0 - q.since for q in batch)
        stats.verified_drafts += len(batch)
        # Rows never leave this cache (a call's sequences keep their rows), so sequence i is row i.
        trees = [q.tree for q in batch]
        verdicts = verify_and_commit(self.target, self.tokenizer, cache, seqs, rows, rows, trees, pending, self.budget)
        t1 = time.perf_counter()
        rounds.verified(rows, verdicts, [seqs[i].done for i in rows])
        stats.verify_s += t1 - t0
        stats.other_s += time.perf_counter() - t1
