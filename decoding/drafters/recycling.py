"""A Token-Recycling-style drafter: each token's latest top-k successors, filled into a static tree.

A baseline in the drafter slot: model-free and deterministic. After every verification the
successor list of each committed token is replaced (not averaged, unlike STAND) by the target's
top-k next tokens at that position; the table is kept across calls and shared by all sequences.
Under verify.rule=match_gumbel a sampled sequence's children are its successors ordered by log p +
the sequence's own Gumbel noise at the node's position (p: the target's probability where the list
was recorded), so the first child is the target's sample whenever the successor list holds it.
"""

from __future__ import annotations

import math

from decoding.drafters.options import RecyclingOptions
from decoding.drafters.plugin import BuildConfig
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.sequence import Sequence
from decoding.speculation.slot import Slot
from decoding.speculation.verify import Verdict, kept_tops
from decoding.trees.static import StaticTree


class RecyclingDrafter:
    def __init__(self, options: RecyclingOptions, tree: StaticTree, coupled: bool = True) -> None:
        self.options = options
        self.learns_top = options.top_k
        self.tree = tree
        self.max_nodes = len(tree)
        self.coupled = coupled
        # token -> its latest successors, best first, and their log-probabilities under the target's
        # processed distribution where a sampled row recorded them (None: a greedy row's ranking)
        self.successors: dict[int, tuple[list[int], list[float] | None]] = {}

    def admit(self, slots: list[Slot]) -> None:
        """The successor table is shared by every sequence: nothing per sequence to set up."""

    def draft(self, slots: list[Slot]) -> list[DraftTree]:
        return [self._draft(slot.seq) for slot in slots]

    def _draft(self, seq: Sequence) -> DraftTree:
        tree = DraftTree(draw="top")
        last = seq.tail(1)[0]
        coupling = seq.coupling() if self.coupled and not seq.params.greedy else None
        depth = {ROOT: 0}

        def children(node: int, k: int) -> list[tuple[int, float] | None]:
            token = last if node == ROOT else tree.tokens[node]
            if node != ROOT:
                depth[node] = depth[tree.parents[node]] + 1
            ids, logp = self.successors.get(token, ([], None))
            if coupling is not None and logp is not None:
                live = [(t, lp) for t, lp in zip(ids, logp) if lp > float("-inf")]
                ids = coupling.order([t for t, _ in live], [lp for _, lp in live], depth[node])
            return [(t, 1.0) for t in ids[:k]]

        tree.shape_nodes = self.tree.fill(tree, seq.room, children)
        return tree

    def update(self, slots: list[Slot], verdicts: list[Verdict]) -> None:
        kept = [(slot.seq, v) for slot, v in zip(slots, verdicts) if v.kept > 0]
        if not kept:
            return
        # The target's top-k at each committed position, as verify took them for the whole step.
        tops = kept_tops([v for _, v in kept], self.options.top_k)
        for (seq, v), (ids, probs) in zip(kept, tops):
            before = seq.tail(v.kept + 1)  # the token before each kept position
            for i, (succ, p) in enumerate(zip(ids, probs)):
                logp = None if seq.params.greedy else [math.log(q) if q > 0 else -math.inf for q in p]
                self.successors[before[i]] = (succ, logp)

    def release(self, slots: list[Slot], live: list[Slot]) -> None:
        """The successor table is shared by all rows: nothing per sequence to drop."""

    def peak_cache_bytes(self) -> int:
        return 0  # no model, no KV cache


def build(config: BuildConfig, *_: object) -> RecyclingDrafter:
    """`recycling`'s drafter (decoding/drafters/builtin.py declares it): its tree is STAND's (stand.tree)."""
    return RecyclingDrafter(
        config.section("recycling"), StaticTree.load(config.section("stand").tree), config.verify.coupled
    )
