"""What every schedule shares: the `Decoder` protocol, running sequences to the end, and the
`verify:` options (verification and acceptance are the core's, so every schedule is lossless)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from decoding.base.values import DecodeStats
from decoding.drafters.base import Drafter
from decoding.speculation.sequence import Sequence


@dataclass
class Step:
    """What one decode step did: the sequences that stopped (`generated` and `reason` filled in
    place), and what the step cost (time, forwards, rows, prompt tokens, drafts; token counts live in
    each sequence's own stats)."""

    finished: list[Sequence]
    cost: DecodeStats


class Decoder(Protocol):
    """Decodes sequences that join between steps (continuous batching) and reports what it cost.

    `admit` queues sequences; each `step` (one target forward, more or less) advances the live ones
    and returns a `Step`: those that stopped and what the step cost; `busy` says whether any is
    queued or live. `run` is the synchronous convenience: admit, step until idle, the call's cost.
    """

    name: str
    drafter: Drafter

    @property
    def busy(self) -> bool: ...

    @property
    def live(self) -> int: ...

    def admit(self, seqs: list[Sequence]) -> None: ...

    def step(self) -> Step: ...

    def clear(self) -> None:
        """Drop every queued and live sequence (their callers are gone)."""
        ...

    def run(self, seqs: list[Sequence]) -> DecodeStats: ...


def run_to_end(decoder: Decoder, seqs: list[Sequence]) -> DecodeStats:
    """Decode `seqs` (and whatever else the decoder has live) until idle; their cost."""
    cost = DecodeStats()
    decoder.admit(seqs)
    while decoder.busy:
        cost += decoder.step().cost
    return add_sequence_totals(cost, seqs)


def add_sequence_totals(stats: DecodeStats, seqs: list[Sequence]) -> DecodeStats:
    """A call's token counts are its sequences' (the time and forward counts are the call's own)."""
    stats.generated_tokens = sum(s.stats.generated_tokens for s in seqs)
    stats.drafted_tokens = sum(s.stats.drafted_tokens for s in seqs)
    stats.accepted_tokens = sum(s.stats.accepted_tokens for s in seqs)
    stats.suffix_accepted_tokens = sum(s.stats.suffix_accepted_tokens for s in seqs)
    stats.verify_steps = sum(s.stats.verify_steps for s in seqs)
    # What an admission computed belongs to the sequences it admitted, not to every call in the step.
    stats.prompt_tokens_computed = sum(s.stats.prompt_tokens_computed for s in seqs)
    return stats
