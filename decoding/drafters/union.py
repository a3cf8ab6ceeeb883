"""Several drafters at once: their trees grafted under one root, verified in one forward.

`seed_stand` with a draft model drafts from the union of the model's k_config tree and STAND's
N-gram tree. Each drafter learns from a verification as if it had drafted alone: the accepted path
is given to the drafter whose subtree it lies in; the others see no accepted node of theirs and
catch up from the committed tokens. Under the matched rules the trees are merged as one trie (a
token both drafted at the same place is verified once, and both see it accepted).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import takewhile

import torch

from decoding.drafters.base import Drafter
from decoding.speculation.draft_tree import DraftTree, graft
from decoding.speculation.slot import Slot
from decoding.speculation.verify import Verdict


class UnionDrafter:
    def __init__(self, drafters: list[Drafter], merge: bool = False) -> None:
        self.drafters = drafters
        self.merge = merge  # matched rules: the trees merged as one trie (draft_tree.graft)
        self.max_nodes = sum(d.max_nodes for d in drafters)
        self.learns_top = max((d.learns_top for d in drafters), default=0)

    def admit(self, slots: list[Slot]) -> None:
        for d in self.drafters:
            d.admit(slots)

    def draft(self, slots: list[Slot]) -> list[DraftTree]:
        per_drafter = [d.draft(slots) for d in self.drafters]
        out = []
        for b, slot in enumerate(slots):
            trees = [t[b] for t in per_drafter]
            merged, where = graft(trees, self.merge)
            slot.put(self, (trees, where))  # until its verdict: which merged node is whose
            out.append(merged)
        return out

    def update(self, slots: list[Slot], verdicts: list[Verdict]) -> None:
        drafted = [slot.take(self) for slot in slots]
        for k, drafter in enumerate(self.drafters):
            drafter.update(
                slots, [v if d is None else self._as_drafted_by(k, d[0], d[1], v) for d, v in zip(drafted, verdicts)]
            )

    def _as_drafted_by(self, k: int, trees: list[DraftTree], where: list[list[int]], v: Verdict) -> Verdict:
        """The verification as drafter k would have seen it on its own tree."""
        back = {merged: own for own, merged in enumerate(where[k])}
        # Its part of the accepted path: the nodes it drew, from the root down (merged trees share
        # the nodes both drew; the path may go on into another drafter's nodes).
        own_path = list(map(back.__getitem__, takewhile(back.__contains__, v.drafted_path)))
        rows_needed = [0, *(1 + n for n in v.path[: len(own_path)])]
        shape = (1 + len(trees[k]), v.logits.shape[-1])
        logits = torch.zeros(shape, dtype=v.logits.dtype)
        logits[[0, *(1 + n for n in own_path)]] = v.logits[rows_needed].cpu()
        probs = None
        if v.probs is not None:
            probs = torch.zeros(shape, dtype=v.probs.dtype)
            probs[[0, *(1 + n for n in own_path)]] = v.probs[rows_needed].cpu()  # (on a GPU's device)
        # Without its own path a drafter learns only the first committed position (kept_rows()
        # stops at the path's end; `kept` still locates the committed tokens).
        top = None if v.top is None else (v.top[0][: 1 + len(own_path)], v.top[1][: 1 + len(own_path)])
        return replace(
            v, tree=trees[k], path=own_path, probs=probs, logits=logits, drafted_nodes=None, top=top, scores=None
        )

    def release(self, slots: list[Slot], live: list[Slot]) -> None:
        for d in self.drafters:
            d.release(slots, live)

    def peak_cache_bytes(self) -> int:
        return sum(d.peak_cache_bytes() for d in self.drafters)
