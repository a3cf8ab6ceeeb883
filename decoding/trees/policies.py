"""Tree policies: which children a draft tree gets, level by level, from the drafter's distributions.

A drafter that grows its tree one level per forward (the draft model in decoding/drafters/draft_model.py, or
any other drafter with a next-token distribution per node) asks its policy for one `Growth` per tree
and loops until the growth wants nothing more:

    growth = policy.grow(greedy, generator, max_depth, coupling)
    while growth.frontier:                 # nodes whose draft distributions the next level needs
        growth.next_level([q(node) for node in growth.frontier])   # adds their children
    tree = growth.tree                     # a DraftTree, ready for verification

`frontier` starts as [ROOT] (the distribution after the sequence's pending tokens) and always lists
nodes of one depth, so a drafter can score each level in one batched forward. Nodes that are not in
a frontier are leaves: a drafter never needs their distributions. Each q is a probability vector
[V] on the CPU: at temperature > 0 the processed draft distribution the draws follow (it is kept
in the tree as the proposal the acceptance rule needs), at temperature 0 the plain softmax (used to
rank candidates and as PCT's confidences). With a `Coupling` (verify.rule=match_gumbel, t > 0) each
node's children are its top candidates by log q + the sequence's own Gumbel noise (draw "top"): the
first child is the target's sample whenever q agrees with the target.

Losslessness (decoding/speculation/acceptance.py): children drawn with draw "iid" or "without_replacement" must
really be draws from q, so how many a node gets may not depend on what was drawn; a static shape
guarantees that. Children chosen by rank (top-k) are point masses (draw "top"), verified exactly
for any choice that depends on draft-side information only, which is what lets PCT decide the
shape from the draft's confidences.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from decoding.speculation.draft_tree import ROOT, DraftTree, Draw
from decoding.speculation.gumbel import Coupling
from decoding.trees.options import DraftTreeOptions as DraftTreeOptions  # its home is the options' module


class Growth(Protocol):
    tree: DraftTree
    frontier: list[int]

    def next_level(self, dists: list[torch.Tensor]) -> None: ...


class TreePolicy(Protocol):
    name: str
    max_nodes: int  # no tree it grows is larger (the drafter's max_nodes)

    def grow(
        self, greedy: bool, generator: torch.Generator | None, max_depth: int, coupling: Coupling | None = None
    ) -> Growth: ...


def draw_children(q: torch.Tensor, k: int, draw: Draw, generator: torch.Generator | None) -> list[int]:
    """k children of one node from q, drawn the way `draw` tells the acceptance rule they were."""
    if draw == "top":
        return torch.topk(q, min(k, q.shape[-1])).indices.tolist()
    if draw == "without_replacement":
        k = min(k, int((q > 0).sum()))
        return torch.multinomial(q, k, replacement=False, generator=generator).tolist()
    return torch.multinomial(q, k, replacement=True, generator=generator).tolist()


def level_inputs(
    trees: list[DraftTree],
    frontier: list[list[int]],
    slots: list[dict[int, int]],
    written: int,
    context: list[range],
    depth: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of the forward that scores a level of several growing trees (tokens [B, W], see
    [B, W, written + W], position offsets [B, W]): one column per frontier node, padded to the widest
    row; a node sees its row's `context` columns, its ancestors' slots and itself, at offset
    `depth[b]`. Each node's slot (written + column) is recorded in `slots[b]`, for its descendants
    and for keeping the accepted path afterwards."""
    batch, width = len(trees), max(len(f) for f in frontier)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    see = torch.zeros(batch, width, written + width, dtype=torch.bool)
    offsets = torch.zeros(batch, width, dtype=torch.long)
    for b, tree in enumerate(trees):
        see[b, torch.arange(width), written + torch.arange(width)] = True
        for j, node in enumerate(frontier[b]):
            tokens[b, j] = tree.tokens[node]
            see[b, j, context[b].start : context[b].stop] = True
            for anc in tree.path(node)[:-1]:
                see[b, j, slots[b][anc]] = True
            offsets[b, j] = depth[b]
            slots[b][node] = written + j
    return tokens, see, offsets


