"""Sequoia's draft tree (Sequoia, section 3.1 and appendix F.1) and its hardware-aware size (section 4.1).

Under Sequoia's positional acceptance assumption, whether a drafted token is accepted depends only on
its rank among its siblings. Here `accept[k]` is the probability that the (k+1)-th ranked child of a
reached node is accepted given that the k children before it were rejected (or were not drafted:
a static tree slot the drafter left empty yields nothing either). Sequoia's acceptance vector is the
probability that child k is *the* accepted one, P[k] = accept[k] * prod_{j<k} (1 - accept[j]). A
node's score is the product of P along its path, and the expected number of tokens one verification
yields (the accepted drafts plus the bonus token) is the sum of the scores of the tree's nodes, the
root counting 1 (Proposition 3.4). The dynamic program of Algorithm 1, with the bounded depth of
appendix F.1.1, finds the tree of at most `budget` drafted nodes and depth at most `max_depth` that
maximises it; `choose` then picks the (budget, depth) of the fastest tree on measured costs.

Counting conventions: `budget` counts drafted nodes (the root, the sequence's last token, is not one);
a verification forward scores `budget + 1` tokens per row, which is what `decoding.profile_forward` calls T;
`depth` counts drafted levels, i.e. draft steps (forwards of a draft model) per tree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decoding.speculation.draft_tree import ROOT, DraftTree


def marginal(accept: Sequence[float]) -> list[float]:
    """Sequoia's P from the conditional per-rank rates: the chance that child k is the accepted one."""
    out, left = [], 1.0
    for a in accept:
        out.append(left * a)
        left *= 1.0 - a
    return out


def expected_tokens(parents: Sequence[int], accept: Sequence[float]) -> float:
    """F(T): tokens per verification (bonus included) of the tree `parents`, children ranked in index order."""
    p = marginal(accept)
    score: list[float] = []
    rank: dict[int, int] = {}
    for par in parents:
        k = rank.get(par, 0)
        rank[par] = k + 1
        score.append((1.0 if par == ROOT else score[par]) * (p[k] if k < len(p) else 0.0))
    return 1.0 + sum(score)


def tree_depth(parents: Sequence[int]) -> int:
    depth: list[int] = []
    for par in parents:
        depth.append(1 if par == ROOT else depth[par] + 1)
    return max(depth, default=0)


@dataclass(frozen=True)
class SequoiaTree:
    parents: tuple[int, ...]  # parents first, level by level, siblings in rank order (StaticTree's form)
    expected_tokens: float  # per verification step, the bonus token included

    @property
    def expected_accepted(self) -> float:
        return self.expected_tokens - 1.0

    @property
    def depth(self) -> int:
        return tree_depth(self.parents)

    def __len__(self) -> int:
        return len(self.parents)


