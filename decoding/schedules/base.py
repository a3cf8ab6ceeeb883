"""What every schedule shares: the `Decoder` protocol, running sequences to the end, and the
`verify:` options (verification and acceptance are the core's, so every schedule is lossless)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from decoding.core.errors import ConfigError
from decoding.core.sampling import RULES, Rule
from decoding.core.sequence import Sequence
from decoding.core.values import DecodeStats
from decoding.drafters.base import Drafter


class Decoder(Protocol):
    """Decodes sequences that join between steps (continuous batching) and reports what it cost.

    `admit` queues sequences; each `step` (one target forward, more or less) advances the live ones
    and returns those that stopped (`generated` and `reason` filled in place); `busy` says whether
    any is queued or live. `stats` holds the running totals of every step: time, forwards, rows,
    prompt tokens (token counts live in each sequence's own stats). `run` is the synchronous
    convenience: admit, step until idle, the call's cost.
    """

    name: str
    drafter: Drafter
    stats: DecodeStats

    @property
    def busy(self) -> bool: ...

    @property
    def live(self) -> int: ...

    def admit(self, seqs: list[Sequence]) -> None: ...

    def step(self) -> list[Sequence]: ...

    def clear(self) -> None:
        """Drop every queued and live sequence (their callers are gone)."""
        ...

    def run(self, seqs: list[Sequence]) -> DecodeStats: ...


def run_to_end(decoder: Decoder, seqs: list[Sequence]) -> DecodeStats:
    """Decode `seqs` (and whatever else the decoder has live) until idle; their cost."""
    before = replace(decoder.stats)
    decoder.admit(seqs)
    while decoder.busy:
        decoder.step()
    return add_sequence_totals(decoder.stats - before, seqs)


# verify.plan=fixed, verify.max_tokens=auto on a CPU: the old fixed cut, 16 tree tokens per forward
# (where trees stopped paying on the machine it was measured on, docs/performance.md); no cap on a GPU.
CPU_MAX_TOKENS = 16
PLANS = ("auto", "goodput", "fixed")


@dataclass(frozen=True)
class VerifyOptions:
    """The `verify:` section: how much one verification forward scores, for every speculative decoder."""

    # goodput: each step planned for the most expected committed tokens per second (the step
    # planner, decoding/schedules/planner.py); fixed: every tree cut to max_tokens / rows - 1 nodes;
    # auto: fixed for `seed` (SEED's Algorithm 1 baseline), goodput for every other decoder.
    plan: str = "goodput"
    max_tokens: int | str | None = "auto"  # plan=fixed: tree tokens (roots included) per forward
    # At temperature > 0 (decoding/core/sampling.py, Rule): match_gumbel, the target samples each
    # position by Gumbel-max with the request's public noise and a drafted token is kept when it is
    # that sample; drafters that know the noise propose it. match_multinomial: the same with
    # torch.multinomial's stream (`transformers`' own sampling). Under either, outputs are `hf`'s
    # very samples under that sampler, whatever was drafted and ran at once. rejection: speculative
    # sampling's rules (sd.multi_candidate, without_replacement): distributed as the target, not
    # `hf`'s samples.
    rule: Rule = "match_gumbel"
    cost: str | None = None  # plan=goodput: a forward-cost profile JSON (null: profiled on this machine, cached)

    def __post_init__(self) -> None:
        if self.plan not in PLANS:
            raise ConfigError(f"verify.plan={self.plan!r} is not one of {', '.join(PLANS)}")
        ok = self.max_tokens in (None, "auto") or (
            isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens > 0
        )
        if not ok:
            raise ConfigError(
                f"verify.max_tokens={self.max_tokens!r} must be a positive number of tokens, auto or null (no cap)"
            )
        if self.rule not in RULES:
            raise ConfigError(f"verify.rule={self.rule!r} is not one of {', '.join(RULES)}")
        if self.cost is not None and not Path(self.cost).is_file():
            raise ConfigError(
                f"verify.cost={self.cost!r} is not a file: give a profile JSON "
                "(python -m decoding.profile_forward out=...) or null to profile this machine"
            )

    @property
    def coupled(self) -> bool:
        """Drafters propose the target's own samples: they order candidates by its public noise."""
        return self.rule == "match_gumbel"

    def for_decoder(self, name: str) -> VerifyOptions:
        """plan=auto resolved for decoder `name`."""
        if self.plan != "auto":
            return self
        return replace(self, plan="fixed" if name == "seed" else "goodput")

    def budget(self, device: torch.device) -> int | None:
        """plan=fixed: tree tokens (roots included) one forward may score, or None for no cap."""
        if self.max_tokens == "auto":
            return CPU_MAX_TOKENS if device.type == "cpu" else None
        return self.max_tokens  # type: ignore[return-value]


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
