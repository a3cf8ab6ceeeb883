"""Keys/values of token sequences computed before, as a radix tree, for any prefix of them.

The KV of a sequence's first n tokens is its cache up to n (attention is causal, and the invariant
forward gives a token the same bits whatever else was computed with it), so a new prompt reuses the
longest prefix it shares with anything stored (SGLang's RadixAttention, on the CPU). Each edge holds
its tokens' KV once: eight thoughts of one prompt store the prompt once. Past `max_bytes` the least
recently used leaves are evicted (the KV is copied into a row on use, so no node is ever in use).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decoding.core.kv_cache import RowKVCache


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
    keys: list[torch.Tensor]  # per layer [H_kv, len(tokens), D]
    values: list[torch.Tensor]
    hidden: torch.Tensor | None  # [len(tokens), hidden size]: the captured layer's output, if kept
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)  # by first token
    used: int = 0  # the store's clock at the last match or store through this node

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values) + (0 if self.hidden is None else self.hidden.nbytes)


@dataclass(frozen=True)
class Match:
    """The stored path a sequence's prefix follows: (node, tokens used of its edge) from the root."""

    path: tuple[tuple[_Node, int], ...] = ()

    @property
    def length(self) -> int:
        return sum(n for _, n in self.path)


class PrefixCache:
    def __init__(self, max_bytes: int = 4 << 30) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.root = _Node((), [], [], None)
        self.clock = 0

    def match(self, tokens: tuple[int, ...] | list[int]) -> Match:
        """The longest stored prefix of `tokens` (possibly ending inside an edge)."""
        tokens, node, i, path = tuple(tokens), self.root, 0, []
        self.clock += 1
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            n = shared_len(child.tokens, tokens[i:])
            path.append((child, n))
            child.used = self.clock
            i += n
            if n < len(child.tokens):
                break
            node = child
        return Match(tuple(path))

    def restore(self, match: Match, cache: RowKVCache, row: int, start: int, end: int) -> torch.Tensor | None:
        """Copy positions [start, end) of a matched prefix into a cache row, which then holds `end`
        committed tokens; returns the captured hidden states of those positions (or None)."""
        assert end <= match.length
        hidden, offset = [], 0
        for node, n in match.path:
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                for dst, src in zip(cache.keys, node.keys):
                    dst[row, :, lo:hi] = src[:, lo - offset : hi - offset]
                for dst, src in zip(cache.values, node.values):
                    dst[row, :, lo:hi] = src[:, lo - offset : hi - offset]
                if node.hidden is not None:
                    hidden.append(node.hidden[lo - offset : hi - offset])
            offset += n
        cache.lens[row] = end
        return torch.cat(hidden) if hidden else None

    def store(
        self, tokens: tuple[int, ...], cache: RowKVCache, row: int = 0, hidden: torch.Tensor | None = None
    ) -> None:
        """Keep the first len(tokens) committed positions of a cache row as the KV of `tokens`
        (`hidden`: the captured layer's output at those positions); only the part not stored yet
        is copied."""
        n = len(tokens)
        assert n <= int(cache.lens[row]), "only committed positions can be stored"
        match = self.match(tokens)
        node, done = self.root, 0
        if match.path:
            last, used = match.path[-1]
            node = self._split(last, used) if used < len(last.tokens) else last
            done = match.length
        if done == n:
            return

        def part(t: torch.Tensor) -> torch.Tensor:
            return t[row, :, done:n].clone()

        leaf = _Node(
            tokens[done:],
            [part(k) for k in cache.keys],
            [part(v) for v in cache.values],
            None if hidden is None else hidden[done:n].clone(),
            parent=node,
            used=self.clock,
        )
        if leaf.nbytes > self.max_bytes:
            return
        node.children[leaf.tokens[0]] = leaf
        self.nbytes += leaf.nbytes
        while self.nbytes > self.max_bytes:
            self._evict()

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
        assert node.parent is not None
        head = _Node(
            node.tokens[:k],
            [t[:, :k].clone() for t in node.keys],
            [t[:, :k].clone() for t in node.values],
            None if node.hidden is None else node.hidden[:k].clone(),
            parent=node.parent,
            used=node.used,
        )
        before = node.nbytes
        node.tokens = node.tokens[k:]
        node.keys = [t[:, k:].clone() for t in node.keys]
        node.values = [t[:, k:].clone() for t in node.values]
        node.hidden = None if node.hidden is None else node.hidden[k:].clone()
        node.parent.children[head.tokens[0]] = head
        head.children[node.tokens[0]] = node
        node.parent = head
        self.nbytes += head.nbytes + node.nbytes - before
        return head

    def _evict(self) -> None:
        """Drop the least recently used leaf."""
        leaves = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        leaf = min(leaves, key=lambda x: x.used)
        assert leaf.parent is not None
        del leaf.parent.children[leaf.tokens[0]]
        self.nbytes -= leaf.nbytes
