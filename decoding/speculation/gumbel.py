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

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from decoding.runtime import kernels
from decoding.speculation.sampling import SamplingParams, on_kernel, processed_logits, top_k_rows

_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (the golden ratio's fraction, odd)
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1
_SALT = 0x6A09E667F3BCC909  # keeps seed 0 / position 0 away from the all-zero state
_SCALE = 2.0**-52
# The noise's range, fixed by the uniform's 52 bits.
G_MAX = -math.log(-math.log1p(-0.5 * _SCALE))
G_MIN = -math.log(-math.log(0.5 * _SCALE))
_CHUNK = 1 << 24  # elements of float64 noise one pass of gumbel_targets makes (128 MB)
_MARGIN = 1e-5  # the pruning bounds', relative: float32 scores compare to 6e-8, float64 sums to 1e-16


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


def _bits(seed: int, position: int, tokens: torch.Tensor) -> torch.Tensor:
    """The 52 random bits of each token's uniform (int64): integer work only, no logarithm."""
    x = tokens.to(torch.int64) * _signed(_GAMMA) + _signed(key(seed, position))  # wraps mod 2^64
    x ^= _srl(x, 30)
    x *= _signed(_M1)
    x ^= _srl(x, 27)
    x *= _signed(_M2)
    x ^= _srl(x, 31)
    return _srl(x, 12)


def _gumbel_of_bits(bits: torch.Tensor) -> torch.Tensor:
    u = (bits.to(torch.float64) + 0.5) * _SCALE
    return -torch.log(-torch.log(u))


def gumbel_noise(seed: int, position: int, tokens: torch.Tensor) -> torch.Tensor:
    """G(seed, position, token) for each token id in `tokens` (any shape), float64 on their device."""
    return _gumbel_of_bits(_bits(seed, position, tokens))


@functools.lru_cache(maxsize=8)
def _vocabulary(size: int, device: torch.device) -> torch.Tensor:
    return torch.arange(size, device=device)


def gumbel_choice(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The token sampled at `position` from raw logits [V]: the argmax at temperature 0, else
    argmax of processed logits + G (exact, with logarithms only near the top: see _noisy_top)."""
    if params.greedy:
        return int(logits.argmax())
    return gumbel_pick(processed_logits(logits.float(), params), seed, position)


def gumbel_pick(scores: torch.Tensor, seed: int, position: int) -> int:
    """argmax of already processed logits [V] (`sampling.processed_logits`) + G at `position`: for a
    caller that has processed a whole tree's rows at once. On the CPU one pass of csrc/gumbel.cpp where
    the kernels are built (logarithms only for the few tokens that can win), else numpy's pass (2.8x
    slower on a peaked 49k row, 28x on a flat one; torch's operators were slower still)."""
    if scores.device.type != "cpu":
        return int(_noisy_top(scores.double(), seed, position, 1)[0])
    return gumbel_pick_rows([scores], [key(seed, position)])[0]


def gumbel_pick_rows(rows: list[torch.Tensor], keys: list[int], temperatures: list[float] | None = None) -> list[int]:
    """`gumbel_pick` of each CPU row [V], row r with the noise stream `keys[r]` (`key(seed, position)`):
    of processed logits, or (`temperatures`) of raw logits whose processing is the division by row r's
    temperature alone (no top-k, no top-p), done in the draw's pass. On the machine's threads in one
    call of the kernels where they are built."""
    ts = [1.0] * len(rows) if temperatures is None else [float(t) for t in temperatures]
    if kernels.built() is not None and all(
        r.dtype in (torch.float32, torch.bfloat16) and r.is_contiguous() for r in rows
    ):
        return list(torch.ops.tot_sampling.gumbel_pick_rows(rows, [_signed(k) for k in keys], ts))
    return [_pick_np(r if t == 1.0 else r.float() / t, k) for r, k, t in zip(rows, keys, ts)]


def draw_top_rows(
    rows: list[torch.Tensor], keys: list[int], temperatures: list[float], k: int
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For raw logits rows [V] whose processing is the division by their temperature alone: each
    row's draw (`gumbel_pick_rows` with `temperatures`), and the same rows' `top_k_rows` read as
    logits at those temperatures (the top k's probabilities [R, k], their ids [R, k], what was read [R,
    2 + k] or None): in one call of csrc/draw_top.cpp where the kernels are built, the row divided
    once and its sum of exp taken in the draw's pass, else the two calls; the same values either way."""
    if on_kernel(rows) and all(r.is_contiguous() for r in rows):
        streams = [_signed(c) for c in keys]
        picks, values, ids, read = torch.ops.tot_sampling.draw_top_rows(rows, streams, temperatures, k)
        return picks.tolist(), values, ids, read
    values, ids, read = top_k_rows([r[None] for r in rows], k, None, [True] * len(rows), temperatures)
    return gumbel_pick_rows(rows, keys, temperatures), values, ids, read


def _pick_np(scores: torch.Tensor, stream: int) -> int:
    """`gumbel_pick` in numpy, noise stream `stream` (`key(seed, position)`): every token hashed,
    logarithms for those within reach of the largest bits."""
    s = scores.detach().to(torch.float64 if scores.dtype == torch.float64 else torch.float32).numpy()
    bits = _vocabulary_np(s.shape[-1]) + np.uint64(stream)
    bits ^= bits >> np.uint64(30)
    bits *= np.uint64(_M1)
    bits ^= bits >> np.uint64(27)
    bits *= np.uint64(_M2)
    bits ^= bits >> np.uint64(31)
    bits >>= np.uint64(12)
    best = int(s.argmax())
    ends = _gumbel_np(np.array([bits[best], bits.max()]))
    # The bound of _noisy_top, in the scores' own precision: float32 comparisons round it.
    bound = float(s[best]) + ends[0] - ends[1]
    near = np.flatnonzero(s >= bound - _MARGIN * (1.0 + abs(bound)))
    noisy = s[near].astype(np.float64) + _gumbel_np(bits[near])
    return int(near[noisy.argmax()])


def gumbel_targets(scores: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """`gumbel_pick` of every row of processed logits [R, V] at once, row r with the noise stream
    `keys[r]` (`key(seed, position)`): the tokens [R] on the scores' device, with no read-back (a
    GPU's verification: every node of every row sampled in one pass, one transfer for the step).
    The same float64 sums and argmax as `_noisy_top`, over the whole vocabulary: the same tokens.
    In chunks of rows, so the float64 noise of many rows of a large vocabulary never piles up."""
    vocab = _vocabulary(scores.shape[-1], scores.device)[None, :] * _signed(_GAMMA)
    starts = torch.tensor([_signed(k) for k in keys], dtype=torch.int64).to(scores.device, non_blocking=True)
    step = max(1, _CHUNK // scores.shape[-1])
    out = []
    for lo in range(0, scores.shape[0], step):
        x = vocab + starts[lo : lo + step, None]
        x ^= _srl(x, 30)
        x *= _signed(_M1)
        x ^= _srl(x, 27)
        x *= _signed(_M2)
        x ^= _srl(x, 31)
        out.append((scores[lo : lo + step].double() + _gumbel_of_bits(_srl(x, 12))).argmax(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=scores.device)


def _gumbel_np(bits: np.ndarray) -> np.ndarray:
    return -np.log(-np.log((bits.astype(np.float64) + 0.5) * _SCALE))


@functools.lru_cache(maxsize=8)
def _vocabulary_np(size: int) -> np.ndarray:
    """Each token id times splitmix64's increment (wrapping): the start of every position's hash."""
    with np.errstate(over="ignore"):
        out: np.ndarray = np.arange(size, dtype=np.uint64) * np.uint64(_GAMMA)
    out.setflags(write=False)
    return out


def _noisy_top(scores: torch.Tensor, seed: int, position: int, k: int) -> torch.Tensor:
    """The k tokens of largest score + G at `position`, best first (scores float64 [V], k <= V).

    Exact, and takes logarithms only near the top: every token's random bits are hashed (integer
    work), and since G grows with them, no token's noise exceeds the noise of the largest bits drawn
    at this position. The k best-scored tokens' own score + noise are values the k best reach, so a
    token scored lower than the k-th of them by more than the largest noise cannot be among the k
    (the noise's full range would keep nearly the whole vocabulary at temperature 0.6)."""
    bits = _bits(seed, position, _vocabulary(scores.shape[-1], scores.device))
    best = scores.topk(k).indices if k > 1 else scores.argmax().reshape(1)
    reached = scores[best] + _gumbel_of_bits(bits[best])
    largest = float(_gumbel_of_bits(bits.max().reshape(1))[0])
    bound = float(reached.min()) - largest
    near = (scores >= bound - _MARGIN * (1.0 + abs(bound))).nonzero().flatten()
    noisy = scores[near] + _gumbel_of_bits(bits[near])
    return near[noisy.topk(k).indices] if k > 1 else near[noisy.argmax()].reshape(1)


def _gumbel_py(seed: int, position: int, ids: list[int]) -> list[float]:
    """`gumbel_noise` of a few tokens in plain Python (the same bits; a drafter's node has up to ten
    candidates, where torch's or numpy's per-call cost was 60-90 us and this is a few)."""
    start = key(seed, position)
    return [-math.log(-math.log(((_mix((t * _GAMMA + start) & _MASK) >> 12) + 0.5) * _SCALE)) for t in ids]


def gumbel_order(ids: list[int], log_q: list[float], seed: int, position: int) -> list[int]:
    """Candidates ordered by log q + G at `position`: a drafter's coupled proposals, first the one
    the target samples whenever q agrees with it."""
    if not ids:
        return []
    g = _gumbel_py(seed, position, ids)
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
        target's sample whenever q is the target's distribution (exact: see _noisy_top)."""
        logq = q.double().log()
        return _noisy_top(logq, self.seed, self.position + depth, min(k, int((logq > float("-inf")).sum()))).tolist()
