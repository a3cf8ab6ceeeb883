"""The matched rules' tree walk where the logits are: what comes back is each row's accepted path
and token, not every node's target.

`walk_matched` (acceptance.py) goes down a tree on the host: at each node, the first child whose
token is the target's own token there. Given every node's target at once (verify.device_targets),
the same walk is tensor operations over all rows: a node is kept when its token is its parent's
target, it is the first of its siblings with that token, and every ancestor is kept; the kept nodes
of a row are one chain from the root (its parent's target is one token), so the row's path ends at
its deepest kept node and its token is the target after that node. The ancestors' test is pointer
jumping (log2 of the depth rounds); the step reads back three numbers a row in one transfer.
"""

from __future__ import annotations

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


def walk_matched_rows(trees: list[DraftTree], targets: torch.Tensor) -> list[tuple[list[int], int]]:
    """`walk_matched` for every row at once: `targets` holds each row's target at its root and after
    each node ([1 + N_b] a row, rows concatenated in order, on any device); per row its accepted nodes
    (root's child first) and the token after them, exactly as the host's walk returns them."""
    sizes = [1 + len(t) for t in trees]
    starts_np = np.cumsum([0, *sizes[:-1]], dtype=np.int64)
    device = targets.device
    if max(sizes) == 1:  # no row drafted: each row's token is its root's target
        return [([], token) for token in targets.tolist()]
    layout, max_depth = tree_layout(trees)
    both = np.concatenate([layout.reshape(-1), starts_np])
    uploaded = torch.from_numpy(both)
    if device.type == "cuda":  # from pinned memory the copy waits on nothing the stream runs
        uploaded = uploaded.pin_memory().to(device, non_blocking=True)
    b, n = layout.shape[1:]
    parent, tokens, depth, first = uploaded[: 4 * b * n].view(4, b, n).unbind(0)
    starts = uploaded[4 * b * n :]
    parent_flat = parent.reshape(-1)
    # The target after each node's parent: the row's root target for the root's children.
    after = torch.where(parent >= 0, parent % n + 1, 0) + starts[:, None]
    kept = (targets[after] == tokens) & (first > 0) & (tokens >= 0)
    # Pointer jumping: each round a node takes in its current ancestor's verdict and jumps twice as far.
    up = parent_flat.clone()
    ok = kept.reshape(-1).clone()
    for _ in range(max(1, max_depth - 1).bit_length()):
        has = up >= 0
        at = up.clamp(min=0)
        ok = ok & (~has | ok[at])
        up = torch.where(has, up[at], up)
    deep = torch.where(ok.view(b, n), depth, 0)
    length, node = deep.max(1)
    last = torch.where(length > 0, starts + 1 + node, starts)
    read = torch.stack([length, node, targets[last]]).tolist()  # the step's one read-back
    return [(tree.path(nd) if ln else [], token) for tree, ln, nd, token in zip(trees, *read)]