class SequoiaDP:
    """Algorithm 1 with bounded depth, filled once for every budget <= max_budget and depth <= max_depth.

    T[n, d, b]: the largest F over trees of exactly n nodes (the root included) whose depth counted
    in levels (the root's included) is at most d and whose root has exactly b children:
        T[n, d, b] = max_{1 <= m < n} T[n - m, d, b - 1] + P[b] * Tmax[m, d - 1],
    the b-th child's subtree holding m nodes. A node never has more children than `accept` has
    ranks (a drafter offers no more candidates than were measured).
    """

    def __init__(self, accept: Sequence[float], max_budget: int, max_depth: int) -> None:
        if not accept or any(not 0.0 <= a <= 1.0 for a in accept):
            raise ValueError(f"accept={list(accept)} must be a non-empty list of probabilities")
        if max_budget < 0 or max_depth < 0:
            raise ValueError(f"budget={max_budget} and depth={max_depth} must be non-negative")
        self.accept = list(accept)
        self.p = marginal(accept)
        n_max, d_max, b_max = max_budget + 1, max_depth + 1, len(self.p)
        t = np.full((n_max + 1, d_max + 1, b_max + 1), -np.inf)
        best_m = np.zeros((n_max + 1, d_max + 1, b_max + 1), dtype=np.int64)
        t_max = np.full((n_max + 1, d_max + 1), -np.inf)
        t[1, 1:, 0] = 1.0
        t_max[1, 1:] = 1.0
        for n in range(2, n_max + 1):
            m = np.arange(1, n)
            for d in range(2, d_max + 1):
                sub = t_max[m, d - 1]
                for b in range(1, b_max + 1):
                    # -inf marks an impossible shape; P = 0 must not turn it into nan.
                    gain = np.multiply(self.p[b - 1], sub, out=np.full_like(sub, -np.inf), where=np.isfinite(sub))
                    x = t[n - m, d, b - 1] + gain
                    j = int(np.argmax(x))
                    t[n, d, b] = x[j]
                    best_m[n, d, b] = m[j]
                t_max[n, d] = t[n, d].max()
        self.t, self.t_max, self.best_m = t, t_max, best_m
        self.max_budget, self.max_depth = max_budget, max_depth

    def tree(self, budget: int, depth: int) -> SequoiaTree:
        """The best tree of at most `budget` drafted nodes and `depth` levels (ties: the smaller one)."""
        if not (0 <= budget <= self.max_budget and 0 <= depth <= self.max_depth):
            raise ValueError(f"budget={budget}, depth={depth} outside the table ({self.max_budget}, {self.max_depth})")
        d = depth + 1
        values = self.t_max[1 : budget + 2, d]
        best = float(values.max())
        # The smallest tree reaching the best value: nodes that add nothing (a rank never accepted) stay out.
        n = 1 + int(np.flatnonzero(values >= best - 1e-12)[0])
        children = self._children(n, d)
        parents: list[int] = []
        level = [(ROOT, children)]
        while level:
            nxt = []
            for parent, kids in level:
                for sub in kids:
                    parents.append(parent)
                    nxt.append((len(parents) - 1, sub))
            level = nxt
        return SequoiaTree(tuple(parents), best)

    def _children(self, n: int, d: int) -> list[Any]:
        """The optimal subtrees under a root of n nodes and depth d, in rank order (nested lists)."""
        if n == 1:
            return []
        b = int(np.argmax(self.t[n, d]))
        out = []
        while b > 0:
            m = int(self.best_m[n, d, b])
            out.append(self._children(m, d - 1))
            n, b = n - m, b - 1
        return out[::-1]


def optimal_tree(accept: Sequence[float], budget: int, max_depth: int) -> SequoiaTree:
    """Sequoia's tree for an acceptance vector: parents list (StaticTree-compatible) and expected tokens."""
    return SequoiaDP(accept, budget, max_depth).tree(budget, max_depth)


# --- the hardware-aware choice ------------------------------------------------------------------------


@dataclass(frozen=True)
class CostCurve:
    """Milliseconds of one verification forward against the tokens it scores per row (the root included),
    linearly interpolated between measured sizes; sizes outside the measured range are not guessed."""

    tokens: tuple[int, ...]
    ms: tuple[float, ...]
    batch: int = 1

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.ms) or list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError("a cost curve needs increasing, distinct tree sizes, one time each")

    def covers(self, n: int) -> bool:
        return self.tokens[0] <= n <= self.tokens[-1]

    def __call__(self, n: int) -> float:
        if not self.covers(n):
            raise ValueError(f"{n} tree tokens is outside the measured {self.tokens[0]}..{self.tokens[-1]}")
        return float(np.interp(n, self.tokens, self.ms))

    @classmethod
    def from_profile(cls, rows: list[dict[str, Any]], batch: int) -> CostCurve:
        """From the rows `python -m decoding.profile_forward out=...` writes, at one batch size."""
        mine = sorted((int(r["tree_tokens"]), float(r["ms"])) for r in rows if int(r["batch"]) == batch)
        if not mine:
            have = sorted({int(r["batch"]) for r in rows})
            raise ValueError(f"no rows for batch {batch} (it has batches {have})")
        return cls(tuple(t for t, _ in mine), tuple(ms for _, ms in mine), batch)


