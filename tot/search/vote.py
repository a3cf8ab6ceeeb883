"""The vote over a problem's finished states: what each ballot weighs (vote.weight), which ballots count
(vote.keep), and when a vote taken in waves is settled before its budget is spent (search.stop).

A ballot is a finished state: a path that stated its answer, a best-of-N solution, a rollout. Its weight
is the search's own (`own`: 1 a ballot for a majority, the state's value for a value-weighted vote), or
one of the confidence readings of the reply that finished it (tot/search/confidence.py; CISC weighs a
vote by such a reading, DeepConf filters by one). With vote.temperature > 0 a reading r counts
exp(r / temperature), CISC's softmax over the problem's ballots (the normaliser, shared by all of a
problem's ballots, changes no winner); with vote.keep < 1 only that share of the ballots, the surest by
the reading, counts (DeepConf's filter).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from decoding import ConfigError
from tot.search.confidence import READINGS

# A ballot's weight: the search's own rule (None), 1 each (one), the state's value, or a reading.
WEIGHTS = ("one", "value", *READINGS)
Own = Literal["one", "value"]
# When a vote sampled in waves stops (search.stop): never (the whole budget), decided (the leader's
# lead exceeds what every ballot still to come could add to the runner-up), agree (decided, or a whole
# wave agrees with the leader: early-stopping self-consistency's window).
STOPS = ("never", "decided", "agree")


@dataclass(frozen=True)
class VoteRule:
    weight: str | None = None
    temperature: float = 0.0
    keep: float = 1.0

    def __post_init__(self) -> None:
        if self.weight is not None and self.weight not in WEIGHTS:
            raise ConfigError(
                f"vote.weight={self.weight!r} is not one of null (the search's own), {', '.join(WEIGHTS)}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"vote.temperature={self.temperature} must be >= 0 (0: the weights as they are)")
        if not 0 < self.keep <= 1:
            raise ConfigError(f"vote.keep={self.keep} must be in (0, 1]: the share of the surest ballots counted")

    @property
    def reading(self) -> str | None:
        """The confidence reading the ballots need, if any."""
        return self.weight if self.weight in READINGS else None


PLAIN_VOTE = VoteRule()  # each search's own weights, every ballot counted


@dataclass(frozen=True)
class Ballot:
    answer: str
    value: float | None = None  # the state's value
    confidence: dict[str, float] | None = None  # its reply's readings


def weights(rule: VoteRule, ballots: Sequence[Ballot], own: Own) -> list[float | None]:
    """Each ballot's weight under the rule, None for a ballot the filter leaves out."""
    kind = rule.weight or own
    if kind == "one":
        raw = [1.0] * len(ballots)
    elif kind == "value":
        raw = [0.0 if b.value is None else float(b.value) for b in ballots]
    else:
        raw = []
        for b in ballots:
            if not b.confidence or kind not in b.confidence:
                raise ValueError(
                    f"vote.weight={kind}: a finished state has no {kind} reading (its reply's log-probabilities "
                    "were not kept, or tail_margin's top tokens were not asked)"
                )
            raw.append(b.confidence[kind])
    counted = list(range(len(ballots)))
    if rule.keep < 1 and ballots:
        n = max(1, math.ceil(rule.keep * len(ballots)))
        counted = sorted(sorted(counted, key=lambda i: -raw[i])[:n])  # the surest, the earlier of equals
    if rule.temperature > 0 and counted:
        top = max(raw[i] for i in counted)
        raw = [math.exp((r - top) / rule.temperature) for r in raw]
    kept = set(counted)
    return [raw[i] if i in kept else None for i in range(len(ballots))]


@dataclass(frozen=True)
class Tally:
    """The answers' summed weights and counts over the counted ballots, and the order they first came in."""

    weight: dict[str, float]
    count: dict[str, int]
    first: dict[str, int]

    @property
    def ranked(self) -> list[str]:
        """Answers best first: the larger weight, then more ballots, then the earlier."""
        return sorted(self.weight, key=lambda a: (-self.weight[a], -self.count[a], self.first[a]))

    @property
    def winner(self) -> str | None:
        ranked = self.ranked
        return ranked[0] if ranked else None

    def lead(self) -> float:
        """The winner's weight less the runner-up's (its whole weight where it stands alone)."""
        ranked = self.ranked
        if not ranked:
            return 0.0
        return self.weight[ranked[0]] - (self.weight[ranked[1]] if len(ranked) > 1 else 0.0)


def tally(rule: VoteRule, ballots: Sequence[Ballot], own: Own) -> Tally:
    """The counted ballots' answers; a ballot with no answer (a path that stated none, a program that failed)
    names nothing, so it weighs for nothing: it cannot win the vote, nor agree with another."""
    weight: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    first: dict[str, int] = {}
    for i, (b, w) in enumerate(zip(ballots, weights(rule, ballots, own))):
        if w is None or not b.answer:
            continue
        weight[b.answer] += w
        count[b.answer] += 1
        first.setdefault(b.answer, i)
    return Tally(dict(weight), dict(count), first)


def settled(rule: VoteRule, ballots: Sequence[Ballot], own: Own, remaining: int, stop: str, wave: int = 0) -> bool:
    """Whether sampling may stop with `remaining` ballots of the budget still to come.

    `decided`: the leader's lead is larger than `remaining` (each ballot to come weighs at most 1, and a
    runner-up drawing level would win on its count or order): the full budget would give the same
    answer. `agree`: that, or the last `wave` ballots all name the leader (ESC's window; this one may
    stop where the full budget would have answered otherwise)."""
    if stop == "never" or not ballots:
        return remaining == 0
    if remaining == 0:
        return True
    counted = tally(rule, ballots, own)
    if counted.lead() > remaining:
        return True
    if stop == "agree" and wave and len(ballots) >= wave:
        return len({b.answer for b in ballots[-wave:]}) == 1 and ballots[-1].answer == counted.winner
    return False


def check_stop_name(stop: str, search: str, voted: bool, votes: str) -> None:
    """`search.stop` one of STOPS, and `never` unless the search's answer is a vote (`votes`: the
    aggregates that are, for the message)."""
    if stop not in STOPS:
        raise ConfigError(f"search.stop={stop!r} is not one of {', '.join(STOPS)} (search={search})")
    if stop != "never" and not voted:
        raise ConfigError(f"search.stop stops a vote: use it with search.aggregate={votes} (search={search})")


def check_stop(stop: str, rule: VoteRule, own: Own) -> None:
    """A stop (`decided`, `agree`) only where no ballot to come can weigh more than 1."""
    weight = rule.weight or own
    if stop != "never" and not (rule.temperature == 0 and rule.keep == 1 and weight != "value"):
        raise ConfigError(
            f"search.stop={stop} stops when the remaining ballots cannot change the vote, which needs weights of "
            f"at most 1 known as they come: vote.weight one or a reading, vote.temperature=0, vote.keep=1 "
            f"(given weight={weight}, temperature={rule.temperature}, keep={rule.keep}); or use search.stop=never"
        )
