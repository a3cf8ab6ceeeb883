"""ADED's model-free drafter (Adaptive Draft-Verification, AAAI 2025): MCTS drafts over a tri-gram matrix.

A tri-gram matrix stands in for the target (Eq. 1: P(c | a, b) = C(a, b, c) / C(a, b)); it starts
from an optional corpus and the prompts, and every verification adds the tri-grams of what the
target accepted (its bonus token included), so the drafts follow what this model actually writes.
From a sequence's last two tokens a Monte Carlo tree search (Algorithm 1) grows a tree of
continuations: selection by the PUCT score (Eq. 2) with the exploration constant of Eq. 3,
expansion into the matrix's `top_k` most probable next tokens, evaluation, backup. The draft tree is
the `max_nodes` most visited nodes. Drafts are chosen deterministically (draw "top"), so the
verifier treats each as a point mass and decoding is lossless at any temperature. Under
verify.rule=match_gumbel a sampled sequence's siblings are ordered by log P + the target's own
Gumbel noise at their position (coupled drafting, as STAND's): the first child is the matrix's
guess of the target's very sample, and it is the one a cut of the tree keeps.

Where the paper leaves a choice open, this module takes the one stated where it is made: the
tri-gram back-off (TriGram), the value estimate and the expanded child (Search), how the visited
nodes become a tree (`most_visited`), and the matrix's update (plain counts; the paper's Algorithm 2
increments a capped score instead, and `update_weight` plays the increment's part).
"""

from __future__ import annotations

import heapq
import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from decoding.base.errors import ConfigError
from decoding.drafters.options import AdedOptions
from decoding.drafters.plugin import BuildConfig
from decoding.drafters.pools import Pools
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.gumbel import Coupling
from decoding.speculation.sequence import Sequence
from decoding.speculation.slot import Slot
from decoding.speculation.verify import Verdict

if TYPE_CHECKING:
    from decoding.runtime.models import LoadedModel
    from decoding.runtime.runner import ModelRunner
    from decoding.speculation.stopping import Detokenizer

NO_TOKEN = -1  # the context before a sequence's first token (never a real token id)
Candidates = tuple[list[int], list[float]]  # next tokens, most probable first, and their probabilities


# --- the tri-gram matrix -------------------------------------------------------------------------------


def _merged(own: dict[int, float] | None, base: dict[int, float] | None) -> dict[int, float] | None:
    if own is None or base is None:
        return base if own is None else own
    out = dict(base)
    for c, n in own.items():
        out[c] = out.get(c, 0.0) + n
    return out


class TriGram:
    """Counts C(a, b, c), read as P(c | a, b) = C(a, b, c) / C(a, b) (ADED Eq. 1).

    Back-off: Eq. 1 says nothing for a pair (a, b) never seen. Algorithm 1's rollout looks the next
    words up "using last_word", so an unseen pair backs off to the bigram P(c | b) = C(b, c) / C(b);
    there is no unigram level (the most frequent tokens overall make poor drafts), so a token never
    seen ends its branch. `base` (the corpus) is read-only and its counts add to this matrix's own.
    Only the contexts' `top` most probable next tokens are ever drafted; they are cached per context
    until that context is updated.
    """

    def __init__(self, top: int = 4, capacity: int = 200_000, base: TriGram | None = None) -> None:
        self.top = top
        self.capacity = capacity
        self.base = base
        self.tri: OrderedDict[tuple[int, int], dict[int, float]] = OrderedDict()  # least recently updated first
        self.bi: dict[int, dict[int, float]] = {}
        self._tri_top: dict[tuple[int, int], Candidates] = {}
        self._bi_top: dict[int, Candidates] = {}

    def add(self, a: int, b: int, c: int, weight: float = 1.0) -> None:
        key = (a, b)
        counts = self.tri.get(key)
        if counts is None:
            counts = self.tri[key] = {}
        else:
            self.tri.move_to_end(key)
        counts[c] = counts.get(c, 0.0) + weight
        following = self.bi.setdefault(b, {})
        following[c] = following.get(c, 0.0) + weight
        self._tri_top.pop(key, None)
        self._bi_top.pop(b, None)
        while len(self.tri) > self.capacity:
            old, _ = self.tri.popitem(last=False)
            self._tri_top.pop(old, None)

    def update(self, tokens: list[int], weight: float = 1.0) -> None:
        """Count every tri-gram of a token run (a verified output, a prompt, a corpus text)."""
        for i in range(2, len(tokens)):
            self.add(tokens[i - 2], tokens[i - 1], tokens[i], weight)

    def prime(self, tokens: list[int], start: int = 0) -> None:
        """A prompt's tri-grams ending at `start` or later (what `Pools.prime` calls)."""
        self.update(tokens[max(0, start - 2) :])

    def seen(self, a: int, b: int) -> bool:
        """Whether the pair (a, b) was seen as a tri-gram context (here or in the base)."""
        return (a, b) in self.tri or (self.base is not None and (a, b) in self.base.tri)

    def _counts(self, a: int, b: int) -> dict[int, float] | None:
        """The counts after (a, b), or after b alone when the pair was never seen."""
        base = self.base
        if self.seen(a, b):
            return _merged(self.tri.get((a, b)), base.tri.get((a, b)) if base else None)
        return _merged(self.bi.get(b), base.bi.get(b) if base else None)

    def prob(self, a: int, b: int, c: int) -> float:
        counts = self._counts(a, b)
        return counts.get(c, 0.0) / sum(counts.values()) if counts else 0.0

    def candidates(self, a: int, b: int) -> Candidates:
        """The `top` most probable tokens after (a, b) and their probabilities (ties: the lower id)."""
        if self.seen(a, b):
            hit = self._tri_top.get((a, b))
            if hit is None:
                hit = self._tri_top[(a, b)] = self._top_of(self._counts(a, b))
        else:
            hit = self._bi_top.get(b)
            if hit is None:
                hit = self._bi_top[b] = self._top_of(self._counts(a, b))
        return hit

    def _top_of(self, counts: dict[int, float] | None) -> Candidates:
        if not counts:
            return [], []
        total = sum(counts.values())
        best = heapq.nlargest(self.top, counts.items(), key=lambda kv: (kv[1], -kv[0]))
        return [c for c, _ in best], [n / total for _, n in best]


