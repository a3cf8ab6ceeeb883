"""The step planner: each step sized for the most expected committed tokens per second.

Two phases around drafting. Before it (`budgets`), each row's recent trees say what its drafts are
worth (a new row starts from what every row's were worth lately); a row whose drafts could not pay
for themselves on this machine's cost curve is not drafted (it is still verified, and its drafter
still learns from every token it commits), and every `PROBE` steps such a row is drafted again to
see whether that changed. After it (`cut`), every node of every tree has a calibrated chance of
being accepted (decoding/speculation/calibration.py); nodes are taken best first across all rows, each
row's in an order that keeps, for every kept node, its parent and a first run of its siblings in
draw order (so every acceptance rule stays lossless), and the plan is the prefix of that order with
the highest expected tokens (one bonus per row plus the kept nodes' reach) per predicted millisecond
(the forward, decoding/speculation/cost.py, plus the work around it). The empty plan, plain decoding, is
always a candidate, so on a machine where a forward's cost grows with its tokens few nodes are kept,
and where it is flat (a GPU) whole trees are.

The planner sizes trees; it never picks rows: every ready row is verified in every forward.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from decoding.runtime.models import cache_root
from decoding.runtime.runner import ModelRunner
from decoding.speculation.calibration import AcceptanceRecord
from decoding.speculation.cost import ForwardCost, Overhead, forward_cost, node_ms
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.slot import Estimate
from decoding.speculation.verify import Verdict

PROBE = 4  # steps a row goes undrafted before it is drafted again to look
# ... and while the plans seldom kept a drafted node (`pays` below SELDOM: their nodes were cut,
# so no verdict can change the estimates), steps before it looks
# anyway: longer than most ToT thoughts, so a busy batch's pools are seldom read (their learning
# waits, see decoding/drafters/ngram.py) until fewer rows make nodes worth their cost again.
FAR_PROBE = 128
SELDOM = 0.1
# Steps a plain step's plan (no row drafted) is reused while its rows and tokens stay: its price moves
# with the context, a token a row a step, and pricing it read every row's blocks (0.45 ms of a 16 ms
# step of the embedded model at one problem in flight, the whole of seed_stand's lag behind ar's).
PLAIN_REUSE = 16


def best_first(tree: DraftTree, reach: list[float]) -> list[int]:
    """The tree's nodes, most likely first, each after its parent and its earlier siblings."""
    kids: dict[int, list[int]] = {}
    for node, parent in enumerate(tree.parents):
        kids.setdefault(parent, []).append(node)
    order: list[int] = []
    heap: list[tuple[float, int, int, int]] = []  # (-reach, node, parent, rank among siblings)

    def push(parent: int, rank: int) -> None:
        sibs = kids.get(parent, [])
        if rank < len(sibs):
            node = sibs[rank]
            heapq.heappush(heap, (-reach[node], node, parent, rank))

    push(ROOT, 0)
    while heap:
        _, node, parent, rank = heapq.heappop(heap)
        order.append(node)
        push(node, 0)
        push(parent, rank + 1)
    return order


@dataclass
class StepPlan:
    """What the planner chose for one forward, and what it expected."""

    rows: int
    nodes: list[int]  # kept per row
    kept_nodes: list[list[int] | None]  # per row, the drafted tree's nodes kept (None: all)
    drafted: int  # nodes drafted in all, before the cut
    expected_tokens: float
    predicted_forward_ms: float
    predicted_ms: float  # forward plus the work around it


@dataclass
class PlainPlan:
    """The latest plain step's plan: its (rows, tokens, width), the cost model's correction it was
    priced at, and the steps it has served."""

    key: tuple[int, int, int]
    plan: StepPlan
    correction: float
    uses: int = 1


