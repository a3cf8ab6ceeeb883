"""Rows of (pending tokens, draft tree) laid out for one forward.

Rows are packed left-padded so that every row's last pending token (the tree root) sits at the same
index, which lets one `logits_to_keep` index serve the whole batch; trees of different sizes are
padded on the right. Pad slots only see themselves and are never committed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.core.draft_tree import DraftTree


@dataclass
class Packed:
    """A batch of (pending tokens, tree) rows laid out for one forward."""

    tokens: torch.Tensor  # [B, W]
    see: torch.Tensor  # [B, W, W] bool
    depth: torch.Tensor  # [B, W] position offset from each row's committed length
    n_pending: int  # P: columns before the trees; column P - 1 is every row's root
    pads: list[int]  # left pad of each row

    def committed(self, row: int, path: list[int]) -> list[int]:
        """Columns to keep in the cache when `path` (tree nodes) is accepted: pending, then path."""
        return list(range(self.pads[row], self.n_pending)) + [self.n_pending + i for i in path]


def pack(pending: list[list[int]], trees: list[DraftTree]) -> Packed:
    n_pending = max(len(p) for p in pending)
    n_tree = max((len(t) for t in trees), default=0)
    width = n_pending + n_tree
    batch = len(pending)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    see = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)
    depth = torch.zeros(batch, width, dtype=torch.long)
    pads = []
    for b, (pend, tree) in enumerate(zip(pending, trees)):
        pad = n_pending - len(pend)
        pads.append(pad)
        tokens[b, pad:n_pending] = torch.tensor(pend)
        see[b, pad:n_pending, pad:n_pending] = torch.ones(len(pend), len(pend), dtype=torch.bool).tril()
        depth[b, pad:n_pending] = torch.arange(len(pend))
        n = len(tree)
        if n:
            end = n_pending + n
            tokens[b, n_pending:end] = torch.tensor(tree.tokens)
            see[b, n_pending:end, pad:n_pending] = True
            see[b, n_pending:end, n_pending:end] = tree.ancestry()
            depth[b, n_pending:end] = len(pend) - 1 + torch.tensor(tree.depths())
    return Packed(tokens, see, depth, n_pending, pads)
