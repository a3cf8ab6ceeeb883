"""The one decode loop of every token-level decoder: continuous batching in SEED's rounds.

Sequences join the running batch between target forwards (`admit`, then each `step` gives waiting
sequences a row of the KV pool) and leave it when they stop, freeing their row for the next one
without copying any other row. Every step is a round of SEED's Algorithm 1
(decoding/schedules/step.py): the slots waiting to draft draft (one batched drafter call), their
drafts join a first-come-first-served verify queue (decoding/schedules/rounds.py), and up to
`verify_batch` queued drafts are verified in one target forward (all of them by default: `ar`,
`stand`, ...; 8 for `seed` / `seed_stand`); a verified slot goes back to drafting. With `overlap` a
thread drafts beside the verifier, as SEED's parallel draft processes do. The scheduler admits,
runs the step, and hands its record to the observers (the statistics, the planner).

Autoregressive decoding is the case of an empty tree: the target scores the pending token and the
"bonus" token it samples is the next token. Verification and acceptance are the core's
(decoding/speculation/verify.py), so every schedule is lossless.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import replace

from decoding.base.errors import BackendError
from decoding.base.values import DecodeStats
from decoding.drafters.base import Drafter
from decoding.runtime.kv_bytes import pool_bytes
from decoding.runtime.kv_cache import KVCache
from decoding.runtime.runner import ModelRunner
from decoding.schedules.admission import rows_that_fit
from decoding.schedules.base import Step, run_to_end
from decoding.schedules.planner import Planner
from decoding.schedules.rounds import Rounds, Unlocked
from decoding.schedules.step import DraftRecord, Laps, StepRecord, StepSetup, decode_step, draft_round
from decoding.speculation.options import VerifyOptions
from decoding.speculation.sequence import Sequence, admission_room, needs, widest_need
from decoding.speculation.slot import Slot
from decoding.speculation.stopping import Detokenizer

log = logging.getLogger(__name__)


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
        planner: Planner | None = None,  # verify.plan=goodput: the step planner (`goodput_planner`)
    ) -> None:
        self.name = name
        self.target = target
        self.overlap = overlap
        self.max_live = max_live
        verify = (verify or VerifyOptions()).for_decoder(name)
        # The planner comes built (its cost profile measures the machine): a schedule only runs it.
        if verify.plan == "goodput" and planner is None and drafter.max_nodes:
            raise ValueError(f"{name}: verify.plan=goodput with a drafter needs a planner (goodput_planner)")
        self.setup = StepSetup(
            target,
            target.new_cache(0, 1, graphs=True),
            tokenizer,
            drafter,
            planner if verify.plan == "goodput" else None,
            verify.budget(target.device),
            verify.rule,
            verify_batch,
            verify.walk_on_device,
        )
        self.waiting: deque[Sequence] = deque()
        self.rounds = self._new_rounds()
        self._thread_drafts: list[DraftRecord] = []  # the drafting thread's rounds, for the next step's cost
        self._thread: threading.Thread | None = None
        self._thread_running = False
        self._failure: list[BaseException] = []

    @property
    def drafter(self) -> Drafter:
        return self.setup.drafter

    @drafter.setter
    def drafter(self, drafter: Drafter) -> None:
        """A drafter swapped in between steps (tuning.calibrate_tree's recorder wraps the built one)."""
        self.setup = replace(self.setup, drafter=drafter)

    @property
    def planner(self) -> Planner | None:
        return self.setup.planner

    @property
    def cache(self) -> KVCache:
        return self.setup.cache

    @property
    def slots(self) -> dict[int, Slot]:
        """Row -> the live sequence's slot there."""
        return self.rounds.live

    @property
    def busy(self) -> bool:
        return bool(self.rounds.live or self.waiting)

    @property
    def live(self) -> int:
        return len(self.rounds.live)

    def admit(self, seqs: list[Sequence]) -> None:
        """Queue sequences: they take rows at the start of the next step."""
        self.waiting.extend(seqs)

    def run(self, seqs: list[Sequence]) -> DecodeStats:
        return run_to_end(self, seqs)

    def clear(self) -> None:
        """Drop every queued and live sequence (their callers are gone: an error or a cancel), so
        that the next call starts on a clean batch: every row of the pool empty (paged, its blocks
        back), the follow-ups' pins let go, the drafter's entries for them released; what the drafter
        learned and what the prefix store holds stay."""
        with self.rounds.cond:
            known = [*self.rounds.live.values(), *self.rounds.left]
        self.rounds.fail()  # wakes a drafting thread, which then ends
        if self._thread is not None:
            self._thread.join()
            self._thread, self._thread_running = None, False
        self.drafter.release(sorted((s for s in known if s.heard), key=lambda s: s.row), [])
        cache = self.setup.cache
        # Every row: a step may have failed between taking a row and handing it to the rounds.
        self.target.release(cache, list(range(len(cache.lens))))
        for s in self.waiting:
            if s.follows:  # pinned for this follow-up, which will not come
                self.target.prefixes.unpin(s.follows)
        self.waiting.clear()
        self.rounds = self._new_rounds()
        self._failure.clear()
        self._thread_drafts.clear()  # the dropped batch's drafting: no later step's cost

    def _new_rounds(self) -> Rounds:
        return Rounds() if self.overlap else Rounds(cond=Unlocked())

    def step(self) -> Step:
        """Admit waiting sequences, then one decode step: the sequences that stopped, and its cost."""
        laps = Laps(time.perf_counter)
        cost = DecodeStats()
        self._fill(cost)
        if self.overlap:
            self._ensure_drafting_thread()
        laps.lap("admit")
        record = decode_step(self.rounds, self.setup, laps, draft_here=not self.overlap)
        if self._failure:
            raise self._failure[0]
        if self.overlap and not self.busy and self._thread is not None:
            self._thread.join()  # it ends once the drafter has heard everything
            self._thread = None
            if self._failure:
                raise self._failure[0]
        with self.rounds.cond:
            drafts, self._thread_drafts = [*record.drafts, *self._thread_drafts], []
        for draft in drafts:
            self._observe_draft(draft, cost)
        self._observe(record, cost)
        # Memory back once the pool holds far more than its live rows need (a burst of rows gone): asked
        # only once a row was let go, since what the live rows need shrinks only then (0.5 ms a step at 32 rows).
        if self.rounds.freed:
            self.target.give_back(
                self.setup.cache,
                self.rounds.trim(),
                lambda: widest_need([s.seq for s in self.rounds.live.values()], self.drafter.max_nodes),
            )
        finished, forward_s = record.finished, record.forward_ms / 1000
        del record  # its logits freed on the step's clock: freeing is the host's work too
        laps.lap("rounds")
        cost.schedule.add_step(laps.total, forward_s, laps.seconds)
        return Step(finished, cost)

    def _observe(self, record: StepRecord, stats: DecodeStats) -> None:
        """The step's record into its cost and the planner's calibration."""
        if not record.slots:
            return
        plan = record.plan
        stats.target_forwards += 1  # the verification forward
        stats.target_rows += len(record.slots)
        stats.schedule.context_positions += record.reads[0]
        stats.schedule.context_positions_shared += record.reads[1]
        stats.schedule.queue_wait_s += record.queue_wait_s
        stats.schedule.verified_drafts += len(record.slots)
        stats.verify_s += record.verify_s
        stats.other_s += record.other_s
        if plan is not None and self.planner is not None and record.sampling is not None:
            around_ms = 1000 * record.verify_s - record.forward_ms
            self.planner.observe(plan, record.verdicts, record.sampling.greedy, record.forward_ms, around_ms)
            stats.schedule.planned_rows += plan.rows
            stats.schedule.planned_nodes += sum(plan.nodes)
            stats.schedule.predicted_step_s += plan.predicted_ms / 1000
            stats.schedule.planned_step_s += record.verify_s

    def _observe_draft(self, draft: DraftRecord, stats: DecodeStats) -> None:
        stats.draft_s += draft.seconds
        if draft.drafted:
            stats.schedule.draft_calls += 1
            stats.schedule.drafted_rows += draft.drafted
            if self.planner is not None:
                self.planner.drafted(draft.drafted, draft.draft_ms)

    def _fill(self, cost: DecodeStats) -> None:
        room = len(self.waiting) if self.max_live is None else self.max_live - len(self.rounds.live)
        wanted = list(self.waiting)[: max(0, room)]
        if not wanted:  # most steps: nothing waits
            return
        live = [s.seq for s in self.rounds.live.values()]
        max_nodes = self.drafter.max_nodes
        fit = rows_that_fit(
            self.target.kv_layout, self.target.kv_budget, needs(live, max_nodes), needs(wanted, max_nodes)
        )
        if fit < len(wanted):
            self._hold_for_memory(wanted[fit:], alone=not live and not fit, cost=cost)
        new = [self.waiting.popleft() for _ in range(fit)]
        for s in new:
            s.waits_for_memory = False
        if not new:
            return
        t0 = time.perf_counter()
        rows = [self.rounds.take_row() for _ in new]
        cache = self.setup.cache
        admitted = self.target.admit(cache, rows, [s.prompt for s in new], admission_room(new, max_nodes))
        for s, n in zip(new, admitted.computed):
            s.stats.prompt_tokens_computed += n
        for s in new:
            if s.follows:  # its context served it: evictable again
                self.target.prefixes.unpin(s.follows)
        cost.prompt_tokens += sum(len(s.prompt) for s in new)
        cost.prompt_tokens_computed += sum(admitted.computed)
        cost.target_forwards += admitted.forwards
        cost.target_rows += admitted.rows
        start = admitted.start_hidden
        self.rounds.arrive([Slot(r, s, p, start, cache) for r, s, p in zip(rows, new, admitted.pending)])
        cost.verify_s += time.perf_counter() - t0

    def _hold_for_memory(self, held: list[Sequence], alone: bool, cost: DecodeStats) -> None:
        """Sequences the KV pool has no memory for wait until live ones finish; one that does not
        fit `alone` never will: a configuration error."""
        budget = self.target.kv_budget or 0
        if alone:
            need = pool_bytes(self.target.kv_layout, needs(held[:1], self.drafter.max_nodes))
            raise BackendError(
                f"one sequence needs {need / 2**20:.3g} MB of KV cache (its prompt, the tokens it may generate and a "
                f"draft tree), model.kv_memory allows {budget / 2**20:.3g} MB: raise model.kv_memory or "
                "model.kv_memory_mb, or lower the tokens a request may generate (tot.solve: gen.max_thought_tokens, "
                "gen.max_eval_tokens, search.max_tokens, task.rollout_tokens; decoding.generate: gen.max_new_tokens)"
            )
        first = [s for s in held if not s.waits_for_memory]
        if first and not any(s.waits_for_memory for s in self.waiting):
            log.warning("%d sequences wait for KV memory (model.kv_memory allows %.3g MB)", len(held), budget / 2**20)
        for s in first:
            s.waits_for_memory = True
        cost.kv_waits += len(first)

    def _ensure_drafting_thread(self) -> None:
        # The thread ends once the drafter has heard everything and no slot is live; it decides so
        # under the rounds' lock, so slots admitted before this check are never left undrafted.
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
                draft = draft_round(self.rounds, self.setup, Laps(time.perf_counter), wait=True)
                with self.rounds.cond:
                    self._thread_drafts.append(draft)
                    if self.rounds.finished:
                        self._thread_running = False
                        return
        except BaseException as e:  # surfaced in the verifying thread
            self._failure.append(e)
            with self.rounds.cond:
                self._thread_running = False
            self.rounds.fail()
