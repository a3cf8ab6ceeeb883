"""Rows of (pending tokens, draft tree) laid out for one forward.

Rows are packed left-padded so that every row's last pending token (the tree root) sits at the same
index, which lets one `logits_to_keep` index serve the whole batch; trees of different sizes are
padded on the right. Pad slots only see themselves and are never committed. Where the forward can
skip pads (the project's Llama layers: `ModelRunner.ragged`), `real` lists the slots it computes,
so a forward costs the tokens its rows hold rather than rows x the widest row.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class Tree(Protocol):
    """What packing reads of a draft tree (speculation's DraftTree): its tokens, each node's depth
    below the root and its ancestry matrix (a node sees itself and its ancestors)."""

    @property
    def tokens(self) -> Sequence[int]: ...

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
        firsts = [b * width + p for b, p in enumerate(self.pads)]
        return _runs(firsts, self.sizes)

    def real_logits_index(self) -> tuple[torch.Tensor, list[int]]:
        """Indices into the real slots of every row's root and tree nodes, and each row's count."""
        starts = itertools.accumulate(self.sizes[:-1], initial=0)
        roots = [start + self.n_pending - 1 - pad for start, pad in zip(starts, self.pads)]
        counts = [size - (self.n_pending - 1 - pad) for size, pad in zip(self.sizes, self.pads)]
        return _runs(roots, counts), counts

    def committed(self, row: int, path: list[int]) -> list[int]:
        """Columns to keep in the cache when `path` (tree nodes) is accepted: pending, then path."""
        return list(range(self.pads[row], self.n_pending)) + [self.n_pending + i for i in path]


def _runs(firsts: list[int], counts: list[int]) -> torch.Tensor:
    """first, first + 1, ..., first + count - 1 for each run, one run after another (built as a
    list: a handful of tensor operations cost more than the list for a step's few dozen indices)."""
    return torch.tensor([i for first, n in zip(firsts, counts) for i in range(first, first + n)], dtype=torch.long)


def pack(pending: list[list[int]], trees: Sequence[Tree] | None = None) -> Packed:
    """The rows laid out (see the module's doc); without `trees`, the pending tokens alone. Built
    from whole-batch tensors, with a call per row only for the trees' ancestry (a few calls per row
    made most of `ar`'s step at 32 rows on a small model)."""
    n_pending = max(len(p) for p in pending)
    if n_pending == 1 and not any(len(t) for t in trees or ()):  # plain decoding's step: a token a row
        batch = len(pending)
        arrays = (np.array(pending), np.ones((batch, 1, 1), dtype=bool), np.zeros((batch, 1), dtype=np.int64))
        one_tokens, one_see, one_depth = (torch.from_numpy(a) for a in arrays)  # numpy's calls: a tenth of torch's
        return Packed(one_tokens, one_see, one_depth, 1, [0] * batch, [1] * batch)
    trees = trees if trees is not None else [_NO_TREE] * len(pending)
    sizes_tree = [len(t) for t in trees]
    width = n_pending + max(sizes_tree, default=0)
    pads = [n_pending - len(p) for p in pending]
    tokens: list[list[int]] = []
    depth: list[list[int]] = []
    for pend, tree, pad, n in zip(pending, trees, pads, sizes_tree):
        fill = [0] * (width - n_pending - n)
        tokens.append([0] * pad + pend + list(tree.tokens) + fill)
        tree_depth = [len(pend) - 1 + d for d in tree.depths()] if n else []
        depth.append([0] * pad + list(range(len(pend))) + tree_depth + fill)
    # Built in numpy (a call costs a tenth of torch's on these small arrays), handed over uncopied.
    cols = np.arange(width)
    pad_a = np.array(pads)
    ends = n_pending + np.array(sizes_tree)
    real_pending = (cols >= pad_a[:, None]) & (cols < n_pending)  # [B, W]: the pending tokens' columns
    in_tree = (cols >= n_pending) & (cols < ends[:, None])  # [B, W]: the tree's columns
    # A pending token sees the pending tokens up to itself; a node sees them all (then its ancestors).
    see = real_pending[:, None, :] & ((cols[:, None] >= cols[None, :]) | in_tree[:, :, None])
    see &= real_pending[:, :, None] | in_tree[:, :, None]
    see |= np.eye(width, dtype=bool)
    for b, (tree, n) in enumerate(zip(trees, sizes_tree)):
        if n:
            see[b, n_pending : n_pending + n, n_pending : n_pending + n] = tree.ancestry().numpy()
    sizes = [len(p) + n for p, n in zip(pending, sizes_tree)]
    return Packed(
        torch.from_numpy(np.array(tokens)),
        torch.from_numpy(see),
        torch.from_numpy(np.array(depth)),
        n_pending,
        pads,
        sizes,
    )


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