def grow_levels(
    growths: list[Growth],
    logits: torch.Tensor,
    dists: Callable[[int, torch.Tensor], list[torch.Tensor]],
    forward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
    context: list[range],
    first_depth: list[int],
    written: int,
) -> list[dict[int, int]]:
    """Grow several rows' trees level by level, one draft forward per level, until every frontier is
    empty. `logits[b, j]`: the draft's next-token logits at row b's frontier node j (the root's
    first); `dists(b, logits)` turns them into the distributions the row's growth draws from;
    `forward(tokens, see, depth, offset)` scores a level (see `level_inputs`) whose slots start at
    `offset`, after `written` uncommitted ones; the first level sits at `first_depth[b]`. Returns
    each row's node -> cache slot."""
    slots: list[dict[int, int]] = [{} for _ in growths]
    level = 0
    while True:
        for b, g in enumerate(growths):
            if g.frontier:
                g.next_level(dists(b, logits[b, : len(g.frontier)]))
        frontier = [g.frontier for g in growths]
        if not any(frontier):
            return slots
        tokens, see, depth = level_inputs(
            [g.tree for g in growths], frontier, slots, written, context, [d + level for d in first_depth]
        )
        logits = forward(tokens, see, depth, written)
        written += tokens.shape[1]
        level += 1


# --- static shapes: k_config trees, Sequoia trees ------------------------------------------------------


class StaticPolicy:
    """A fixed shape (parents first, siblings in rank order): every drafted node gets the children
    its static node has, drawn by rank at temperature 0 and from q (`stochastic`) above."""

    def __init__(self, parents: Sequence[int], stochastic: Draw = "iid", name: str = "static") -> None:
        self.name = name
        self.parents = tuple(parents)
        self.kids: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            if not (p == ROOT or 0 <= p < i):
                raise ValueError(f"node {i} has parent {p}: nodes must be listed parents first")
            self.kids.setdefault(p, []).append(i)
        self.stochastic = stochastic
        self.max_nodes = len(self.parents)

    def grow(
        self, greedy: bool, generator: torch.Generator | None, max_depth: int, coupling: Coupling | None = None
    ) -> StaticGrowth:
        coupling = None if greedy else coupling
        draw: Draw = "top" if greedy or coupling else self.stochastic
        return StaticGrowth(self, draw, generator, max_depth, coupling)


class StaticGrowth:
    def __init__(
        self,
        policy: StaticPolicy,
        draw: Draw,
        generator: torch.Generator | None,
        max_depth: int,
        coupling: Coupling | None = None,
    ) -> None:
        self.policy = policy
        self.tree = DraftTree(draw=draw)
        self.generator = generator
        self.coupling = coupling
        self.max_depth = max_depth
        self.static_of: dict[int, int] = {ROOT: ROOT}  # drafted node -> its node in the static shape
        self.level = 0  # depth of the frontier
        self.frontier = [ROOT] if ROOT in policy.kids and max_depth >= 1 else []

    def next_level(self, dists: list[torch.Tensor]) -> None:
        assert len(dists) == len(self.frontier), "one draft distribution per frontier node"
        nxt = []
        for node, q in zip(self.frontier, dists):
            kids = self.policy.kids[self.static_of[node]]
            if self.coupling is not None:
                picks = self.coupling.top(q, len(kids), self.level)
            else:
                picks = draw_children(q, len(kids), self.tree.draw, self.generator)
            if self.tree.draw != "top":
                self.tree.dists[node] = q
            # Fewer picks than slots (q's support used up without replacement): the last slots and
            # their subtrees stay empty, which keeps the rest a valid draw.
            for token, s_child in zip(picks, kids):
                child = self.tree.add(token, node, float(q[token]))
                self.static_of[child] = s_child
                self.tree.shape_nodes.append(s_child)
                if s_child in self.policy.kids and self.level + 1 < self.max_depth:
                    nxt.append(child)
        self.level += 1
        self.frontier = nxt


# --- PCT: EDD's pruned candidate tree ------------------------------------------------------------------