def read_corpus(path: str, tokenizer: Any) -> list[list[int]]:
    """Token ids of a corpus file, tokenised with the engine's tokenizer (no special tokens added):
    a `.jsonl` file gives each row's string values (a row may also be a plain string), any other
    file its paragraphs (split at blank lines)."""
    text = Path(path).expanduser().read_text(encoding="utf-8")
    pieces: list[str] = []
    if path.endswith(".jsonl"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ConfigError(
                    f"aded.corpus={path}: line {n} is not JSON ({e}); give a JSONL or a text file"
                ) from None
            values = row.values() if isinstance(row, dict) else [row]
            pieces += [v for v in values if isinstance(v, str)]
    else:
        pieces = [p for p in text.split("\n\n") if p.strip()]
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in pieces]


# --- the MCTS draft maker ------------------------------------------------------------------------------


def exploration(visits: float, c1: float, c2: float) -> float:
    """ADED Eq. 3: E = C1 + log((sum_b N(s, b) + C2 + 1) / C2), `visits` = sum_b N(s, b)."""
    return c1 + math.log((visits + c2 + 1) / c2)


def puct(q: float, prior: float, parent_visits: float, visits: int, e: float) -> float:
    """ADED Eq. 2: Q(s, a) + E * P(s, a) * sqrt(sum_b N(s, b)) / (1 + N(s, a))."""
    return q + e * prior * math.sqrt(parent_visits) / (1 + visits)


class Node:
    def __init__(self, token: int, context: tuple[int, int], parent: Node | None, prior: float) -> None:
        self.token = token
        self.context = context  # the last two tokens once this node's token is appended
        self.parent = parent
        self.prior = prior  # P(s, a): the matrix's probability of this token after its parent
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.reach: float = prior if parent is None else parent.reach * prior  # the matrix's path probability
        # Expected accepted tokens of the path down to here, were the matrix the target.
        self.gain: float = 0.0 if parent is None else parent.gain + self.reach
        self.children: list[Node] = []
        self.expanded = False
        self.visits = 0
        self.value = 0.0  # sum of backed-up values
        self.estimate: float | None = None  # this node's own evaluation, once made

    @property
    def q(self) -> float:
        return self.value / self.visits if self.visits else 0.0


class Search:
    """One draft's MCTS (ADED Algorithm 1) from the context (a, b), over `matrix`.

    Choices the paper leaves open:
    - Evaluation: the paper scores a random rollout of the tree's path by 1 + the sum of its
      tri-gram scores. Here the value of a leaf is what the draft is for: the expected number of
      accepted tokens of its path, extended by the matrix's most probable tokens to `max_depth`,
      were the matrix the target (the sum of the path probabilities of the path's prefixes). It is
      deterministic, so a leaf is evaluated once, and no random numbers are drawn.
    - Expansion creates a child per candidate (as the paper does) and goes on from the most probable
      one (the paper: the last one created).
    - Unvisited children have Q = 0; ties in PUCT go to the more probable child.
    """

    def __init__(self, matrix: TriGram, a: int, b: int, options: AdedOptions, max_depth: int) -> None:
        self.matrix = matrix
        self.options = options
        self.max_depth = max_depth
        self.root = Node(b, (a, b), None, 1.0)

    def run(self, coupling: Coupling | None = None) -> DraftTree:
        for _ in range(self.options.iterations):
            self.iterate()
            if not self.root.children:  # the matrix knows nothing after this context
                break
        return most_visited(self.root, self.options.max_nodes, coupling)

    def iterate(self) -> None:
        node = self.root
        while node.children:
            node = self.select(node)
        if not node.expanded and node.depth < self.max_depth:
            self.expand(node)
            if node.children:
                node = node.children[0]
        value = self.evaluate(node)
        up: Node | None = node
        while up is not None:
            up.visits += 1
            up.value += value
            up = up.parent

    def select(self, node: Node) -> Node:
        visits = sum(c.visits for c in node.children)
        e = exploration(visits, self.options.c1, self.options.c2)
        return max(node.children, key=lambda c: puct(c.q, c.prior, visits, c.visits, e))

    def expand(self, node: Node) -> None:
        node.expanded = True
        a, b = node.context
        ids, probs = self.matrix.candidates(a, b)
        node.children = [Node(c, (b, c), node, p) for c, p in zip(ids, probs)]

    def evaluate(self, node: Node) -> float:
        if node.estimate is None:
            value, reach, (a, b) = node.gain, node.reach, node.context
            for _ in range(node.depth, self.max_depth):
                ids, probs = self.matrix.candidates(a, b)
                if not ids:
                    break
                reach *= probs[0]
                value += reach
                a, b = b, ids[0]
            node.estimate = value
        return node.estimate


