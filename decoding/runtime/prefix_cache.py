"""Keys/values of token sequences computed before, as a radix tree, for any prefix of them.

The KV of a sequence's first n tokens is its cache up to n (attention is causal, and the invariant
forward gives a token the same bits whatever else was computed with it), so a new prompt reuses the
longest prefix it shares with anything stored (SGLang's RadixAttention, on the CPU). Each edge holds
its tokens' KV once: eight thoughts of one prompt store the prompt once. Past the memory budget
(decoding/runtime/memory.py, shared by every store on the model; with paged KV the blocks only the
store holds count, a block a row also holds counts against the KV pool) the least recently used leaves are
evicted (a row holds what it took from a node on its own: a copy, or with paged KV the blocks
themselves, held by count; so no node is ever in use). Leaves wait in a heap by
last use, so an eviction costs a heap pop, not a walk of the tree. A finished sequence whose
follow-up is on its way (an in-context evaluation of a thought) is pinned until it is admitted.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from decoding.runtime.kv_cache import KVCache, Segment
from decoding.runtime.memory import MemoryBudget
from decoding.runtime.paged_kv import BlockPool

DEFAULT_BYTES = 4 << 30  # a store built without a budget (tests, tools): its own 4 GiB


def shared_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix (binary search on slice equality: compared in C, not per token)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]  # the edge from the parent
    kv: Segment | None  # its tokens' keys and values (None: the root)
    hidden: torch.Tensor | None  # [len(tokens), hidden size]: the captured layer's output, if kept
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)  # by first token
    used: int = 0  # the budget's clock at the last match or store through this node
    alive: bool = True  # False once evicted
    pins: int = 0  # stored sequences ending here that wait for a follow-up: not evictable

    @property
    def hidden_bytes(self) -> int:
        return 0 if self.hidden is None else self.hidden.nbytes

    @property
    def nbytes(self) -> int:
        return (0 if self.kv is None else self.kv.nbytes) + self.hidden_bytes


@dataclass(frozen=True)
class Match:
    """The stored path a sequence's prefix follows: (node, tokens used of its edge) from the root."""

    path: tuple[tuple[_Node, int], ...] = ()

    @property
    def length(self) -> int:
        return sum(n for _, n in self.path)