class PCTPolicy:
    """EDD's Pruned Candidate Tree (EDD section 3.2): level by level, each expandable node gets its
    top-k draft candidates; a node's confidence is the product of draft probabilities along its path
    (EDD: the draft's confidence is calibrated with acceptance, so it estimates the chance that the
    node is accepted). A node is expanded only while its confidence is at least s_d / s_t (the draft
    and target forward times: below that, drafting its children is expected to cost more time than
    it saves, eq. 5), never beyond `max_depth`; leaves whose confidence is under `threshold` are
    pruned. Confidence only falls along a path, so a node under the threshold would end as a pruned
    leaf with its whole subtree: it is simply never added.

    Children are the top-k, chosen deterministically (draw "top", verified as point masses): the
    shape depends on the drawn tokens' probabilities, which only a deterministic choice allows.
    """

    name = "pct"

    def __init__(self, top_k: int, max_depth: int, threshold: float, ratio: float) -> None:
        if top_k < 1 or max_depth < 1:
            raise ValueError(f"top_k={top_k} and max_depth={max_depth} must be positive")
        if not 0 < threshold < 1:
            raise ValueError(f"threshold={threshold} must be in (0, 1)")
        if ratio <= 0:
            raise ValueError(f"s_d / s_t = {ratio} must be positive")
        self.top_k, self.max_depth, self.threshold, self.ratio = top_k, max_depth, threshold, ratio
        self.max_nodes = pct_max_nodes(top_k, max_depth, threshold, ratio)

    def grow(
        self, greedy: bool, generator: torch.Generator | None, max_depth: int, coupling: Coupling | None = None
    ) -> PCTGrowth:
        return PCTGrowth(self, min(max_depth, self.max_depth), None if greedy else coupling)


def pct_max_nodes(top_k: int, max_depth: int, threshold: float, ratio: float) -> int:
    """The most nodes a PCT tree can have. The confidences of one depth's nodes sum to at most 1, so a
    depth holds at most 1 / threshold nodes and at most 1 / ratio of them are expanded."""
    total, expanded = 0, 1 if ratio <= 1 else 0
    for _ in range(max_depth):
        nodes = min(top_k * expanded, math.floor(1 / threshold))
        total += nodes
        expanded = min(nodes, math.floor(1 / ratio))
    return total


class PCTGrowth:
    def __init__(self, policy: PCTPolicy, max_depth: int, coupling: Coupling | None = None) -> None:
        self.policy = policy
        self.coupling = coupling
        self.tree = DraftTree(draw="top")
        self.max_depth = max_depth
        self.confidence: dict[int, float] = {ROOT: 1.0}
        self.level = 0
        self.frontier = [ROOT] if max_depth >= 1 and policy.ratio <= 1.0 else []

    def next_level(self, dists: list[torch.Tensor]) -> None:
        assert len(dists) == len(self.frontier), "one draft distribution per frontier node"
        pol = self.policy
        nxt = []
        for node, q in zip(self.frontier, dists):
            if self.coupling is None:
                tokens = torch.topk(q, min(pol.top_k, q.shape[-1])).indices.tolist()
            else:
                tokens = self.coupling.top(q, pol.top_k, self.level)
            for token in tokens:
                prob = float(q[token])
                conf = self.confidence[node] * prob
                if len(self.tree) >= pol.max_nodes:
                    break
                if conf < pol.threshold:
                    # Ranked by probability, the rest are under it too; in coupled order, not.
                    if self.coupling is None:
                        break
                    continue
                child = self.tree.add(token, node, prob)
                self.confidence[child] = conf
                if conf >= pol.ratio and self.level + 1 < self.max_depth:
                    nxt.append(child)
        self.level += 1
        self.frontier = nxt


# --- options ------------------------------------------------------------------------------------------


# --- the table: tree policy name -> the policy it builds -------------------------------------------------


def _static(options: DraftTreeOptions, ratio: Callable[[], float]) -> TreePolicy:
    return StaticPolicy(options.parents, options.draw, name=options.tree_policy)


def _pct(options: DraftTreeOptions, ratio: Callable[[], float]) -> TreePolicy:
    s = options.pct_ratio if options.pct_ratio is not None else ratio()
    return PCTPolicy(options.pct_top_k, options.pct_max_depth, options.pct_threshold, s)


# `ratio` measures s_d / s_t on this machine; only PCT reads it, and only when pct_ratio is not given.
TREE_POLICIES: dict[str, Callable[[DraftTreeOptions, Callable[[], float]], TreePolicy]] = {  # options.TREE_POLICY_NAMES
    "k_config": _static,  # SEED's children per depth
    "sequoia": _static,  # a static tree from a file (python -m tuning.calibrate_tree)
    "pct": _pct,  # EDD's pruned candidate tree
}


def make_policy(options: DraftTreeOptions, ratio: Callable[[], float]) -> TreePolicy:
    """The tree policy the options name."""
    return TREE_POLICIES[options.tree_policy](options, ratio)
