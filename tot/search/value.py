"""A state's value read from the probabilities of the evaluator's answers (task.value=expected or yes):
the model's distribution over the answers that may follow the evaluator prompt, from one forward
(`GenRequest.choices`), and the value it implies."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ReadValue:
    value: float
    distribution: dict[str, float]  # each answer's probability, renormalised over the answers


def answer_distribution(answers: list[str], logprobs: list[float]) -> dict[str, float]:
    """Each answer's probability of being the whole answer, renormalised over the answers.

    An answer's scored probability covers every reply that starts with it: P(" 1") holds P(" 10").
    So the answers that extend it are taken off (those extending it directly; theirs already hold
    the longer ones): P(exactly " 1") = P(" 1") - P(" 10"), up to what no answer in the set covers.
    """
    p = dict(zip(answers, (math.exp(lp) for lp in logprobs)))
    exact = {}
    for a in answers:
        longer = [b for b in answers if b != a and b.startswith(a)]
        direct = [b for b in longer if not any(c != b and b.startswith(c) for c in longer)]
        exact[a] = max(0.0, p[a] - sum(p[b] for b in direct))
    total = sum(exact.values())
    if total <= 0:  # no answer has any mass left: read the scored probabilities as they are
        exact, total = p, sum(p.values())
    return {a: q / total for a, q in exact.items()}


def read_value(worth: dict[str, float], logprobs: list[float]) -> ReadValue:
    """The expected worth of the answers under their distribution: the expected score for a scale of
    scores, P(Yes) / (P(Yes) + P(No)) for Yes worth 1 and No worth 0 (RAP's reward)."""
    answers = list(worth)
    dist = answer_distribution(answers, logprobs)
    return ReadValue(sum(worth[a] * dist[a] for a in answers), dist)
