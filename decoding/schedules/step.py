"""One decode step of every token-level decoder, on one screen: plan, draft, cut, pack, forward,
accept, commit, learn.

The stages take their inputs and return their outputs; none writes a counter. What a step did is
its `StepRecord`, which the scheduler hands to the observers (the statistics, the planner's
calibration). Times come from the `Laps` passed in (on a clock a test may fake): every stage's time
since the previous one's end, so the stages add up to the step's wall time, and the forward's own
time less is the host's work a GPU waits on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from decoding.drafters.base import Drafter
from decoding.runtime.kv_cache import KVCache
from decoding.runtime.packing import Packed, pack
from decoding.runtime.runner import ModelRunner
from decoding.schedules.planner import Planner, StepPlan
from decoding.schedules.rounds import News, Rounds
from decoding.speculation.draft_tree import DraftTree
from decoding.speculation.logprobs import Asked, token_logprobs
from decoding.speculation.options import Rule
from decoding.speculation.row_sampling import RowSampling
from decoding.speculation.sequence import Sequence
from decoding.speculation.slot import Slot
from decoding.speculation.stopping import Detokenizer
from decoding.speculation.verify import Verdict, accept

Clock = Callable[[], float]


@dataclass
class Laps:
    """Where a step's time went: each `lap` charges the time since the previous lap to a stage
    (less what `less` says was not the host's: the forward inside it)."""

    clock: Clock
    start: float = 0.0
    last: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.start = self.last = self.clock()

    def lap(self, stage: str, less: float = 0.0) -> float:
        now = self.clock()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + (now - self.last - less)
        self.last = now
        return now

    @property
    def total(self) -> float:
        return self.last - self.start


@dataclass(frozen=True)
class StepSetup:
    """What a step runs on: fixed for a scheduler's life."""

    target: ModelRunner
    cache: KVCache  # the KV pool: row r holds the sequence of the live slot with row r
    tokenizer: Detokenizer
    drafter: Drafter
    planner: Planner | None  # verify.plan=goodput; None: every tree cut to `budget`
    budget: int | None  # verify.plan=fixed: tree tokens one forward may score (None: no cap)
    rule: Rule
    verify_batch: int | None  # queued drafts verified per forward (None: all)
    walk_on_device: bool | None = None  # verify.walk (None: by the logits' device)


@dataclass
class DraftRecord:
    """One round of the drafter: it heard the news, then drafted `drafted` of the slots waiting."""

    drafted: int = 0  # slots given a tree by the drafter's one batched call (0: no call)
    draft_ms: float = 0.0  # that call
    seconds: float = 0.0  # the round, hearing included


@dataclass
class StepRecord:
    """What one step did, for the observers."""

    drafts: list[DraftRecord] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)  # verified, in the forward's row order
    verdicts: list[Verdict] = field(default_factory=list)
    plan: StepPlan | None = None
    sampling: RowSampling | None = None  # the drafted slots' settings (the first rows of `slots`)
    queue_wait_s: float = 0.0  # summed over the verified slots: queued -> taken
    forward_ms: float = 0.0
    reads: tuple[int, int] = (0, 0)  # the forward's context positions attended, read from a sibling
    verify_s: float = 0.0  # cut, pack, forward, accept, commit
    other_s: float = 0.0  # the rounds' bookkeeping and the prefix cache after it
    finished: list[Sequence] = field(default_factory=list)


