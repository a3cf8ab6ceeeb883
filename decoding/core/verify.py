"""Batched tree verification: one target forward scores a draft tree for each of many rows.

Each row feeds its pending tokens (not yet in the target's cache: the last committed token, or more
on a row's first step) followed by its tree, packed as decoding/core/packing.py lays them out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.core.acceptance import walk
from decoding.core.draft_tree import DraftTree
from decoding.core.kv_cache import RowKVCache
from decoding.core.packing import Packed, pack
from decoding.core.runner import ModelRunner
from decoding.core.sampling import SamplingParams, process_logits


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
    # Where the step planner cut the drafted tree: each verified node's node in the tree the drafter
    # drew (None: verified whole). Drafters that keep per-node state read `drafted_path`.
    drafted_nodes: list[int] | None = None

    @property
    def drafted_path(self) -> list[int]:
        """The accepted nodes as nodes of the tree the drafter drew."""
        return self.path if self.drafted_nodes is None else [self.drafted_nodes[n] for n in self.path]

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
    match_samples: bool,
    rows: list[int] | None = None,
) -> tuple[Packed, list[Verdict]]:
    """Score every row's tree in one forward and run the acceptance rule on each (`match_samples`:
    see acceptance.walk).

    `rows` are the cache rows verified (default: all, in order). The cache holds the new entries
    uncommitted; the caller commits `packed.committed(b, path)` for the rows that go on.
    """
    packed = pack(pending, trees)
    logits = target.score(cache, packed, rows)
    hidden = target.last_hidden if target.hidden_layer is not None else None

    def decide(b: int) -> Verdict:
        tree, p, g = trees[b], params[b], generators[b]
        row = logits[b]
        if p.greedy:
            path, token = walk(tree, None, row.argmax(-1).tolist(), g, match_samples)
            probs = None
        else:
            # On the CPU, where the request's generator lives: the acceptance walk is scalar work.
            probs = process_logits(row[None], [p])[0].cpu()
            path, token = walk(tree, probs, None, g, match_samples)
        kept_hidden = None if hidden is None else hidden[b, packed.committed(b, path)]
        return Verdict(tree, path, token, probs, row, hidden=kept_hidden)

    # A sampled row's draws (0.8 ms each over a 49k vocabulary) use its own generator: rows are
    # decided side by side on the CPU's cores, each exactly as alone.
    if sum(not p.greedy for p in params) > 1:
        return packed, list(target.sampling_pool.map(decide, range(len(trees))))
    return packed, [decide(b) for b in range(len(trees))]
