"""The one decode loop of every token-level decoder: continuous batching in SEED's rounds.

Sequences join the running batch between target forwards (`admit`, then each `step` gives waiting
sequences a row of the KV pool) and leave it when they stop, freeing their row for the next one
without copying any other row. Every step is a round of SEED's Algorithm 1: the rows waiting to
draft draft (one batched drafter call), their drafts join a first-come-first-served verify queue,
and up to `verify_batch` queued drafts are verified in one target forward (all of them by default:
`ar`, `stand`, ...; 8 for `seed` / `seed_stand`); a verified row goes back to drafting. With
`overlap` a thread drafts beside the verifier, as SEED's parallel draft processes do.

Autoregressive decoding is the case of an empty tree: the target scores the pending token and the
"bonus" token it samples is the next token. Verification and acceptance are the core's
(decoding/core/verify.py), so every schedule is lossless.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from decoding.core.cost import Overhead, forward_cost, node_ms
from decoding.core.draft_tree import DraftTree
from decoding.core.errors import BackendError
from decoding.core.models import cache_root
from decoding.core.runner import ModelRunner
from decoding.core.sequence import Sequence
from decoding.core.slot import Slot
from decoding.core.stopping import Detokenizer
from decoding.core.values import DecodeStats
from decoding.core.verify import Verdict
from decoding.drafters.base import Drafter
from decoding.schedules.base import VerifyOptions, cut_to_budget, run_to_end, verify_and_commit
from decoding.schedules.planner import Planner

log = logging.getLogger(__name__)

State = Literal["drafting", "queued", "verifying"]


@dataclass
class _Queued:
    row: int
    tree: DraftTree
    since: float


@dataclass
class Rounds:
    """Algorithm 1's draft label map and FCFS verify queue, safe to share between two threads.

    Each live row is in exactly one state: drafting (the drafter may draft it), queued (its draft
    waits for the target), or verifying. A row drafts again only after its draft was verified, and
    the queue is served in arrival order, so none is starved. The drafter hears of rows that
    arrived, verdicts and rows that left when it next drafts (in its own thread with `overlap`);
    a left row is free for a new sequence once the drafter has let it go.
    """

    state: dict[int, State] = field(default_factory=dict)
    queue: deque[_Queued] = field(default_factory=deque)
    arrivals: list[int] = field(default_factory=list)  # admitted rows the drafter has not seen
    verdicts: dict[int, Verdict] = field(default_factory=dict)  # verified, not yet seen by the drafter
    gone: list[int] = field(default_factory=list)  # rows that left, not yet released by the drafter
    free: list[int] = field(default_factory=list)  # a heap: rows to admit into, lowest first
    size: int = 0  # rows the pool has handed out so far
    cond: threading.Condition = field(default_factory=threading.Condition)
    log: list[tuple[str, int]] = field(default_factory=list)  # (event, row), for tests

    @property
    def finished(self) -> bool:
        """No live row and nothing left for the drafter to hear."""
        return not (self.state or self.arrivals or self.verdicts or self.gone)

    def take_row(self) -> int:
        with self.cond:
            if self.free:
                return heapq.heappop(self.free)
            self.size += 1
            return self.size - 1

    def arrive(self, rows: list[int]) -> None:
        with self.cond:
            for row in rows:
                self.state[row] = "drafting"
                self.log.append(("admitted", row))
            self.arrivals.extend(rows)
            self.cond.notify_all()

    def take_drafting(self, wait: bool) -> tuple[list[int], list[int], dict[int, Verdict], list[int]]:
        """(arrived rows, rows to draft, verdicts, left rows) the drafter has not seen; blocks
        until there is something if `wait`."""
        with self.cond:
            while wait and not self.finished and not self._for_drafter():
                self.cond.wait()
            arrivals, verdicts, gone = self.arrivals, self.verdicts, self.gone
            self.arrivals, self.verdicts, self.gone = [], {}, []
            rows = [r for r, s in self.state.items() if s == "drafting"]
            return arrivals, rows, verdicts, gone

    def _for_drafter(self) -> bool:
        return bool(self.arrivals or self.verdicts or self.gone) or "drafting" in self.state.values()

    def enqueue(self, rows: list[int], trees: list[DraftTree]) -> None:
        now = time.perf_counter()
        with self.cond:
            for row, tree in zip(rows, trees):
                assert self.state[row] == "drafting", f"row {row} drafted while {self.state[row]}"
                self.state[row] = "queued"
                self.queue.append(_Queued(row, tree, now))
                self.log.append(("queued", row))
            self.cond.notify_all()

    def take_queued(self, k: int | None, wait: bool) -> list[_Queued]:
        """Up to k drafts (None: all) from the front of the queue (blocks until one is there if `wait`)."""
        with self.cond:
            while wait and not self.queue and self.state:
                self.cond.wait()
            n = len(self.queue) if k is None else min(k, len(self.queue))
            batch = [self.queue.popleft() for _ in range(n)]
            for q in batch:
                assert self.state[q.row] == "queued"
                self.state[q.row] = "verifying"
                self.log.append(("verifying", q.row))
            return batch

    def verified(self, rows: list[int], verdicts: list[Verdict], done: list[bool]) -> None:
        with self.cond:
            for row, v, d in zip(rows, verdicts, done):
                assert self.state[row] == "verifying"
                self.verdicts[row] = v
                if d:
                    del self.state[row]
                    self.gone.append(row)
                else:
                    self.state[row] = "drafting"
                self.log.append(("done" if d else "drafting", row))
            self.cond.notify_all()

    def released(self, rows: list[int]) -> None:
        with self.cond:
            for row in rows:
                heapq.heappush(self.free, row)

    def trim(self) -> int:
        """Drop the free rows at the top of the pool's numbering (rows are handed out lowest first,
        so live rows gather at the bottom); the rows still handed out."""
        with self.cond:
            free = set(self.free)
            while self.size - 1 in free:
                self.size -= 1
                free.discard(self.size)
            if len(free) < len(self.free):
                self.free = sorted(free)  # a sorted list is a heap
            return self.size

    def fail(self) -> None:
        """Wake and stop everyone: the drafter thread failed."""
        with self.cond:
            self.state.clear()
            self.queue.clear()
            self.arrivals, self.verdicts, self.gone = [], {}, []
            self.cond.notify_all()


class Scheduler:
    """Decodes sequences that come and go, in rounds of draft-then-verify.

    verify_batch: queued drafts verified per target forward (None: all of them).
    overlap: draft in a thread while the target verifies.
    max_live: sequences decoding at once (1: one at a time, as SEED's SD / MCSD baselines run).
    """

    def __init__(
        self,
        name: str,
        target: ModelRunner,
        tokenizer: Detokenizer,
        drafter: Drafter,
        verify_batch: int | None = None,
        overlap: bool = False,
        max_live: int | None = None,
        verify: VerifyOptions | None = None,  # None: the product default (the config's), VerifyOptions()
        planner: Planner | None = None,  # plan=goodput: one is built on the target's measured costs if None
    ) -> None:
        self.name = name
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.verify_batch = verify_batch
        self.overlap = overlap
        self.max_live = max_live
        verify = (verify or VerifyOptions()).for_decoder(name)
        self.budget = verify.budget(target.device)
        self.rule = verify.rule
        if verify.plan == "goodput" and planner is None and drafter.max_nodes:
            overhead = Overhead(node_ms=node_ms(target))
            planner = Planner(forward_cost(target, cache_root(), verify.cost), overhead=overhead)
        self.planner = planner if verify.plan == "goodput" else None
        self.cache = target.new_cache(0, 1, graphs=True)  # the KV pool: row r holds the sequence of slots[r]
        self.slots: dict[int, Slot] = {}  # row -> the live sequence there (decoding/core/slot.py)
        self.waiting: deque[Sequence] = deque()
        self.rounds = Rounds()
        self.stats = DecodeStats()  # running totals over every step (tokens are counted per call)
        self._thread: threading.Thread | None = None
        self._thread_running = False
        self._drafter_slots: dict[int, Slot] = {}  # slots the drafter has heard of and not yet released
        self._failure: list[BaseException] = []
        self._held: set[int] = set()  # ids of the sequences counted as waiting for KV memory

    @property
    def busy(self) -> bool:
        return bool(self.slots or self.waiting)

    @property
    def live(self) -> int:
        return len(self.slots)

    def admit(self, seqs: list[Sequence]) -> None:
        """Queue sequences: they take rows at the start of the next step."""
        self.waiting.extend(seqs)

    def run(self, seqs: list[Sequence]) -> DecodeStats:
        return run_to_end(self, seqs)

    def clear(self) -> None:
        """Drop every queued and live sequence (their callers are gone: an error or a cancel), so
        that the next call starts on a clean batch; what the drafter learned stays."""
        self.rounds.fail()  # wakes a drafting thread, which then ends
        if self._thread is not None:
            self._thread.join()
            self._thread, self._thread_running = None, False
        self.drafter.release([self._drafter_slots[r] for r in sorted(self._drafter_slots)])
        self._drafter_slots.clear()
        self._held.clear()
        self.slots.clear()
        self.waiting.clear()
        self.rounds = Rounds()
        self._failure.clear()

    def step(self) -> list[Sequence]:
        """Admit waiting sequences, draft, verify one batch of queued drafts; the sequences that stopped."""
        forwards, rows = self.target.forwards, self.target.rows
        self._fill()
        finished: list[Sequence] = []
        if self.overlap:
            self._ensure_drafting_thread()
        else:
            self._draft_once(wait=False)
        batch = self.rounds.take_queued(self.verify_batch, wait=self.overlap)
        if self._failure:
            raise self._failure[0]
        if batch:
            finished = self._verify(batch)
        if not self.overlap:
            self._draft_once(wait=False, draft=False)  # the verdicts, for drafters that learn; free rows
        elif not self.busy and self._thread is not None:
            self._thread.join()  # it ends once the drafter has heard everything
            self._thread = None
            if self._failure:
                raise self._failure[0]
        # Memory back once the pool holds far more than its live rows need (a burst of rows gone).
        live = [s.seq for s in self.slots.values()]
        self.target.give_back(self.cache, self.rounds.trim(), live, self.drafter.max_nodes)
        self.stats.target_forwards += self.target.forwards - forwards
        self.stats.target_rows += self.target.rows - rows
        return finished

    def _fill(self) -> None:
        room = len(self.waiting) if self.max_live is None else self.max_live - len(self.slots)
        wanted = list(self.waiting)[: max(0, room)]
        fit = self.target.rows_that_fit([s.seq for s in self.slots.values()], wanted, self.drafter.max_nodes)
        if fit < len(wanted):
            self._hold_for_memory(wanted[fit:], alone=not self.slots and not fit)
        new = [self.waiting.popleft() for _ in range(fit)]
        self._held.difference_update(id(s) for s in new)
        if not new:
            return
        t0 = time.perf_counter()
        rows = [self.rounds.take_row() for _ in new]
        computed = self.target.prompt_tokens_computed
        admitted = self.target.admit_seqs(self.cache, rows, new, self.drafter.max_nodes)
        for s, n in zip(new, admitted.computed):
            s.stats.prompt_tokens_computed += n
        for s in new:
            if s.follows:  # its context served it: evictable again
                self.target.prefixes.unpin(s.follows)
        self.stats.prompt_tokens += sum(len(s.prompt) for s in new)
        self.stats.prompt_tokens_computed += self.target.prompt_tokens_computed - computed
        for row, seq, pending in zip(rows, new, admitted.pending):
            self.slots[row] = Slot(row, seq, pending, self.target.start_hidden)
        if self.planner is not None:
            self.planner.forget(rows)
        self.rounds.arrive(rows)
        self.stats.verify_s += time.perf_counter() - t0

    def _hold_for_memory(self, held: list[Sequence], alone: bool) -> None:
        """Sequences the KV pool has no memory for wait until live ones finish; one that does not
        fit `alone` never will: a configuration error."""
        budget = self.target.kv_budget or 0
        if alone:
            need = self.target.kv_bytes(held[:1], self.drafter.max_nodes)
            raise BackendError(
                f"one sequence needs {need / 2**20:.3g} MB of KV cache (its prompt, gen.max_new_tokens and a draft "
                f"tree), model.kv_memory allows {budget / 2**20:.3g} MB: raise model.kv_memory or model.kv_memory_mb, "
                "or lower gen.max_new_tokens"
            )
        first = [s for s in held if id(s) not in self._held]
        if first and not self._held:
            log.warning("%d sequences wait for KV memory (model.kv_memory allows %.3g MB)", len(held), budget / 2**20)
        self._held.update(id(s) for s in first)
        self.stats.kv_waits += len(first)

    def _ensure_drafting_thread(self) -> None:
        # The thread ends once the drafter has heard everything and no row is live; it decides so
        # under the rounds' lock, so rows admitted before this check are never left undrafted.
        with self.rounds.cond:
            if self._thread is not None and self._thread_running:
                return
            self._thread_running = True
        if self._thread is not None:
            self._thread.join()
        self._thread = threading.Thread(target=self._draft_loop, daemon=True)
        self._thread.start()

    def _draft_loop(self) -> None:
        try:
            while True:
                self._draft_once(wait=True)
                with self.rounds.cond:
                    if self.rounds.finished:
                        self._thread_running = False
                        return
        except BaseException as e:  # surfaced in the verifying thread
            self._failure.append(e)
            with self.rounds.cond:
                self._thread_running = False
            self.rounds.fail()

    def _draft_once(self, wait: bool, draft: bool = True) -> None:
        arrivals, rows, verdicts, gone = self.rounds.take_drafting(wait)
        if not draft:
            rows = []
        t0 = time.perf_counter()
        if arrivals:
            slots = [self.slots[r] for r in arrivals]
            self.drafter.admit(slots)
            self._drafter_slots.update(zip(arrivals, slots))
        if verdicts:
            # The drafter learns what was accepted before it drafts those rows again.
            self.drafter.update([self._drafter_slots[r] for r in verdicts], list(verdicts.values()))
        if gone:
            self.drafter.release([self._drafter_slots.pop(r) for r in gone])
            self.rounds.released(gone)
        if rows:
            trees = self._draft(rows)
        self.stats.draft_s += time.perf_counter() - t0
        if rows:
            self.rounds.enqueue(rows, trees)

    def _draft(self, rows: list[int]) -> list[DraftTree]:
        """Trees for `rows`; with the planner, rows whose drafts cannot pay are not drafted (empty
        trees: verified like `ar`'s rows, and their drafter still learns from what they commit)."""
        drafting = rows
        if self.planner is not None and self.drafter.max_nodes:
            budgets = self.planner.budgets(rows, self.drafter.max_nodes)
            drafting = [r for r, b in zip(rows, budgets) if b]
        t0 = time.perf_counter()
        slots = [self.slots[r] for r in drafting]
        drafted = dict(zip(drafting, self.drafter.draft(slots))) if drafting else {}
        trees = [drafted.get(r, DraftTree()) for r in rows]
        assert all(len(t) <= self.drafter.max_nodes for t in trees), "a tree exceeds the drafter's max_nodes"
        if drafting:
            self.stats.draft_calls += 1
            self.stats.drafted_rows += len(drafting)
            if self.planner is not None:
                self.planner.drafted(len(drafting), 1000 * (time.perf_counter() - t0))
        return trees

    def _context(self, rows: list[int]) -> float:
        """Mean committed length of the rows (what a forward's attention reads)."""
        return sum(int(self.cache.lens[r]) for r in rows) / len(rows)

    def _verify(self, batch: list[_Queued]) -> list[Sequence]:
        t0 = time.perf_counter()
        rows = [q.row for q in batch]
        self.stats.queue_wait_s += sum(t0 - q.since for q in batch)
        self.stats.verified_drafts += len(batch)
        trees = [q.tree for q in batch]
        slots = [self.slots[r] for r in rows]
        greedy = [s.seq.params.greedy for s in slots]
        plan = None
        if self.planner is not None:
            pending_len = [len(s.pending) for s in slots]
            trees, plan = self.planner.cut(rows, trees, greedy, pending_len, self._context(rows))
        else:
            trees = cut_to_budget(trees, self.budget)
        verdicts = verify_and_commit(
            self.target, self.tokenizer, self.cache, slots, trees, self.rule, self.drafter.learns_top
        )
        t1 = time.perf_counter()
        if plan is not None:
            for v, kept in zip(verdicts, plan.kept_nodes):
                v.drafted_nodes = kept
            forward_ms = self.target.last_score_ms
            self.planner.observe(plan, verdicts, greedy, forward_ms, 1000 * (t1 - t0) - forward_ms)
            self.stats.planned_rows += plan.rows
            self.stats.planned_nodes += sum(plan.nodes)
            self.stats.predicted_step_s += plan.predicted_ms / 1000
            self.stats.planned_step_s += t1 - t0
        finished = []
        for slot in slots:
            s = slot.seq
            if s.done:
                # What it committed stays for later prompts that extend it (the next step's thoughts).
                pin = s.context(self.tokenizer) if s.keep else None
                self.target.remember(self.cache, slot.row, s.prompt + s.generated, pin)
                finished.append(s)
                del self.slots[slot.row]
        self.rounds.verified(rows, verdicts, [s.seq.done for s in slots])
        self.stats.verify_s += t1 - t0
        self.stats.other_s += time.perf_counter() - t1
        return finished
