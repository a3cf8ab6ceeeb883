"""Prompt lookup decoding (PLD): draft the continuation of the last n-gram's previous occurrence.

A baseline in the drafter slot: model-free like STAND, but deterministic and looking only at the
sequence's own context (prompt and generated text), with no cross-trajectory statistics.
"""

from __future__ import annotations

from decoding.drafters.options import PLDOptions
from decoding.drafters.plugin import BuildConfig
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.slot import Slot
from decoding.speculation.verify import Verdict


def lookup(context: list[int], max_ngram: int, num_draft: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the context's last n tokens, longest n first."""
    size = len(context)
    for n in range(min(max_ngram, size - 1), 0, -1):
        tail = context[-n:]
        for start in range(size - n - 1, -1, -1):
            if context[start : start + n] == tail:
                return context[start + n : start + n + num_draft]
    return []


class PLDDrafter:
    learns_top = 0  # its update reads no Verdict.top

    def __init__(self, options: PLDOptions) -> None:
        self.options = options
        self.max_nodes = options.num_draft

    def admit(self, slots: list[Slot]) -> None:
        """No state: drafts come from each sequence's own context."""

    def draft(self, slots: list[Slot]) -> list[DraftTree]:
        trees = []
        for slot in slots:
            seq = slot.seq
            tokens = lookup(seq.prompt + seq.generated, self.options.max_ngram, min(self.options.num_draft, seq.room))
            tree = DraftTree(draw="top")
            parent = ROOT
            for t in tokens:
                parent = tree.add(t, parent)
            trees.append(tree)
        return trees

    def update(self, slots: list[Slot], verdicts: list[Verdict]) -> None:
        """Nothing to learn: drafts come from each sequence's own context."""

    def release(self, slots: list[Slot], live: list[Slot]) -> None:
        """No state to drop."""

    def peak_cache_bytes(self) -> int:
        return 0  # no model, no KV cache


def build(config: BuildConfig, *_: object) -> PLDDrafter:
    """`pld`'s drafter (decoding/drafters/builtin.py declares it)."""
    return PLDDrafter(config.section("pld"))