@dataclass(frozen=True)
class Choice:
    budget: int  # the budget asked of the dynamic program
    depth: int  # the depth limit asked
    tree: SequoiaTree  # the tree it gave (possibly smaller or shallower)
    step_ms: float  # draft levels * draft time + verification of len(tree) + 1 tokens
    tokens_per_ms: float

    def speedup_vs(self, ar_step_ms: float) -> float:
        """Against one token per plain forward of the same batch."""
        return self.tokens_per_ms * ar_step_ms


@dataclass
class ChoiceTable:
    best: Choice
    rows: list[Choice] = field(default_factory=list)


def choose(
    accept: Sequence[float], verify_ms: CostCurve, draft_ms_per_level: float, max_budget: int, max_depth: int
) -> ChoiceTable:
    """Sequoia section 4.1: maximise Speedup(n, d) = G(n, d) / (t(n) + d * c), where G is the DP's
    expected tokens, t(n) the verification time of n tokens and c the time of one draft step (the
    paper divides both by the time to verify one token, which does not move the argmax). Each tree is
    charged for what it is (its node count and depth), which is at most what (budget, depth) allows.
    Budgets whose verification size the curve does not cover are skipped; ties go to the smaller tree.
    """
    if draft_ms_per_level < 0:
        raise ValueError(f"draft time per level {draft_ms_per_level} ms is negative")
    budgets = [b for b in range(1, max_budget + 1) if verify_ms.covers(b + 1)]
    if not budgets or max_depth < 1:
        raise ValueError(
            f"no tree size to choose: budgets 1..{max_budget} need verification costs for "
            f"2..{max_budget + 1} tree tokens, measured {verify_ms.tokens[0]}..{verify_ms.tokens[-1]}"
        )
    dp = SequoiaDP(accept, max(budgets), max_depth)
    rows = []
    for budget in budgets:
        for depth in range(1, max_depth + 1):
            tree = dp.tree(budget, depth)
            if not verify_ms.covers(len(tree) + 1):
                continue
            step = tree.depth * draft_ms_per_level + verify_ms(len(tree) + 1)
            rows.append(Choice(budget, depth, tree, step, tree.expected_tokens / step if step > 0 else math.inf))
    best = max(rows, key=lambda c: (round(c.tokens_per_ms, 12), -len(c.tree), -c.tree.depth))
    return ChoiceTable(best, rows)


# --- measuring the acceptance vector -------------------------------------------------------------------


@dataclass
class RankCounts:
    """Per sibling rank: how often a reached node's k-th child was tried (the earlier ones rejected)
    and how often it was accepted, over verified draft trees of a static calibration shape."""

    tried: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def observe(self, tree: DraftTree, path: list[int], slots: Sequence[int], room: int) -> None:
        """One verified tree. `slots[d]`: children the calibration shape gives a node at depth d (the
        root is depth 0), so a slot the drafter left empty counts as tried and not accepted. Nodes at
        depth >= `room` are skipped: the drafter did not expand them for lack of token budget."""
        width = max(slots, default=0)
        while len(self.tried) < width:
            self.tried.append(0)
            self.accepted.append(0)
        node = ROOT
        for d in range(len(path) + 1):
            if d >= len(slots) or d >= room:
                return
            kids = tree.children(node)
            nxt = path[d] if d < len(path) else None
            rank = kids.index(nxt) if nxt is not None else None
            for r in range(slots[d]):
                self.tried[r] += 1
                if r == rank:
                    self.accepted[r] += 1
                    break
            if nxt is None:
                return
            node = nxt

    def accept_vector(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepted, self.tried)]
