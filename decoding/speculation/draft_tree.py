"""Draft trees: candidate continuations of one sequence, verified by the target in one forward.

A tree hangs under an implicit root, the sequence's last token (already decided, not yet in the
target's cache). Nodes are listed parents-first; `parents[i]` is -1 for a child of the root.
Siblings are listed in the order they were drawn, which is the order verification tries them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

# How the children of a node were drawn from the draft distribution at that node:
#   "iid": independently, with replacement (SpS for one child, SpecInfer/MCSD for several);
#   "without_replacement": each from q with the earlier siblings removed (Sequoia, Gumbel-top-k);
#   "top": chosen deterministically (top-k, n-gram lookups), i.e. each drawn from a point mass.
Draw = Literal["iid", "without_replacement", "top"]
ROOT = -1
# A draft distribution: dense [V], or sparse (token ids, probabilities) as N-gram drafters keep it.
DraftDist = torch.Tensor | tuple[list[int], list[float]]


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # Draft probability of each node's token under its parent's draft distribution.
    probs: list[float] = field(default_factory=list)
    draw: Draw = "top"
    # For stochastic draws: the draft distribution [V] each node's children were drawn from,
    # keyed by the node (ROOT for the root's children).
    dists: dict[int, DraftDist] = field(default_factory=dict)
    # A tree grafted from several drafters: each node's source (0 = draw/dists above) and, per
    # other source, how its children were drawn and from what (keyed by parent node).
    sources: list[int] = field(default_factory=list)
    parts: dict[int, tuple[Draw, dict[int, DraftDist]]] = field(default_factory=dict)
    # A tree filled into a static shape: each node's node in that shape (what tree calibration counts).
    shape_nodes: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def source_of(self, node: int) -> int:
        return self.sources[node] if node < len(self.sources) else 0

    def part(self, source: int) -> tuple[Draw, dict[int, DraftDist]]:
        return (self.draw, self.dists) if source == 0 else self.parts[source]

    def add(self, token: int, parent: int, prob: float = 1.0) -> int:
        assert parent < len(self.tokens), "nodes are listed parents-first"
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.probs.append(float(prob))
        return len(self.tokens) - 1

    def prefix(self, n: int) -> DraftTree:
        """The tree of its first n nodes. Nodes are parents-first and siblings in draw order, so
        this is the tree the drafter would have drawn had it stopped after n nodes: each node keeps
        its parent, each parent a first run of its children (verification stays lossless)."""
        if n >= len(self):
            return self

        def kept(dists: dict[int, DraftDist]) -> dict[int, DraftDist]:
            return {k: v for k, v in dists.items() if k < n}  # ROOT (-1) included

        return DraftTree(
            tokens=self.tokens[:n],
            parents=self.parents[:n],
            probs=self.probs[:n],
            draw=self.draw,
            dists=kept(self.dists),
            sources=self.sources[:n],
            parts={s: (draw, kept(dists)) for s, (draw, dists) in self.parts.items()},
            shape_nodes=self.shape_nodes[:n],
        )

    def subtree(self, nodes: list[int]) -> DraftTree:
        """The tree of the given nodes (ascending), each with its parent and, among its siblings, after
        a first run of them in draw order: the tree the drafter would have drawn had it stopped
        drawing each node's children there, so verification stays lossless (`prefix` is the case
        of the first n nodes)."""
        new = {ROOT: ROOT}
        for i, node in enumerate(nodes):
            assert self.parents[node] in new, f"node {node} kept without its parent"
            new[node] = i

        def kept(dists: dict[int, DraftDist]) -> dict[int, DraftDist]:
            return {new[k]: v for k, v in dists.items() if k in new}

        return DraftTree(
            tokens=[self.tokens[n] for n in nodes],
            parents=[new[self.parents[n]] for n in nodes],
            probs=[self.probs[n] for n in nodes],
            draw=self.draw,
            dists=kept(self.dists),
            sources=[self.sources[n] for n in nodes] if self.sources else [],
            parts={s: (draw, kept(dists)) for s, (draw, dists) in self.parts.items()},
            shape_nodes=[self.shape_nodes[n] for n in nodes] if self.shape_nodes else [],
        )

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def depths(self) -> list[int]:
        """Depth of each node, 1 for a child of the root."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p == ROOT else out[p] + 1)
        return out

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def ancestry(self) -> torch.Tensor:
        """[N, N] bool: entry (i, j) says node i sees node j (j is i or an ancestor of i)."""
        see = np.eye(len(self.tokens), dtype=bool)  # numpy's row operations: a tenth of torch's per call
        for i, p in enumerate(self.parents):
            if p != ROOT:
                see[i] |= see[p]
        return torch.from_numpy(see)


def k_config_parents(k_config: tuple[int, ...]) -> list[int]:
    """Parent indices of the static tree whose nodes at depth d each have k_config[d] children.

    (2, 2, 1) is SEED's Appendix B example: 2 + 4 + 4 = 10 nodes; (1, 1, 1) is a chain of 3.
    """
    if not k_config or any(k < 1 for k in k_config):
        raise ValueError(f"k_config={tuple(k_config)} must be a non-empty list of positive children counts")
    parents: list[int] = []
    level = [ROOT]
    for k in k_config:
        nxt = []
        for p in level:
            for _ in range(k):
                parents.append(p)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


def graft(trees: list[DraftTree], merge: bool = False) -> tuple[DraftTree, list[list[int]]]:
    """One tree holding several drafters' trees under the same root, and, per input tree, where
    each of its nodes went. Verification tries the first tree's children of a node first.

    merge: a node whose token its merged parent already has as a child becomes that child (the
    drafters' trees merged as one trie), for the matched rules, which keep whichever child is the
    target's sample: a duplicate sibling costs a verified token and can never be kept. The rejection
    rules need each source's candidates as drawn, duplicates included (merge=False)."""
    out = DraftTree(draw=trees[0].draw, dists=dict(trees[0].dists))
    where: list[list[int]] = []
    child: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    for src, t in enumerate(trees):
        moved: list[int] = []
        for tok, par, prob in zip(t.tokens, t.parents, t.probs):
            parent = ROOT if par == ROOT else moved[par]
            if merge and (parent, tok) in child:
                moved.append(child[(parent, tok)])
                continue
            node = out.add(tok, parent, prob)
            out.sources.append(src)
            child[(parent, tok)] = node
            moved.append(node)
        if src:
            out.parts[src] = (t.draw, {(ROOT if k == ROOT else moved[k]): q for k, q in t.dists.items()})
        where.append(moved)
    return out, where
