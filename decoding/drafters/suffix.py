"""Cross-trajectory suffix drafts (SuffixDecoding, arXiv 2411.04975; ArcticInference's suffix tree).

A pool (one per group, problem or run, as STAND's) holds a suffix trie of everything its sequences
committed and, with `prime_with_prompt`, their prompts: every substring of up to `depth` tokens, each
trie node counting its occurrences. To draft, the longest suffix of the sequence's context (at most
`max_match` tokens) that the trie holds with a continuation is found; the continuations below it are
the draft, their counts the draft distribution (a child's count over its siblings'). The tree grows
best-first by path probability, no deeper than `spec_factor` times the match length (a long match
is a confident one), without nodes whose path probability is under `min_prob`. ToT repeats itself
(the n thoughts of one state, the evaluator's replies, the final step), so the n-th trajectory of a
group often continues word for word what an earlier one wrote.

Siblings are drafted in order: under verify.rule=match_gumbel by log q + the target's own Gumbel
noise at their position (coupled drafting, as STAND's), else by count. Each sequence's committed
tokens enter the trie as they are verified, one trie step per open suffix.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from decoding.drafters.options import SuffixOptions
from decoding.drafters.plugin import BuildConfig
from decoding.drafters.pools import Pools
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.gumbel import Coupling
from decoding.speculation.sequence import Sequence
from decoding.speculation.slot import Slot
from decoding.speculation.verify import Verdict


class Node:
    __slots__ = ("count", "kids")

    def __init__(self) -> None:
        self.count = 0
        self.kids: dict[int, Node] = {}


# A suffix still growing: its deepest trie node and its length.
Open = tuple[Node, int]


class SuffixTrie:
    """Every substring of up to `depth` tokens of the texts it was fed, with occurrence counts."""

    def __init__(self, depth: int, capacity: int) -> None:
        self.depth = depth
        self.capacity = capacity
        self.root = Node()
        self.size = 0

    def step(self, open_: list[Open], token: int) -> list[Open]:
        """Append `token` to every open suffix and open one at it; the suffixes still shorter than depth."""
        out = []
        for node, n in [*open_, (self.root, 0)]:
            kid = node.kids.get(token)
            if kid is None:
                if self.size >= self.capacity:
                    continue
                kid = node.kids[token] = Node()
                self.size += 1
            kid.count += 1
            if n + 1 < self.depth:
                out.append((kid, n + 1))
        return out

    def prime(self, tokens: list[int], start: int = 0) -> None:
        """Insert a text's suffixes; from `start` on when the trie holds the text before it (the
        suffixes open there resume rather than start over)."""
        open_: list[Open] = self.resume(tokens[:start]) if start else []
        for t in tokens[start:]:
            open_ = self.step(open_, t)

    def find(self, tokens: list[int]) -> Node | None:
        node = self.root
        for t in tokens:
            kid = node.kids.get(t)
            if kid is None:
                return None
            node = kid
        return node

    def resume(self, context: list[int]) -> list[Open]:
        """The open suffixes at the end of a text the trie already holds (a primed prompt), so that
        what follows extends them rather than starting over."""
        out = []
        for n in range(min(self.depth - 1, len(context)), 0, -1):
            node = self.find(context[-n:])
            if node is not None:
                out.append((node, n))
        return out

    def match(self, context: list[int], longest: int) -> tuple[Node, int] | None:
        """The node of the longest suffix of `context` (up to `longest` tokens) that has a continuation."""
        for n in range(min(longest, self.depth - 1, len(context)), 0, -1):
            node = self.find(context[-n:])
            if node is not None and node.kids:
                return node, n
        return None


def grow(start: Node, budget: int, max_depth: int, min_prob: float, coupling: Coupling | None) -> DraftTree:
    """The draft below a matched node: best-first by path probability, siblings in draw order (each
    is a candidate only once its earlier siblings are in the tree)."""
    tree = DraftTree(draw="top")

    def ranked(node: Node, depth: int) -> list[tuple[int, float, Node]]:
        total = sum(k.count for k in node.kids.values())
        kids = sorted(node.kids.items(), key=lambda kv: -kv[1].count)
        if coupling is not None:
            order = coupling.order([t for t, _ in kids], [math.log(k.count / total) for _, k in kids], depth - 1)
            kids = [(t, node.kids[t]) for t in order]
        return [(t, k.count / total, k) for t, k in kids]

    # (-path probability, tie, rank among its siblings, the siblings, parent's path prob, tree parent, depth)
    heap: list[tuple[float, int, int, list[tuple[int, float, Node]], float, int, int]] = []
    tie = 0

    def push(sibs: list[tuple[int, float, Node]], rank: int, reach: float, parent: int, depth: int) -> None:
        nonlocal tie
        if rank < len(sibs) and reach * sibs[rank][1] >= min_prob:
            tie += 1
            heapq.heappush(heap, (-reach * sibs[rank][1], tie, rank, sibs, reach, parent, depth))

    push(ranked(start, 1), 0, 1.0, ROOT, 1)
    while heap and len(tree) < budget:
        neg, _, rank, sibs, reach, parent, depth = heapq.heappop(heap)
        token, q, node = sibs[rank]
        at = tree.add(token, parent, q)
        push(sibs, rank + 1, reach, parent, depth)
        if depth < max_depth and node.kids:
            push(ranked(node, depth + 1), 0, -neg, at, depth + 1)
    return tree


@dataclass
class _Row:
    open: list[Open]  # the text's open suffixes in its pool's trie
    seen: int  # context tokens already in the trie


class SuffixDrafter:
    """Suffix-trie drafts from the pool's trajectories (see the module docstring)."""

    learns_top = 0  # its update reads no Verdict.top

    def __init__(self, options: SuffixOptions, coupled: bool = True) -> None:
        self.options = options
        self.coupled = coupled  # verify.rule=match_gumbel: siblings ordered by the target's noise
        self.max_nodes = options.max_nodes
        depth = options.max_match + options.max_depth
        self.pools: Pools[SuffixTrie] = Pools(
            options.scope, options.max_pools, lambda: SuffixTrie(depth, options.capacity)
        )

    def admit(self, slots: list[Slot]) -> None:
        for slot in slots:
            seq = slot.seq
            if self.options.prime_with_prompt:
                self.pools.prime(seq.group, seq.prompt)
            trie = self.pools.get(seq.group)
            slot.put(self, _Row(trie.resume(seq.tail(trie.depth - 1)), seq.position))

    def draft(self, slots: list[Slot]) -> list[DraftTree]:
        return [self._draft(slot.seq) for slot in slots]

    def _draft(self, seq: Sequence) -> DraftTree:
        found = self.pools.get(seq.group).match(seq.tail(self.options.max_match), self.options.max_match)
        if found is None:
            return DraftTree(draw="top")
        node, matched = found
        depth = min(self.options.max_depth, max(1, int(self.options.spec_factor * matched)))
        coupling = seq.coupling() if self.coupled and not seq.params.greedy else None
        return grow(node, min(self.max_nodes, seq.room), depth, self.options.min_prob, coupling)

    def update(self, slots: list[Slot], verdicts: list[Verdict]) -> None:
        """The rows' newly committed tokens enter their pool's trie."""
        for slot, v in zip(slots, verdicts):
            seq, row = slot.seq, slot.state(self)
            trie = self.pools.get(seq.group)
            for token in seq.tail(seq.position - row.seen):
                row.open = trie.step(row.open, token)
            row.seen = seq.position
            seq.stats.suffix_accepted_tokens += len(v.path)

    def release(self, slots: list[Slot], live: list[Slot]) -> None:
        """What the rows wrote stays in the pool for the trajectories after them."""

    def peak_cache_bytes(self) -> int:
        return 0  # no model, no KV cache


def build(config: BuildConfig, *_: object) -> SuffixDrafter:
    """`suffix`'s drafter (decoding/drafters/builtin.py declares it)."""
    return SuffixDrafter(config.section("suffix"), config.verify.coupled)
