"""Prompt lookup decoding (PLD): draft the continuation of the last n-gram's previous occurrence.

A baseline in the drafter slot: model-free like STAND, but deterministic and looking only at the
sequence's own context (prompt and generated text), with no cross-trajectory statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

from decoding.base.errors import ConfigError
from decoding.drafters.plugin import DecoderKind, DrafterPlugin
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.slot import Slot
from decoding.speculation.verify import Verdict


@dataclass(frozen=True)
class PLDOptions:
    max_ngram: int = 3  # longest n-gram matched (then shorter ones)
    num_draft: int = 10  # tokens drafted after a match (a chain)

    def __post_init__(self) -> None:
        if self.max_ngram < 1 or self.num_draft < 1:
            raise ConfigError(f"pld.max_ngram={self.max_ngram} and pld.num_draft={self.num_draft} must be positive")


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


PLUGIN = DrafterPlugin(
    name="pld",
    build=lambda config, target, tokenizer, draft: PLDDrafter(config.section("pld")),
    options=PLDOptions,
    section="pld",
    decoders=(DecoderKind("pld", "batch", "pld", ("pld", "verify")),),
)