def decode_step(rounds: Rounds, setup: StepSetup, laps: Laps, draft_here: bool = True) -> StepRecord:
    """Draft the slots waiting to (unless a drafting thread does: `draft_here` False), verify up to
    `verify_batch` queued drafts in one target forward, commit and learn what they accepted."""
    record = StepRecord()
    if draft_here:
        record.drafts.append(draft_round(rounds, setup, laps, wait=False))  # learn, plan, draft
    queued = rounds.take_queued(setup.verify_batch, wait=not draft_here)
    t0 = laps.lap("rounds")
    if queued:
        # Drafted rows first (the planner plans them), then choices, scored over their answers' trees.
        slots = [s for s in queued if s.seq.choices is None]
        choices = [s for s in queued if s.seq.choices is not None]
        sampling = rounds.sampling.rows([s.row for s in slots])
        trees, plan = cut(setup, slots, sampling, [s.draft for s in slots]) if slots else ([], None)  # type: ignore[misc]
        trees += [s.seq.choices.tree for s in choices]  # type: ignore[union-attr]
        laps.lap("cut")
        packed = pack([s.pending for s in slots + choices], trees)
        laps.lap("pack")
        scored = setup.target.score(setup.cache, packed, rows_of(setup.cache, slots + choices))
        laps.lap("launch", less=scored.ms / 1000)  # the forward's own time is not the host's
        seqs = [s.seq for s in slots]
        nodes = None if plan is None else plan.kept_nodes  # the drafter's own node numbers
        verdicts = []
        if slots:
            drafted = replace(scored, logits=scored.logits[: len(slots)])
            verdicts = accept(
                packed,
                drafted,
                trees[: len(slots)],
                seqs,
                sampling,
                setup.rule,
                setup.drafter.learns_top,
                nodes,
                setup.walk_on_device,
            )
            laps.lap("accept")
            verdicts = commit(setup, slots, sampling, verdicts, packed)
        verdicts += score_choices(choices, scored.logits[len(slots) :])
        t1 = laps.lap("commit")
        slots += choices
        record.finished = finish(setup, slots)
        laps.lap("finish")
        rounds.verified_now(slots, verdicts)
        record.slots, record.verdicts, record.plan, record.sampling = slots, verdicts, plan, sampling
        record.queue_wait_s = sum(t0 - s.queued_at for s in slots)
        record.forward_ms, record.reads = scored.ms, scored.reads
        record.verify_s, record.other_s = t1 - t0, laps.lap("rounds") - t1
    if draft_here:
        record.drafts.append(draft_round(rounds, setup, laps, wait=False, draft=False))  # learn
    return record


def draft_round(rounds: Rounds, setup: StepSetup, laps: Laps, wait: bool, draft: bool = True) -> DraftRecord:
    """The drafter hears what it has not (arrivals, verdicts, departures), then drafts the waiting
    slots (with `draft`) and queues their trees."""
    t0 = laps.lap("rounds")
    news = rounds.news(wait)
    hear(setup.drafter, rounds, news)
    laps.lap("learn")
    record = DraftRecord()
    if draft and news.drafting:
        # A choice needs no draft: it is queued at once, its answers' tree for the target to score.
        asking = [s for s in news.drafting if s.seq.choices is None]
        budgets = plan_drafts(setup, asking)
        t1 = laps.lap("plan")  # what drafting costs the planner charges: the drafter's call and its trees' upkeep
        chosen = [s for s, b in zip(asking, budgets) if b]
        drafted = dict(zip(map(id, chosen), setup.drafter.draft(chosen))) if chosen else {}
        empty = DraftTree()  # an undrafted slot's, read only: one for all (a tree each cost 0.1 ms at 32 rows)
        trees = [drafted.get(id(s), empty) for s in asking]
        assert all(len(t) <= setup.drafter.max_nodes for t in trees), "a tree exceeds the drafter's max_nodes"
        scoring = [s for s in news.drafting if s.seq.choices is not None]
        now = laps.lap("draft")
        record.drafted, record.draft_ms = len(chosen), 1000 * (now - t1)
        rounds.enqueue(asking + scoring, trees + [empty] * len(scoring), now)
    record.seconds = laps.lap("rounds") - t0
    return record


def hear(drafter: Drafter, rounds: Rounds, news: News) -> None:
    """The drafter admits the new slots, learns from the verdicts before it drafts those slots again,
    and releases the slots that left (their rows are then free for new sequences)."""
    arrived = [s for s in news.arrived if s.seq.choices is None]  # a choice is never drafted
    if arrived:
        drafter.admit(arrived)
        for slot in arrived:
            slot.heard = True
    verified = [s for s in news.verified if s.heard]
    if verified:
        drafter.update(verified, [s.verdict for s in verified])  # type: ignore[misc]
    for slot in news.verified:
        slot.verdict = None
    if news.left:
        heard = [s for s in news.left if s.heard]
        if heard:
            drafter.release(heard, [s for s in news.live if s.heard])
        for slot in news.left:
            slot.heard = False
        rounds.released(news.left)


def plan_drafts(setup: StepSetup, slots: list[Slot]) -> list[int]:
    """Nodes worth drafting per slot: with the planner, slots whose drafts cannot pay are not drafted
    (they get empty trees: verified like `ar`'s rows, and their drafter still learns what they commit)."""
    if setup.planner is None or not setup.drafter.max_nodes:
        return [setup.drafter.max_nodes] * len(slots)
    return setup.planner.budgets([s.estimate for s in slots], setup.drafter.max_nodes)


