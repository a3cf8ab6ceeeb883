"""Batched tree verification: one target forward scores a draft tree for each of many rows.

Each row feeds its pending tokens (not yet in the target's cache: the last committed token, or a
whole prompt on the first step) followed by its tree. Rows are packed left-padded so that every
row's last pending token (the tree root) sits at the same index, which lets one `logits_to_keep`
index serve the whole batch; trees of different sizes are padded on the right. Pad slots only see
themselves and are never committed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.core.acceptance import walk
from decoding.core.draft_tree import DraftTree
from decoding.core.kv_cache import RowKVCache
from decoding.core.runner import ModelRunner
from decoding.core.sampling import SamplingParams, process_logits


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


@dataclass
class Verdict:
    """What verification decided for one row."""

    tree: DraftTree
    path: list[int]  # accepted nodes, root's child first
    token: int  # the token after them (bonus or residual draw)
    # Target distributions after processing, at the root and at each node [1 + N, V] (None for
    # greedy rows, where only the argmax matters); cross-trajectory drafters learn from them.
    probs: torch.Tensor | None
    logits: torch.Tensor  # raw target logits at the same places
    kept: int = 0  # tokens the sequence kept (stop rules may cut the accepted run); set on commit
    # With ModelRunner.capture_hidden: the captured layer's hidden states of the tokens this step put in
    # the target's cache (the pending tokens, then the accepted path) [P + len(path), H]; EDD reads them.
    hidden: torch.Tensor | None = None

    @property
    def tokens(self) -> list[int]:
        return [self.tree.tokens[i] for i in self.path] + [self.token]

    def kept_rows(self) -> list[int]:
        """Rows of `probs` / `logits` whose distributions predicted the kept tokens, in order."""
        return [0, *(1 + n for n in self.path)][: self.kept]


def verify(
    target: ModelRunner,
    cache: RowKVCache,
    pending: list[list[int]],
    trees: list[DraftTree],
    params: list[SamplingParams],
    generators: list[torch.Generator],
    rows: list[int] | None = None,
) -> tuple[Packed, list[Verdict]]:
    """Score every row's tree in one forward and run the acceptance rule on each.

    `rows` are the cache rows verified (default: all, in order). The cache holds the new entries
    uncommitted; the caller commits `packed.committed(b, path)` for the rows that go on.
    """
    packed = pack(pending, trees)
    keep = torch.arange(packed.n_pending - 1, packed.tokens.shape[1])
    logits = target.forward(cache, packed.tokens, packed.see, packed.depth, logits_at=keep, rows=rows)
    hidden = target.last_hidden if target.hidden_layer is not None else None
    verdicts = []
    for b, (tree, p, g) in enumerate(zip(trees, params, generators)):
        row = logits[b, : 1 + len(tree)]
        if p.greedy:
            path, token = walk(tree, None, row.argmax(-1).tolist(), g)
            probs = None
        else:
            # On the CPU, where the request's generator lives: the acceptance walk is scalar work.
            probs = process_logits(row[None], [p])[0].cpu()
            path, token = walk(tree, probs, None, g)
        kept_hidden = None if hidden is None else hidden[b, packed.committed(b, path)]
        verdicts.append(Verdict(tree, path, token, probs, row, hidden=kept_hidden))
    return packed, verdicts
