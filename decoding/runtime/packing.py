"""Rows of (pending tokens, draft tree) laid out for one forward.

Rows are packed left-padded so that every row's last pending token (the tree root) sits at the same
index, which lets one `logits_to_keep` index serve the whole batch; trees of different sizes are
padded on the right. Pad slots only see themselves and are never committed. Where the forward can
skip pads (the project's Llama layers: `ModelRunner.ragged`), `real` lists the slots it computes,
so a forward costs the tokens its rows hold rather than rows x the widest row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class Tree(Protocol):
    """What packing reads of a draft tree (speculation's DraftTree): its tokens, each node's depth
    below the root and its ancestry matrix (a node sees itself and its ancestors)."""

    tokens: list[int]

    def __len__(self) -> int: ...

    def depths(self) -> list[int]: ...

    def ancestry(self) -> torch.Tensor: ...


@dataclass
class Packed:
    """A batch of (pending tokens, tree) rows laid out for one forward."""

    tokens: torch.Tensor  # [B, W]
    see: torch.Tensor  # [B, W, W] bool
    depth: torch.Tensor  # [B, W] position offset from each row's committed length
    n_pending: int  # P: columns before the trees; column P - 1 is every row's root
    pads: list[int]  # left pad of each row
    sizes: list[int]  # real tokens of each row (pending, then tree)

    @property
    def real(self) -> torch.Tensor:
        """Flat indices into [B, W] of the real (not pad) slots, row by row."""
        width = self.tokens.shape[1]
        return torch.cat([torch.arange(p, p + n) + b * width for b, (p, n) in enumerate(zip(self.pads, self.sizes))])

    def real_logits_index(self) -> tuple[torch.Tensor, list[int]]:
        """Indices into the real slots of every row's root and tree nodes, and each row's count."""
        index, start = [], 0
        for size, pad in zip(self.sizes, self.pads):
            root = start + self.n_pending - 1 - pad
            index.append(torch.arange(root, start + size))
            start += size
        counts = [len(i) for i in index]
        return torch.cat(index), counts

    def committed(self, row: int, path: list[int]) -> list[int]:
        """Columns to keep in the cache when `path` (tree nodes) is accepted: pending, then path."""
        return list(range(self.pads[row], self.n_pending)) + [self.n_pending + i for i in path]


def pack(pending: list[list[int]], trees: Sequence[Tree] | None = None) -> Packed:
    """The rows laid out (see the module's doc); without `trees`, the pending tokens alone."""
    trees = trees if trees is not None else [_NO_TREE] * len(pending)
    n_pending = max(len(p) for p in pending)
    n_tree = max((len(t) for t in trees), default=0)
    width = n_pending + n_tree
    batch = len(pending)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    see = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)
    depth = torch.zeros(batch, width, dtype=torch.long)
    pads, sizes = [], []
    for b, (pend, tree) in enumerate(zip(pending, trees)):
        pad = n_pending - len(pend)
        pads.append(pad)
        tokens[b, pad:n_pending] = torch.tensor(pend)
        see[b, pad:n_pending, pad:n_pending] = torch.ones(len(pend), len(pend), dtype=torch.bool).tril()
        depth[b, pad:n_pending] = torch.arange(len(pend))
        n = len(tree)
        sizes.append(len(pend) + n)
        if n:
            end = n_pending + n
            tokens[b, n_pending:end] = torch.tensor(tree.tokens)
            see[b, n_pending:end, pad:n_pending] = True
            see[b, n_pending:end, n_pending:end] = tree.ancestry()
            depth[b, n_pending:end] = len(pend) - 1 + torch.tensor(tree.depths())
    return Packed(tokens, see, depth, n_pending, pads, sizes)


@dataclass(frozen=True)
class _Empty:
    tokens: tuple[int, ...] = ()

    def __len__(self) -> int:
        return 0

    def depths(self) -> list[int]:
        return []

    def ancestry(self) -> torch.Tensor:
        return torch.zeros(0, 0, dtype=torch.bool)


_NO_TREE = _Empty()
