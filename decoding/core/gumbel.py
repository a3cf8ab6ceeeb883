"""The project's sampler: Gumbel-max with public, counter-based noise (drafter-invariant sampling,
Daliri, Musco and Suresh, arXiv 2408.07978).

A token at temperature > 0 is argmax over the vocabulary of processed logits + G(seed, position,
token): the logits divided by the temperature, minus infinity outside top-k / top-p (exactly
`sampling.processed_logits`), plus a standard Gumbel variate that is a fixed function of the
request's seed, the token's absolute position in the sequence (prompt included) and its id. That is
an exact sample of the processed distribution, the same whatever else runs in the batch, and anyone
who knows the seed can evaluate the noise of any candidate without drawing the whole vocabulary: a
drafter that orders its candidates by log q + G proposes the target's own sample with probability at
least (1 - TV(p, q)) / (1 + TV(p, q)), where a blind draft is accepted with probability p(x).

The noise is splitmix64 (Steele, Lea and Flood, 2014): a stream keyed by (seed, position) and
indexed by the token id, its top 52 bits a float64 uniform in (0, 1) (52, so that u < 1 exactly).
Arithmetic is int64 with the wrap-around every CPU and GPU implements, so the same seed gives the
same bits everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from decoding.core.sampling import SamplingParams, processed_logits

_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (the golden ratio's fraction, odd)
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1
_SALT = 0x6A09E667F3BCC909  # keeps seed 0 / position 0 away from the all-zero state
_SCALE = 2.0**-52
# The noise's range, fixed by the uniform's 52 bits: no token whose processed logit is more than
# their difference below the best can win, so only those near the top need their noise computed.
G_MAX = -math.log(-math.log1p(-0.5 * _SCALE))
G_MIN = -math.log(-math.log(0.5 * _SCALE))
_REACH = G_MAX - G_MIN + 1.0  # + 1: a margin for log's last bits


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _mix(x: int) -> int:
    """splitmix64's finaliser on a Python int (the per-call key)."""
    x = ((x ^ (x >> 30)) * _M1) & _MASK
    x = ((x ^ (x >> 27)) * _M2) & _MASK
    return x ^ (x >> 31)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def key(seed: int, position: int) -> int:
    """The stream of one (seed, position): two rounds, so neighbouring seeds and positions are unrelated."""
    return _mix((_mix((seed + _SALT) & _MASK) + (position + 1) * _GAMMA) & _MASK)


def gumbel_noise(seed: int, position: int, tokens: torch.Tensor) -> torch.Tensor:
    """G(seed, position, token) for each token id in `tokens` (any shape), float64 on their device."""
    k = _signed(key(seed, position))
    x = tokens.to(torch.int64) * _signed(_GAMMA) + k  # wraps mod 2^64
    x = (x ^ _srl(x, 30)) * _signed(_M1)
    x = (x ^ _srl(x, 27)) * _signed(_M2)
    x = x ^ _srl(x, 31)
    u = (_srl(x, 12).to(torch.float64) + 0.5) * _SCALE
    return -torch.log(-torch.log(u))


def gumbel_choice(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The token sampled at `position` from raw logits [V]: the argmax at temperature 0, else
    argmax of processed logits + G. Exact (every token that could win is scored), and computes the
    noise only where a token's processed logit is within the noise's range of the best."""
    if params.greedy:
        return int(logits.argmax())
    return gumbel_pick(processed_logits(logits.float(), params), seed, position)


def gumbel_pick(scores: torch.Tensor, seed: int, position: int) -> int:
    """argmax of already processed logits [V] (`sampling.processed_logits`) + G at `position`: for a
    caller that has processed a whole tree's rows at once."""
    scores = scores.double()
    near = (scores >= scores.max() - _REACH).nonzero().flatten()
    noisy = scores[near] + gumbel_noise(seed, position, near)
    return int(near[noisy.argmax()])


def gumbel_order(ids: list[int], log_q: list[float], seed: int, position: int) -> list[int]:
    """Candidates ordered by log q + G at `position`: a drafter's coupled proposals, first the one
    the target samples whenever q agrees with it."""
    if not ids:
        return []
    g = gumbel_noise(seed, position, torch.tensor(ids)).tolist()
    return [i for _, i in sorted(zip((lq + gi for lq, gi in zip(log_q, g)), ids), reverse=True)]


@dataclass(frozen=True)
class Coupling:
    """What a drafter needs to propose a sequence's own samples: its seed, and the position of the
    token after the root (each node's children sit `depth` past it)."""

    seed: int
    position: int

    def order(self, ids: list[int], log_q: list[float], depth: int) -> list[int]:
        """Candidates ordered by log q + G at the children's position (see gumbel_order)."""
        return gumbel_order(ids, log_q, self.seed, self.position + depth)

    def top(self, q: torch.Tensor, k: int, depth: int) -> list[int]:
        """The k tokens of largest log q + G over a distribution q [V], best first: the first is the
        target's sample whenever q is the target's distribution. Only tokens within the noise's range
        of q's best are scored (farther ones could be first only by its last bits, never in practice)."""
        logq = q.double().log()
        near = (logq >= logq.max() - _REACH).nonzero().flatten()
        noisy = logq[near] + gumbel_noise(self.seed, self.position + depth, near)
        best = torch.topk(noisy, min(k, near.shape[0]))
        return near[best.indices].tolist()
