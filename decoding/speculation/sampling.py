"""Logit processing and sampling, shared by every decoder so that all sample the same distribution.

Processing follows `transformers`' warper order (temperature, then top-k, then top-p), with
per-row parameters so one batched forward can serve requests with different settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.runtime import kernels


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """`logits.argmax(-1).tolist()` of [N, V]: the first index of each row's maximum (a NaN counting
    as the maximum, as torch's). On the CPU through numpy in float32 (exact for half types), whose
    argmax ran a 49k vocabulary 8x faster than torch's operator; bfloat16 rows are read as they are by
    csrc/argmax.cpp where the kernels are built, since their cast to float32 cost 6x numpy's argmax
    (32 rows of 49k: 0.17 ms against 1.27 cast and argmax; 2 cores, AVX2)."""
    if logits.device.type != "cpu" or not logits.dtype.is_floating_point:
        return logits.argmax(-1).tolist()
    if logits.dtype == torch.bfloat16 and logits.dim() == 2 and kernels.built() is not None:
        return list(torch.ops.tot_sampling.argmax_rows(logits.detach().contiguous()))
    exact = logits.detach() if logits.dtype in (torch.float32, torch.float64) else logits.detach().float()
    ids: list[int] = exact.numpy().argmax(-1).tolist()
    return ids


def process_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Turn logits [B, ..., V] into the target's sampling distribution, one parameter set per row.

    Greedy rows get a one-hot on the argmax, so acceptance rules can treat them like any other
    distribution.
    """
    logits = logits.float()
    shape = logits.shape
    rows = logits.reshape(shape[0], -1, shape[-1])
    out = torch.empty_like(rows)
    for b, p in enumerate(params):
        out[b] = _process_row(rows[b], p)
    return out.reshape(shape)