def cut(
    setup: StepSetup, slots: list[Slot], sampling: RowSampling, trees: list[DraftTree]
) -> tuple[list[DraftTree], StepPlan | None]:
    """The trees this forward verifies: cut by the planner to the nodes that pay, or to the fixed budget."""
    if setup.planner is None:
        return cut_to_budget(trees, setup.budget), None
    planner, pending = setup.planner, [len(s.pending) for s in slots]

    def context() -> float:
        return forward_context(setup.cache, slots, planner.cost.shared_saving)

    if not any(len(t) for t in trees):  # plain decoding: its plan reused while its rows stay
        return trees, planner.plain(len(slots), pending, context)
    return planner.cut([s.estimate for s in slots], trees, sampling.greedy, pending, context())


def forward_context(cache: KVCache, slots: list[Slot], shared_saving: float) -> float:
    """The context a row of the forward attends, as the cost model prices it: positions read from a
    sibling's row cost `shared_saving` less (ForwardCost.shared_saving, measured by its profile)."""
    total, shared = cache.reads([s.row for s in slots])
    return (total - shared_saving * shared) / len(slots)


def cut_to_budget(trees: list[DraftTree], budget: int | None) -> list[DraftTree]:
    """Each row's tree cut to its first budget / rows - 1 nodes (at least the root is scored)."""
    if budget is None:
        return trees
    nodes = max(0, budget // len(trees) - 1)
    return [t.prefix(nodes) for t in trees]


def rows_of(cache: KVCache, slots: list[Slot]) -> list[int] | None:
    rows = [s.row for s in slots]
    return None if rows == list(range(cache.batch)) else rows


def commit(
    setup: StepSetup, slots: list[Slot], sampling: RowSampling, verdicts: list[Verdict], packed: Packed
) -> list[Verdict]:
    """Each slot keeps what its verdict accepted: tokens to the sequence (stop rules may cut them),
    the accepted path to its cache row, the next token to its pending tokens. The verdicts with
    what each sequence kept."""
    out = []
    going: list[tuple[int, list[int]]] = []  # (row, the forward's columns it keeps) of the rows that go on
    asked: list[tuple[Sequence, Asked]] = []  # the log-probabilities to read, all in one call
    for b, (slot, v) in enumerate(zip(slots, verdicts)):
        s = slot.seq
        v.kept = s.commit(v.tokens, setup.tokenizer, drafted=len(v.tree), accepted=len(v.path))
        if s.top_logprobs is not None and v.kept:
            tokens = v.tokens[: v.kept]
            ask = Asked(v.logits, v.kept_rows(), tokens, sampling.params[b], s.top_logprobs, v.scores, v.reading)
            asked.append((s, ask))
        v.scores = v.reading = None
        if not slot.seq.done:
            going.append((slot.row, packed.committed(b, v.path)))
            slot.pending = [v.token]
        out.append(v)
    if asked:
        for (s, _), read in zip(asked, token_logprobs([a for _, a in asked])):
            s.logprobs += read
    if going:
        rows, kept = zip(*going)
        setup.cache.commit_rows(list(rows), list(kept))
    return out


def score_choices(slots: list[Slot], logits: list[torch.Tensor]) -> list[Verdict]:
    """Each choice's answers scored from its rows of the forward; the choice ends (its verdict
    accepts nothing: the tree was the answers', not a draft, and nothing is committed)."""
    out = []
    for slot, rows in zip(slots, logits):
        choices = slot.seq.choices
        assert choices is not None
        slot.seq.scored(choices.logprobs(rows))
        out.append(Verdict(DraftTree(), [], -1, None, rows))
    return out


def finish(setup: StepSetup, slots: list[Slot]) -> list[Sequence]:
    """The sequences that stopped; what each committed stays in the prefix cache for later prompts
    that extend it (the next step's thoughts)."""
    done = []
    for slot in slots:
        s = slot.seq
        if s.done:
            setup.target.remember(
                setup.cache, slot.row, s.prompt + s.generated, s.context(setup.tokenizer) if s.keep else None
            )
            setup.target.release(setup.cache, [slot.row])  # what the store kept it holds itself
            done.append(s)
    return done
