"""How likely a draft node is to be accepted: each drafter's node scores, calibrated against verdicts.

Every drafter scores its nodes (`DraftTree.probs`: STAND's pool probability, ADED's and Token
Recycling's normalised counts, a draft model's q, 1.0 where a drafter has no score, as PLD). The
record counts, per (tree source, greedy or sampled row, first child or a later sibling, depth, score
bucket), how often a node was
verified with its parent reached (the parent accepted, or the root) and how often it was the
accepted child. So it estimates P(node accepted | parent accepted) under whichever acceptance rule
is in force, and a node's chance of being on the accepted path is the product along its path: the
expected tokens a tree commits are 1 (the bonus) plus the sum of its nodes' reach.

A first child and its later siblings are kept apart because they fare differently for reasons the
score does not see: a later sibling is tried only where the first was rejected, and under
`match_gumbel` a coupled drafter's first child is its guess of the target's very sample (accepted
with the overlap of the two distributions, whatever its own score), its siblings the runners-up.

Counts start from a prior worth PRIOR verdicts: the score times how the source's scores have fared
so far (accepted nodes over the sum of their scores, pooled over every bucket of the source's first
children, or of its later siblings), so a drafter whose scores run high or low is corrected from the
first verdicts on, not bucket by bucket.
A bucket with few verdicts gets an optimistic bonus (EXPLORE / sqrt(1 + verdicts)) so that it is
tried, and old verdicts fade (DECAY per verdict), so the estimates follow the run as its text changes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from decoding.speculation.draft_tree import ROOT, DraftTree

SCORE_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.97)  # bucket upper edges
MAX_DEPTH = 6  # deeper nodes share the last depth's buckets
PRIOR = 3.0  # verdicts the prior (the drafter's own score) is worth: a bucket is tried before it is judged
DECAY = 0.995
# Optimism for buckets with few verdicts (an upper confidence bound): a drafter whose scores are
# under-confident still gets its nodes tried, or the record would never learn they pay.
EXPLORE = 0.15


Key = tuple[int, bool, bool, int, int]  # (source, greedy, first child, depth, score bucket)
Pool = tuple[int, bool, bool]  # (source, greedy, first child)


def bucket(score: float) -> int:
    return bisect.bisect_left(SCORE_EDGES, score)


@dataclass
class AcceptanceRecord:
    """Calibrated per-node acceptance (see the module docstring); one per decoder's drafter."""

    tried: dict[Key, float] = field(default_factory=dict)
    accepted: dict[Key, float] = field(default_factory=dict)
    scored: dict[Pool, float] = field(default_factory=dict)  # per pool: tried nodes' scores
    hits: dict[Pool, float] = field(default_factory=dict)  # per pool: accepted nodes

    def scale(self, pool: Pool) -> float:
        """How the pool's scores have fared: accepted nodes per unit of score (1 before any verdict)."""
        return (self.hits.get(pool, 0.0) + PRIOR) / (self.scored.get(pool, 0.0) + PRIOR)

    @staticmethod
    def _keys(tree: DraftTree, greedy: bool) -> list[Key]:
        out, seen = [], set()
        for node, depth in enumerate(tree.depths()):
            source = tree.source_of(node)
            # Siblings are listed in draw order; in a grafted tree each source drew its own.
            first = (tree.parents[node], source) not in seen
            seen.add((tree.parents[node], source))
            out.append((source, greedy, first, min(depth, MAX_DEPTH), bucket(tree.probs[node])))
        return out

    def accept(self, tree: DraftTree, greedy: bool) -> list[float]:
        """Per node: the estimated P(accepted | parent accepted)."""
        out = []
        for node, key in enumerate(self._keys(tree, greedy)):
            prior = min(1.0, min(tree.probs[node], 1.0) * self.scale(key[:3])) * PRIOR
            tried = self.tried.get(key, 0.0)
            mean = (self.accepted.get(key, 0.0) + prior) / (tried + PRIOR)
            out.append(min(1.0, mean + EXPLORE / (1.0 + tried) ** 0.5))
        return out

    def reach(self, tree: DraftTree, greedy: bool) -> list[float]:
        """Per node: the estimated chance that it is on the accepted path."""
        out: list[float] = []
        for node, a in enumerate(self.accept(tree, greedy)):
            parent = tree.parents[node]
            out.append(a * (1.0 if parent == ROOT else out[parent]))
        return out

    def observe(self, tree: DraftTree, path: list[int], greedy: bool) -> None:
        """One verified tree and its accepted path: every node whose parent was reached is a trial."""
        reached = {ROOT, *path}
        on_path = set(path)
        for node, key in enumerate(self._keys(tree, greedy)):
            if tree.parents[node] not in reached:
                continue
            self.tried[key] = self.tried.get(key, 0.0) * DECAY + 1.0
            self.accepted[key] = self.accepted.get(key, 0.0) * DECAY + (node in on_path)
            pool = key[:3]
            self.scored[pool] = self.scored.get(pool, 0.0) * DECAY + min(tree.probs[node], 1.0)
            self.hits[pool] = self.hits.get(pool, 0.0) * DECAY + (node in on_path)

    def table(self) -> list[dict[str, Any]]:
        """The record as rows (source, greedy, first child, depth, score bucket, verdicts, acceptance),
        for reports."""
        return [
            {
                "source": k[0],
                "greedy": k[1],
                "first_child": k[2],
                "depth": k[3],
                "score_below": SCORE_EDGES[k[4]] if k[4] < len(SCORE_EDGES) else 1.0,
                "verdicts": round(self.tried[k], 1),
                "acceptance": self.accepted.get(k, 0.0) / self.tried[k],
            }
            for k in sorted(self.tried)
        ]