def _process_row(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return processed_logits(logits, p).softmax(-1)


def processed_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Logits [..., V] (float32) divided by the temperature, minus infinity outside top-k / top-p:
    the log of the sampling distribution, up to a constant (p at temperature > 0)."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        first = NUCLEUS_FIRST if logits.device.type == "cpu" else None  # a GPU sorts a row in microseconds
        logits = logits.masked_fill(~top_p_kept(logits, p.top_p, first), float("-inf"))
    return logits


NUCLEUS_FIRST = 256  # candidates a row's nucleus is first looked for among (grown 8x while short)


def top_p_kept(logits: torch.Tensor, top_p: float, first: int | None = NUCLEUS_FIRST) -> torch.Tensor:
    """The tokens top-p keeps in each row of logits [..., V]: those whose larger tokens (the row's
    tokens of strictly larger logits) hold less than top_p of its mass, so the smallest prefix of
    the row in descending order that reaches top_p, with the tokens tied to its last one (the top
    token always stays). Tied tokens stand or fall together: a cut between them would depend on the
    order a sort leaves them in (bfloat16 logits tie often). The prefix is looked for among the row's
    `first` largest logits, 8x more while some row's does not end among them, not by sorting the
    whole vocabulary: on 2 CPU cores (AVX-512) a sort of 151,936 logits took 11.7 ms, a top-256 0.3.
    None sorts the whole row (no test of the candidates to read back). The tokens kept do not depend
    on how many candidates were looked at, so neither on the other rows of a batch."""
    probs = logits.softmax(-1)
    vocab = logits.shape[-1]
    k = vocab if first is None else min(vocab, first)
    while True:
        values, order = logits.sort(dim=-1, descending=True) if k == vocab else logits.topk(k, dim=-1)
        mass = probs.gather(-1, order)
        # The mass before each candidate: running sums, the same bits for any number of candidates.
        before = torch.cat([torch.zeros_like(mass[..., :1]), mass.cumsum(-1)[..., :-1]], -1)
        # The candidates before which less than top_p lies are a prefix (at least the top token); the
        # row keeps every token at least as large as its last, ties included.
        # clamp: a top_p that rounds to 0 in the logits' precision keeps the top token alone.
        last = ((before < top_p).sum(-1, keepdim=True) - 1).clamp(min=0)
        least = values.gather(-1, last)
        # Enough candidates when every row's last one falls short of that: all after it do too.
        if k == vocab or bool((values[..., -1:] < least).all()):
            return logits >= least
        k = vocab if 32 * k > vocab else 8 * k  # a nucleus this wide: one sort, not a top-k of most of it


def top_k(x: torch.Tensor, k: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) over the last dimension of x [n, V] (values and their indices, largest
    first), by way of block maxima: the k largest lie in the k blocks of largest maximum, so one
    cheap pass over V and a top-k over k blocks replace torch's top-k over V (35 against 87 us a row
    over a 49k vocabulary on this project's CPU, measured). Tied values may come with other indices."""
    n, v = x.shape
    if v % block or v // block < 4 * k:
        top = x.topk(k)
        return top.values, top.indices
    blocks = x.reshape(n, v // block, block)
    chosen = blocks.amax(-1).topk(k).indices  # [n, k]
    inside = blocks.gather(1, chosen.unsqueeze(-1).expand(n, k, block)).reshape(n, k * block)
    top = inside.topk(k)
    ids = (chosen.unsqueeze(-1) * block + torch.arange(block, device=x.device)).reshape(n, k * block)
    return top.values, ids.gather(1, top.indices)


def top_k_rows(
    blocks: list[torch.Tensor],
    k: int,
    picks: list[list[int]] | None = None,
    normalise: list[bool] | None = None,
    temperatures: list[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`top_k` over chosen rows of several [n_i, V] blocks as if their rows were concatenated
    (`picks[i]`: block i's rows, all where None), of the softmax of a block where `normalise[i]` (its
    rows logits: the top tokens of the distribution and their probabilities), each block's rows read
    divided by `temperatures[i]` (the same bits as `processed_logits` at that temperature alone). On
    the CPU by csrc/topk.cpp where this process has built the kernels: float32 or bfloat16 rows read
    where they lie, no copy, cast, division or softmax written (three rows of a 49k vocabulary: 0.6 ms
    a step with them); else by `top_k` (on the first non-CPU block's device, where the rows are moved).
    The third value: on the kernel what it read of each normalised row [picked, 2 + k], the row's
    largest value, the log of its sum of exp(x - most) and its top k values as read (x / t), the same
    float32 operations as csrc/topk.cpp's `log_rows`, so those rows' log-probabilities follow from them
    with the same bits (logprobs.py `RowReading`); None off the kernel."""
    picks = [list(range(len(b))) for b in blocks] if picks is None else picks
    normalise = [False] * len(blocks) if normalise is None else normalise
    temperatures = [1.0] * len(blocks) if temperatures is None else temperatures
    if on_kernel(blocks):
        flat = [r for p in picks for r in p]
        rows = [b if b.stride(-1) == 1 else b.contiguous() for b in blocks]
        counts = [len(p) for p in picks]
        values, ids, read = torch.ops.tot_sampling.top_k_rows(rows, counts, flat, normalise, temperatures, k)
        return values, ids, read
    device = next((b.device for b in blocks if b.device.type != "cpu"), blocks[0].device)
    parts = [b[p].to(device).float() / t for b, p, t in zip(blocks, picks, temperatures)]
    parts = [x.softmax(-1) if norm else x for x, norm in zip(parts, normalise)]
    values, ids = top_k(torch.cat(parts), k)
    return values, ids, None


def on_kernel(blocks: list[torch.Tensor]) -> bool:
    """Whether csrc/topk.cpp reads these blocks: built in this process, float32 or bfloat16 CPU rows."""
    return kernels.built() is not None and all(
        b.device.type == "cpu" and b.dtype in (torch.float32, torch.bfloat16) for b in blocks
    )


def draft_dists(logits: torch.Tensor, params: SamplingParams) -> list[torch.Tensor]:
    """A drafter's distributions [V] on the CPU for its logits [n, V]: at temperature 0 the plain
    softmax (for ranking candidates and as confidences), above it the processed distribution the
    draws follow (the same processing as the target's, which the acceptance rule needs)."""
    q = logits.float().softmax(-1) if params.greedy else process_logits(logits[None], [params])[0]
    return list(q.cpu().unbind(0))


def make_generator(seed: int, device: torch.device | None = None) -> torch.Generator:
    g = torch.Generator(device=device or "cpu")
    g.manual_seed(seed)
    return g


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn with probability proportional to `weights` [V] (non-negative, any total), by
    the inverse of their float64 cumulative sum: exact to float64's resolution, and some 15x faster
    than torch.multinomial over a 49k vocabulary on a CPU (0.05 against 0.77 ms, measured): the
    rejection rules' draws, which need not follow plain decoding's stream. (torch.multinomial is
    argmax(p / Exp(1) noise): one exponential per vocabulary entry.)"""
    cdf = torch.cumsum(weights.double(), 0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), weights.shape[0] - 1)