@dataclass
class Planner:
    cost: ForwardCost
    record: AcceptanceRecord = field(default_factory=AcceptanceRecord)
    overhead: Overhead = field(default_factory=Overhead)
    draft_ms_per_row: float | None = None  # a drafter call's ms per row drafted (None: none timed yet)
    # False: plans from `cost` and the verdicts alone, never from the clock, so the same inputs give
    # the same plans (tests, and comparing plans across machines).
    timed: bool = True
    # What a row's drafts are worth before it has drafted: every row's worth (a slower EMA). A ToT
    # thought is a short sequence, so an optimistic start would be much of a row's life.
    prior: float = 1.0
    rate_per_ms: float = 0.0  # expected tokens per ms of the latest plan
    # What one more node must return to pay at the latest plan (tokens), and how often a step's plan
    # kept any of its drafted nodes (EMA over steps that verified drafted trees): one step's plan is
    # one draw of the trees' worth (the latest step's alone stopped probes for FAR_PROBE steps after
    # every miss). Whether the best node could pay for itself alone was no sign: with 13 rows in flight
    # it could in half the steps, while the plans kept 0.004 nodes a row, a step's drafting cost more
    # than its nodes could return, and rows were drafted again to be cut every PROBE steps.
    node_tokens: float = 0.0
    pays: float = 1.0
    _plain: PlainPlan | None = field(default=None, init=False, repr=False)

    def allocate(
        self, gains: list[np.ndarray], pending: list[int], context: float
    ) -> tuple[list[int], float, float, float]:
        """How many of each row's nodes (taken in the given order) to keep: the prefix of the
        best-first merge of all rows with the most expected tokens per predicted ms. Returns the
        counts, the expected tokens, the predicted forward ms and the predicted step ms."""
        rows = len(gains)
        heap = [(-float(g[0]), r, 0) for r, g in enumerate(gains) if len(g)]
        heapq.heapify(heap)
        order_rows: list[int] = []
        order_gain: list[float] = []
        order_width: list[int] = []  # the row's width once it keeps this node
        while heap:
            neg, r, i = heapq.heappop(heap)
            order_rows.append(r)
            order_gain.append(-neg)
            order_width.append(pending[r] + i + 1)
            if i + 1 < len(gains[r]):
                heapq.heappush(heap, (-float(gains[r][i + 1]), r, i + 1))
        k = np.arange(len(order_rows) + 1)
        tokens = sum(pending) + k
        widths = np.maximum.accumulate(np.array([max(pending), *order_width], dtype=float))
        expected = rows + np.concatenate([[0.0], np.cumsum(order_gain)])
        forward = self.cost.ms_each(rows, tokens, widths, context)
        step = forward + self.overhead.ms(rows, k)
        rate = expected / np.maximum(step, 1e-6)
        best = int(np.argmax(rate))  # the first best: ties go to the smaller plan
        kept = [0] * rows
        for r in order_rows[:best]:
            kept[r] += 1
        return kept, float(expected[best]), float(forward[best]), float(step[best])

    def budgets(self, rows: list[Estimate], max_nodes: int) -> list[int]:
        """Phase 1: nodes worth drafting per row (max_nodes or 0). A row is drafted while what its
        kept nodes were recently worth (`worth`, in tokens, their cost taken off) pays for drafting
        them; a row not worth drafting is looked at again every PROBE steps (every FAR_PROBE while
        the drafted trees' best node seldom could pay for itself)."""
        cost = self.rate_per_ms * (self.draft_ms_per_row or 0.0)  # drafting a row, in tokens
        probe = PROBE if self.pays >= SELDOM else FAR_PROBE
        out = []
        for r in rows:
            worth = (self.prior if r.worth is None else r.worth) > cost
            draft = worth or r.idle + 1 >= probe
            r.idle = 0 if draft else r.idle + 1
            out.append(max_nodes if draft else 0)
        return out

    def cut(
        self, rows: list[Estimate], trees: list[DraftTree], greedy: list[bool], pending: list[int], context: float
    ) -> tuple[list[DraftTree], StepPlan]:
        """Phase 2: each row's tree cut to the nodes that pay, by the calibrated reach of every node."""
        if not any(len(t) for t in trees):  # a busy step's usual case: plain decoding, nothing to rank
            return trees, self.plain(len(rows), pending, lambda: context)
        orders: list[list[int]] = []
        gains: list[np.ndarray] = []
        for tree, g in zip(trees, greedy):
            if not len(tree):
                orders.append([])
                gains.append(np.zeros(0))
                continue
            reach = self.record.reach(tree, g)
            order = best_first(tree, reach)
            orders.append(order)
            gains.append(np.array([reach[n] for n in order]))
        kept, expected, forward_ms, step_ms = self.allocate(gains, pending, context)
        self.rate_per_ms = expected / step_ms if step_ms > 0 else 0.0
        width = max(p + k for p, k in zip(pending, kept))
        _, node_ms = self._margin(len(rows), sum(pending) + sum(kept), width, context)
        self.node_tokens = self.rate_per_ms * node_ms
        self.pays = 0.9 * self.pays + 0.1 * (sum(kept) > 0)
        for row, tree, gain, k in zip(rows, trees, gains, kept):
            if len(tree):
                # A tree cut to nothing is worth nothing, not what its best node fell short by: the
                # plan takes only nodes that pay, so drafting is an option worth at least zero (counting
                # the shortfall stopped rows at one problem from drafting at all: 1.5 -> 1.1 accepted).
                worth = float(gain[:k].sum()) - self.node_tokens * k
                row.worth = 0.7 * (self.prior if row.worth is None else row.worth) + 0.3 * worth
                self.prior = 0.9 * self.prior + 0.1 * worth
        kept_nodes = [None if k == len(t) else sorted(o[:k]) for t, o, k in zip(trees, orders, kept)]
        cut = [t if nodes is None else t.subtree(nodes) for t, nodes in zip(trees, kept_nodes)]
        plan = StepPlan(len(rows), kept, kept_nodes, sum(len(t) for t in trees), expected, forward_ms, step_ms)
        return cut, plan

    def plain(self, rows: int, pending: list[int], context: Callable[[], float]) -> StepPlan:
        """The plan of a step that verifies no draft: its predicted forward and step, and the rate
        and a node's price that phase 1 charges drafting at; reused for PLAIN_REUSE steps of the same
        rows and tokens (`context` is read only when it is priced anew), its forward's prediction
        scaled by the cost model's correction since (what `observe` corrects the model by)."""
        key = (rows, sum(pending), max(pending))
        if self._plain is not None and self._plain.key == key and self._plain.uses < PLAIN_REUSE:
            self._plain.uses += 1
            scale = self.cost.correction / self._plain.correction
            plan = self._plain.plan
            return replace(plan, predicted_forward_ms=plan.predicted_forward_ms * scale)
        forward_ms, node_ms = self._margin(rows, key[1], key[2], context())
        step_ms = forward_ms + float(self.overhead.ms(rows, 0))
        self.rate_per_ms = rows / step_ms if step_ms > 0 else 0.0
        self.node_tokens = self.rate_per_ms * node_ms
        plan = StepPlan(rows, [0] * rows, [None] * rows, 0, rows, forward_ms, step_ms)
        self._plain = PlainPlan(key, plan, self.cost.correction)
        return plan

    def _margin(self, rows: int, tokens: int, width: int, context: float) -> tuple[float, float]:
        """The predicted ms of a forward of `rows` rows holding `tokens` tokens (the widest
        `width`), and what one more node would add to the step."""
        ms = self.cost.ms(rows, tokens, width, context)
        return ms, self.cost.ms(rows, tokens + 1, width, context) - ms + self.overhead.node_ms

    def observe(
        self, plan: StepPlan, verdicts: list[Verdict], greedy: list[bool], forward_ms: float, around_ms: float
    ) -> None:
        """What the step measured: verdicts calibrate the record, times correct the cost model."""
        for v, g in zip(verdicts, greedy):
            if len(v.tree):
                self.record.observe(v.tree, v.path, g)
        if not self.timed:
            return
        self.cost.observe(plan.predicted_forward_ms, forward_ms)
        self.overhead.observe(plan.rows, sum(plan.nodes), around_ms)

    def drafted(self, rows: int, ms: float) -> None:
        """A drafter call's rows and time: the drafting cost per row that phase 1 charges. One call
        counts at most 4x the running figure: a pool's first read after a stretch undrafted folds in
        what it learnt meanwhile (decoding/drafters/ngram.py), a cost of learning, not of drafting."""
        if not rows or not self.timed:
            return
        per_row = ms / rows
        if self.draft_ms_per_row is None:
            self.draft_ms_per_row = per_row
        else:
            self.draft_ms_per_row = 0.9 * self.draft_ms_per_row + 0.1 * min(per_row, 4 * self.draft_ms_per_row)


def goodput_planner(target: ModelRunner, cost: str | None = None) -> Planner:
    """The step planner on `target`'s forward costs: the profile JSON `cost` (verify.cost), or this
    machine's, profiled once and cached (decoding/speculation/cost.py)."""
    return Planner(forward_cost(target, cache_root(), cost), overhead=Overhead(node_ms=node_ms(target)))