def most_visited(root: Node, max_nodes: int, coupling: Coupling | None = None) -> DraftTree:
    """The `max_nodes` most visited nodes as a draft tree, parents first, siblings most visited first
    (with `coupling`: by log prior + the target's noise at their position).

    A node is visited at most as often as its parent (every backup through it passes the parent),
    so ranking by visits, then depth, keeps every taken node's parent: the tree is connected.
    """
    visited: list[Node] = []
    stack = list(root.children)
    while stack:
        node = stack.pop()
        if node.visits:
            visited.append(node)
            stack += node.children
    visited.sort(key=lambda n: (-n.visits, n.depth, -n.reach, n.token))
    keep = set(visited[:max_nodes])
    tree = DraftTree(draw="top")
    index = {root: ROOT}
    level = [root]
    for node in level:  # breadth first: parents are added before their children
        kids = sorted((c for c in node.children if c in keep), key=lambda c: (-c.visits, -c.prior, c.token))
        if coupling is not None and len(kids) > 1:
            by_token = {c.token: c for c in kids}
            ids = coupling.order([c.token for c in kids], [math.log(c.prior) for c in kids], node.depth)
            kids = [by_token[t] for t in ids]
        for c in kids:
            index[c] = tree.add(c.token, index[node], c.prior)
            level.append(c)
    return tree


# --- the drafter ---------------------------------------------------------------------------------------


class AdedDrafter:
    """ADED drafting (see the module docstring). `tokenizer` tokenises `options.corpus` once."""

    learns_top = 0  # its update reads no Verdict.top

    def __init__(self, options: AdedOptions, tokenizer: Any = None, coupled: bool = True) -> None:
        self.options = options
        self.coupled = coupled  # verify.rule=match_gumbel: siblings ordered by the target's noise
        self.max_nodes = options.max_nodes
        corpus = None
        if options.corpus is not None:
            corpus = TriGram(options.top_k, options.capacity)
            for ids in read_corpus(options.corpus, tokenizer):
                corpus.update(ids)
        self.matrices = Pools(
            options.scope, options.max_pools, lambda: TriGram(options.top_k, options.capacity, base=corpus)
        )

    def admit(self, slots: list[Slot]) -> None:
        if self.options.prime_with_prompt:
            for slot in slots:
                self.matrices.prime(slot.seq.group, slot.seq.prompt)

    def draft(self, slots: list[Slot]) -> list[DraftTree]:
        return [self._draft(slot.seq) for slot in slots]

    def _draft(self, seq: Sequence) -> DraftTree:
        depth = min(self.options.max_depth, seq.room)
        if depth < 1:
            return DraftTree()
        a, b = [NO_TOKEN, *seq.tail(2)][-2:]
        coupling = seq.coupling() if self.coupled and not seq.params.greedy else None
        return Search(self.matrices.get(seq.group), a, b, self.options, depth).run(coupling)

    def update(self, slots: list[Slot], verdicts: list[Verdict]) -> None:
        """Count the tri-grams that end in the tokens each sequence kept (the bonus token included)."""
        for slot, v in zip(slots, verdicts):
            if v.kept > 0:
                seq = slot.seq
                self.matrices.get(seq.group).update(seq.tail(v.kept + 2), self.options.update_weight)

    def release(self, slots: list[Slot], live: list[Slot]) -> None:
        """Matrices are per group / problem / run, kept across calls: nothing is per sequence."""

    def peak_cache_bytes(self) -> int:
        return 0  # no model, no KV cache


def build(config: BuildConfig, target: ModelRunner, tokenizer: Detokenizer, draft: LoadedModel | None) -> AdedDrafter:
    """`aded`'s drafter (decoding/drafters/builtin.py declares it): aded.corpus, if any, is tokenised with the
    target's tokenizer."""
    return AdedDrafter(config.section("aded"), tokenizer, config.verify.coupled)
