"""How sure a reply is, read from its tokens' log-probabilities (GenRequest.logprobs): the readings a
vote can weigh or filter its ballots by (vote.weight, vote.keep) and `tot.separation` scores.

Each reading is a probability-like number in [0, 1], larger for a surer reply:

- `mean`: the geometric-mean probability of the reply's tokens (self-certainty, as CISC's sequence
  probability normalised by length; what task.value=confidence values a thought by).
- `lowest_window`: the geometric-mean probability of its least sure WINDOW consecutive tokens (DeepConf's
  lowest group confidence, on the sampled token's probability): one confused stretch in a long
  reply shows, where the mean over the whole reply hides it.
- `tail`: the geometric-mean probability of its last WINDOW tokens (DeepConf's tail confidence): where a
  GSM8K reply states its answer.
- `tail_margin`: the mean, over the last WINDOW tokens, of the most likely token's probability less the
  second's (the answer's margin); needs GenRequest.top_logprobs >= 2, so it is read only where the top
  tokens came with the reply.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from decoding import TokenLogprob

WINDOW = 16  # tokens: about a GSM8K sentence, the answer's ("The answer is 18.") with what leads to it
READINGS = ("mean", "lowest_window", "tail", "tail_margin")
TOP_NEEDED = 2  # top tokens a position needs for tail_margin


def mean_probability(logprobs: Sequence[float]) -> float:
    """The geometric-mean probability of the tokens; 1 for none (an empty reply is not unsure)."""
    return math.exp(sum(logprobs) / len(logprobs)) if logprobs else 1.0


def lowest_window(logprobs: Sequence[float], window: int = WINDOW) -> float:
    """The least geometric-mean probability over every run of `window` consecutive tokens (the
    whole reply where it is shorter)."""
    if len(logprobs) <= window:
        return mean_probability(logprobs)
    total = sum(logprobs[:window])
    low = total
    for i in range(window, len(logprobs)):
        total += logprobs[i] - logprobs[i - window]
        low = min(low, total)
    return math.exp(low / window)


def tail_margin(tokens: Sequence[TokenLogprob], window: int = WINDOW) -> float | None:
    """The mean top-1 less top-2 probability over the last `window` positions; None where a position
    came without two top tokens."""
    tail = tokens[-window:]
    if not tail or any(len(t.top) < TOP_NEEDED for t in tail):
        return None
    return sum(math.exp(t.top[0][1]) - math.exp(t.top[1][1]) for t in tail) / len(tail)


def readings(tokens: Sequence[TokenLogprob], window: int = WINDOW) -> dict[str, float]:
    """Every reading the reply's log-probabilities allow, by name (READINGS' order)."""
    logprobs = [t.logprob for t in tokens]
    read = {
        "mean": mean_probability(logprobs),
        "lowest_window": lowest_window(logprobs, window),
        "tail": mean_probability(logprobs[-window:]),
    }
    margin = tail_margin(tokens, window)
    if margin is not None:
        read["tail_margin"] = margin
    return read