class PrefixCache:
    def __init__(self, budget: MemoryBudget | None = None, pool: BlockPool | None = None) -> None:
        self.budget = budget if budget is not None else MemoryBudget(DEFAULT_BYTES)
        self.budget.stores.add(self)
        self.pool = pool  # the blocks its segments hold, with paged KV
        self._bytes = 0  # its nodes' bytes
        self._hidden_bytes = 0
        self.root = _Node((), None, None)
        self.nodes = 0
        # (last use, order, node) for leaves; an entry is stale once its node was used again,
        # got a child or was evicted, and is skipped when it reaches the top.
        self._leaves: list[tuple[int, int, _Node]] = []
        self._order = itertools.count()
        self._pinned: dict[tuple[int, ...], _Node] = {}  # by the key given to `store`, oldest first

    @property
    def max_bytes(self) -> int:
        return self.budget.max_bytes

    @property
    def nbytes(self) -> int:
        """What counts against the budget: every node's copy; with paged KV the blocks no row holds."""
        if self.pool is None:
            return self._bytes
        return self.pool.held_by_store_alone() * self.pool.block_bytes + self._hidden_bytes

    def match(self, tokens: tuple[int, ...] | list[int]) -> Match:
        """The longest stored prefix of `tokens` (possibly ending inside an edge)."""
        with self.budget.lock:
            return self._match(tuple(tokens))

    def _match(self, tokens: tuple[int, ...]) -> Match:
        node, i, path = self.root, 0, []
        clock = self.budget.tick()
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            n = shared_len(child.tokens, tokens[i:])
            path.append((child, n))
            child.used = clock
            i += n
            if n < len(child.tokens):
                break
            node = child
        if path and not path[-1][0].children:
            self._push(path[-1][0])
        return Match(tuple(path))

    def restore(self, match: Match, cache: KVCache, row: int, start: int, end: int) -> torch.Tensor | None:
        """Positions [start, end) of a matched prefix into a cache row (copied, or its blocks held),
        which then holds `end` committed tokens; returns the captured hidden states of those
        positions (or None)."""
        assert end <= match.length
        hidden, pieces, offset = [], [], 0
        for node, n in match.path:
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                pieces.append((node.kv, lo, hi))
                if node.hidden is not None:
                    hidden.append(node.hidden[lo - offset : hi - offset])
            offset += n
        cache.restore(row, pieces, start, end)
        return torch.cat(hidden) if hidden else None

    def store(
        self,
        tokens: tuple[int, ...],
        cache: KVCache,
        row: int = 0,
        hidden: torch.Tensor | None = None,
        pin: tuple[int, ...] | None = None,
    ) -> None:
        """Keep the first len(tokens) committed positions of a cache row as the KV of `tokens`
        (`hidden`: the captured layer's output at those positions); only the part not stored yet
        is copied. With `pin` (a key: the sequence a follow-up will name) they stay until
        `unpin(pin)`, or until pins alone would pass the budget (the oldest pin goes first)."""
        with self.budget.lock:
            self._store(tokens, cache, row, hidden, pin)

    def _store(
        self,
        tokens: tuple[int, ...],
        cache: KVCache,
        row: int,
        hidden: torch.Tensor | None,
        pin: tuple[int, ...] | None,
    ) -> None:
        n = len(tokens)
        assert n <= int(cache.lens[row]), "only committed positions can be stored"
        match = self.match(tokens)
        node, done = self.root, 0
        if match.path:
            last, used = match.path[-1]
            node = self._split(last, used) if used < len(last.tokens) else last
            done = match.length
        if done == n:
            if pin is not None and node is not self.root:
                self._pin(pin, node)
            return

        leaf = _Node(
            tokens[done:],
            cache.segment(row, done, n),
            None if hidden is None else hidden[done:n].clone(),
            parent=node,
            used=self.budget.clock,
        )
        if leaf.nbytes > self.max_bytes:
            assert leaf.kv is not None
            leaf.kv.release()
            return
        node.children[leaf.tokens[0]] = leaf
        self._bytes += leaf.nbytes
        self._hidden_bytes += leaf.hidden_bytes
        self.nodes += 1
        self._push(leaf)
        if pin is not None:
            self._pin(pin, leaf)
        self.budget.make_room()

    def _pin(self, key: tuple[int, ...], node: _Node) -> None:
        if key in self._pinned:
            self.unpin(key)
        self._pinned[key] = node
        node.pins += 1

    def unpin(self, key: tuple[int, ...]) -> None:
        """The follow-up of the sequence stored under `key` was admitted: it may be evicted again."""
        with self.budget.lock:
            self._unpin(key)

    def _unpin(self, key: tuple[int, ...]) -> None:
        node = self._pinned.pop(key, None)
        if node is None:
            return
        node.pins -= 1
        if not node.pins and node.alive and not node.children:
            self._push(node)

    def drop_oldest_pin(self) -> bool:
        """Unpin the oldest pinned sequence (pins alone fill the budget); whether there was one."""
        if not self._pinned:
            return False
        self.unpin(next(iter(self._pinned)))
        return True

    @property
    def pinned(self) -> int:
        return len(self._pinned)

    def sequences(self) -> list[tuple[int, ...]]:
        """The stored sequences: the token path to every leaf."""
        out: list[tuple[int, ...]] = []

        def walk(node: _Node, prefix: tuple[int, ...]) -> None:
            if not node.children and node is not self.root:
                out.append(prefix)
            for child in node.children.values():
                walk(child, prefix + child.tokens)

        walk(self.root, ())
        return out

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut an edge after its first k tokens; returns the new node holding those k."""
        assert node.parent is not None and node.kv is not None
        head_kv, node_kv = node.kv.split(k)
        head = _Node(
            node.tokens[:k],
            head_kv,
            None if node.hidden is None else node.hidden[:k].clone(),
            parent=node.parent,
            used=node.used,
        )
        before = node.nbytes
        node.tokens = node.tokens[k:]
        node.kv = node_kv
        node.hidden = None if node.hidden is None else node.hidden[k:].clone()
        node.parent.children[head.tokens[0]] = head
        head.children[node.tokens[0]] = node
        node.parent = head
        self._bytes += head.nbytes + node.nbytes - before
        self.nodes += 1
        return head

    def _push(self, leaf: _Node) -> None:
        heapq.heappush(self._leaves, (leaf.used, next(self._order), leaf))
        if len(self._leaves) > 4 * self.nodes + 1024:  # mostly stale entries: keep the live ones
            self._leaves = [e for e in self._leaves if self._current(e)]
            heapq.heapify(self._leaves)

    @staticmethod
    def _current(entry: tuple[int, int, _Node]) -> bool:
        used, _, node = entry
        return node.alive and not node.children and not node.pins and node.used == used

    def oldest(self) -> int | None:
        """The last use of the least recently used leaf (None: nothing stored)."""
        while self._leaves and not self._current(self._leaves[0]):
            heapq.heappop(self._leaves)
        return self._leaves[0][0] if self._leaves else None

    def evict(self) -> None:
        """Drop the least recently used leaf."""
        if self.oldest() is None:
            return
        _, _, leaf = heapq.heappop(self._leaves)
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.tokens[0]]
        leaf.alive = False
        self._bytes -= leaf.nbytes
        self._hidden_bytes -= leaf.hidden_bytes
        assert leaf.kv is not None
        leaf.kv.release()
        self.nodes -= 1
        if parent is not self.root and not parent.children:
            self._push(parent)

    def clear(self) -> None:
        """Drop everything stored (its blocks let go), pins included."""
        self._pinned.clear()
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.alive = False
            if node.kv is not None:
                node.kv.release()
        self.root.children.clear()
        self._leaves.clear()
        self._bytes = self._hidden_bytes = self.nodes = 0
