"""The matched rules' tree walk where the logits are: what comes back is each row's accepted path
and token, not every node's target.

`walk_matched` (acceptance.py) goes down a tree on the host: at each node, the first child whose
token is the target's own token there. Given every node's target at once (verify.device_targets),
the same walk is tensor operations over all rows: a node is kept when its token is its parent's
target, it is the first of its siblings with that token, and every ancestor is kept; the kept nodes
of a row are one chain from the root (its parent's target is one token), so the row's path ends at
its deepest kept node and its token is the target after that node. The ancestors' test is pointer
jumping (log2 of the depth rounds). The step reads back, in one transfer, each row's path length,
last node and token, and the top tokens along its path where a drafter learns them (`read_walks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from decoding.speculation.draft_tree import ROOT, DraftTree


def tree_layout(trees: list[DraftTree]) -> tuple[np.ndarray, int]:
    """The rows' trees as one int64 array [4, B, N] (N the largest tree): each node's parent as an
    index into the padded nodes (-1 for the root's children and padding), its token (-1: padding),
    its depth, and 1 where it is the first of its siblings with its token (a later one can never be
    the walk's pick); and the largest depth."""
    n = max(len(t) for t in trees)
    out = np.zeros((4, len(trees), n), dtype=np.int64)
    out[0] = -1
    out[1] = -1
    keys = []
    for b, t in enumerate(trees):
        m = len(t)
        if not m:
            continue
        parents = np.asarray(t.parents, dtype=np.int64)
        out[0, b, :m] = np.where(parents == ROOT, -1, parents + b * n)
        out[1, b, :m] = t.tokens
        out[2, b, :m] = t.depths()
        keys.append(((b * (n + 1) + parents + 1) << 32) | out[1, b, :m])
    if keys:
        _, first = np.unique(np.concatenate(keys), return_index=True)
        flat_index = np.concatenate([b * n + np.arange(len(t)) for b, t in enumerate(trees) if len(t)])
        out[3].reshape(-1)[flat_index[first]] = 1
    return out, int(out[2].max()) if n else 0


@dataclass(frozen=True)
class Walks:
    """Every row's matched walk where its targets are, not yet read back."""

    length: torch.Tensor  # [B] accepted nodes
    node: torch.Tensor  # [B] the deepest accepted node (any where length is 0)
    token: torch.Tensor  # [B] the target after the path
    on_path: torch.Tensor  # [B, N] bool: the accepted nodes
    depth: torch.Tensor  # [B, N] each node's depth (0: padding)
    max_depth: int

    def logit_rows(self) -> torch.Tensor:
        """[B, 1 + D]: each row's logits rows along its path (0 the root, 1 + node), then 0s past it."""
        if not self.max_depth:
            return torch.zeros(len(self.length), 1, dtype=torch.long, device=self.length.device)
        levels = torch.arange(1, self.max_depth + 1, device=self.depth.device)
        at = self.on_path[:, None, :] & (self.depth[:, None, :] == levels[None, :, None])  # [B, D, N]
        nodes = torch.where(at.any(-1), 1 + at.to(torch.int8).argmax(-1), 0)
        return torch.cat([torch.zeros_like(nodes[:, :1]), nodes], 1)


def walk_matched_rows(trees: list[DraftTree], targets: torch.Tensor) -> Walks:
    """`walk_matched` for every row at once, on the targets' device with no read-back: `targets` holds
    each row's target at its root and after each node ([1 + N_b] a row, rows concatenated in order)."""
    sizes = [1 + len(t) for t in trees]
    offsets = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
    device = targets.device
    if max(sizes) == 1:  # no row drafted: each row's token is its root's target
        none = torch.zeros(len(trees), 0, dtype=torch.long, device=device)
        zeros = torch.zeros(len(trees), dtype=torch.long, device=device)
        return Walks(zeros, zeros, targets, none.bool(), none, 0)
    layout, max_depth = tree_layout(trees)
    uploaded = torch.from_numpy(np.concatenate([layout.reshape(-1), offsets]))
    if device.type == "cuda":  # from pinned memory the host queues the copy without waiting for the forward
        uploaded = uploaded.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        uploaded = uploaded.to(device)
    b, n = layout.shape[1:]
    parent, tokens, depth, first = uploaded[: 4 * b * n].view(4, b, n).unbind(0)
    starts = uploaded[4 * b * n :]
    # The target after each node's parent: the row's root target for the root's children.
    after = torch.where(parent >= 0, parent % n + 1, 0) + starts[:, None]
    kept = (targets[after] == tokens) & (first > 0) & (tokens >= 0)
    # Pointer jumping: each round a node takes in its current ancestor's verdict and jumps twice as far.
    up = parent.reshape(-1)
    ok = kept.reshape(-1)
    for _ in range(max(1, max_depth - 1).bit_length()):
        has = up >= 0
        at = up.clamp(min=0)
        ok = ok & (~has | ok[at])
        up = torch.where(has, up[at], up)
    on_path = ok.view(b, n)
    length, node = torch.where(on_path, depth, 0).max(1)
    token = targets[torch.where(length > 0, starts + 1 + node, starts)]
    return Walks(length, node, token, on_path, depth, max_depth)


def read_walks(
    trees: list[DraftTree], walks: Walks, tops: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[list[tuple[list[int], int]], list[tuple[list[list[int]], list[list[float]]]] | None]:
    """The step's one read-back: per row its accepted nodes (root's child first) and the token after
    them, exactly as `walk_matched` returns them; with `tops` (values and ids [B, 1 + D, k] at
    `Walks.logit_rows`), each row's top tokens and probabilities at its root and along its path."""
    parts = [torch.stack([walks.length, walks.node, walks.token]).reshape(-1).double()]
    if tops is not None:
        # float64 holds every id and float32 probability exactly: one transfer for both
        parts += [tops[1].reshape(-1).double(), tops[0].reshape(-1).double()]
    flat = torch.cat(parts).cpu()
    n_rows = len(trees)
    lengths, nodes, tokens = flat[: 3 * n_rows].long().view(3, n_rows).tolist()
    walked = [(tree.path(nd) if ln else [], token) for tree, ln, nd, token in zip(trees, lengths, nodes, tokens)]
    if tops is None:
        return walked, None
    shape = tops[0].shape
    size = shape.numel()
    ids = flat[3 * n_rows : 3 * n_rows + size].long().view(shape).tolist()
    values = flat[3 * n_rows + size :].float().view(shape).tolist()
    return walked, [(i[: 1 + len(path)], v[: 1 + len(path)]) for (path, _), i, v in zip(walked, ids, values)]
