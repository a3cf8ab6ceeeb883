"""What a request may ask of the distributions verification already computed: each kept token's
log-probability with the most likely tokens beside it (`GenRequest.logprobs`), and the probability
of given answers after the prompt (`GenRequest.choices`), read from one forward over their trie.

Both read the target's logits at the rows that predicted the tokens; neither changes a token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

import numpy as np
import torch

from decoding.base.values import TokenLogprob
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.sampling import SamplingParams, on_kernel, processed_logits


def log_distribution(
    logits: torch.Tensor, params: SamplingParams, processed: torch.Tensor | None = None
) -> torch.Tensor:
    """log p over the vocabulary for logits [n, V]: the request's own sampling distribution (the
    processed logits, as `transformers` reports its sampled scores; -inf outside top-k / top-p), the
    raw logits' at temperature 0 (greedy search's scores). `processed`: those rows' processed logits
    where the acceptance already made them (the same bits: processing works row by row)."""
    if params.greedy:
        return logits.float().log_softmax(-1)
    return (processed_logits(logits.float(), params) if processed is None else processed).log_softmax(-1)


@dataclass(frozen=True)
class RowReading:
    """What the acceptance's top-k pass (csrc/topk.cpp `top_k_rows`, `verify.top_tokens`) read of a
    verdict's rows of `block` (its `rows`, read divided by `temperature`): per row its largest value,
    the log of its sum of exp(x - most) and its k largest values as read, with their ids. `log_rows`
    computes a row's log-probabilities from the same float32 operations, so a commit that asks for
    rows already read takes them from here (`from_reading`) with the same bits, not a second pass
    over the vocabulary."""

    block: torch.Tensor
    temperature: float
    rows: list[int]
    most: list[float]
    log_sum: list[float]
    values: list[list[float]]
    ids: list[list[int]]

    @classmethod
    def of(
        cls, block: torch.Tensor, temperature: float, rows: list[int], read: list[list[float]], ids: list[list[int]]
    ) -> RowReading:
        """From the kernel's rows of what it read ([2 + k] each: most, log of the sum, the top k)."""
        return cls(block, temperature, rows, [r[0] for r in read], [r[1] for r in read], [r[2:] for r in read], ids)


@dataclass(frozen=True)
class Asked:
    """One sequence's log-probabilities to read in a step: `tokens`, each predicted by the row of
    `logits` [R, V] that `rows` names in turn, the `top` most likely beside each, under `sampling` (the
    row's settings as the step's `RowSampling` holds them); `processed`: the same block's processed
    logits where the acceptance made them."""

    logits: torch.Tensor
    rows: list[int]
    tokens: list[int]
    sampling: SamplingParams
    top: int
    processed: torch.Tensor | None = None
    reading: RowReading | None = None  # what the acceptance read of these rows, where it did


def token_logprobs(asked: list[Asked]) -> list[list[TokenLogprob]]:
    """Each ask's tokens' log-probabilities with the `top` most likely tokens beside each. On the CPU
    every ask of a step in one call of csrc/topk.cpp's `log_rows`, the rows read where they lie (a
    row whose processing is its temperature's division alone read divided there, no processed copy:
    each ask paid a division, a log-softmax and a top-k over the vocabulary, row by row); else by
    `log_distribution`, an ask at a time. Either way a row's values depend on that row alone. An ask
    of no tokens reads nothing: its list is empty."""
    read = iter(_read([a for a in asked if a.tokens]))
    return [next(read) if a.tokens else [] for a in asked]


def _read(asked: list[Asked]) -> list[list[TokenLogprob]]:
    """`token_logprobs` of asks that each have tokens: those whose rows the acceptance read already
    from their reading, the rest in one call."""
    answers: dict[int, list[TokenLogprob]] = {}
    rest: list[tuple[int, Asked, torch.Tensor, list[int], float]] = []
    for i, a in enumerate(asked):
        p, rows = a.sampling, a.rows[: len(a.tokens)]
        if p.greedy or (a.processed is None and p.top_k == 0 and p.top_p >= 1.0):
            block, temperature = a.logits, 1.0 if p.greedy else p.temperature
        elif a.processed is not None:
            block, temperature = a.processed, 1.0
        else:  # top-k or top-p: processed here, the rows asked alone
            block, temperature = processed_logits(a.logits[rows].float(), p), 1.0
            rows = list(range(len(rows)))
        if read_before(a.reading, block, temperature, rows, a.top):
            answers[i] = from_reading(a.reading, a.tokens, a.top)
            continue
        rest.append((i, a, block, rows, temperature))
    read = iter(_read_rows([x[1:] for x in rest]))
    return [answers[i] if i in answers else next(read) for i in range(len(asked))]


def read_before(
    r: RowReading | None, block: torch.Tensor, temperature: float, rows: list[int], top: int
) -> TypeGuard[RowReading]:
    """Whether the acceptance read these rows of this block at this temperature, k at least `top` (a
    reading is made on the kernel only)."""
    if r is None or r.block is not block or r.temperature != temperature or r.rows[: len(rows)] != rows:
        return False
    return top <= len(r.ids[0])


def from_reading(r: RowReading, tokens: list[int], top: int) -> list[TokenLogprob]:
    """`log_rows`' answer for `tokens` predicted by r's rows in turn, from what the top-k pass read:
    (x - most) - log_sum in float32, x read divided by the temperature as there (IEEE float32 in both)."""
    t = np.float32(r.temperature)
    out = []
    for j, token in enumerate(tokens):
        most, log_sum = np.float32(r.most[j]), np.float32(r.log_sum[j])
        x = np.float32(r.block[r.rows[j], token].item())
        if t != 1:
            x = x / t
        tops = tuple((i, float((np.float32(v) - most) - log_sum)) for i, v in zip(r.ids[j][:top], r.values[j][:top]))
        out.append(TokenLogprob(token, float((x - most) - log_sum), tops))
    return out


def _read_rows(asked: list[tuple[Asked, torch.Tensor, list[int], float]]) -> list[list[TokenLogprob]]:
    """Asks with the block, rows and temperature each reads, in one call of `log_rows` on the CPU."""
    blocks = [b for _, b, _, _ in asked]
    picks = [rows for _, _, rows, _ in asked]
    temperatures = [t for *_, t in asked]
    asked_only = [a for a, *_ in asked]
    out: list[list[TokenLogprob]] = []
    if blocks and on_kernel(blocks):
        tokens = [t for a in asked_only for t in a.tokens]
        k = max(1, max(a.top for a in asked_only))
        chosen, values, ids = torch.ops.tot_sampling.log_rows(
            [b if b.stride(-1) == 1 else b.contiguous() for b in blocks],
            [len(p) for p in picks],
            [r for p in picks for r in p],
            temperatures,
            tokens,
            min(k, blocks[0].shape[-1]),
        )
        chosen_l, values_l, ids_l = chosen.tolist(), values.tolist(), ids.tolist()  # one conversion a step
        start = 0
        for a in asked_only:
            end = start + len(a.tokens)
            tops = [tuple(zip(i[: a.top], v[: a.top])) for i, v in zip(ids_l[start:end], values_l[start:end])]
            out.append([TokenLogprob(t, lp, top) for t, lp, top in zip(a.tokens, chosen_l[start:end], tops)])
            start = end
    else:
        out = [one_logprobs(a) for a in asked_only]
    return out


def one_logprobs(a: Asked) -> list[TokenLogprob]:
    """`token_logprobs` of one ask by torch's operators (off the CPU, or without the kernels)."""
    rows = a.rows[: len(a.tokens)]
    logp = log_distribution(a.logits[rows], a.sampling, None if a.processed is None else a.processed[rows])
    ids = torch.tensor(a.tokens, device=logp.device)
    chosen = logp.gather(-1, ids[:, None])[:, 0].tolist()
    if a.top:
        best = logp.topk(min(a.top, logp.shape[-1]), dim=-1)
        pairs = [tuple(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
    else:
        pairs = [()] * len(a.tokens)
    return [TokenLogprob(t, lp, p) for t, lp, p in zip(a.tokens, chosen, pairs)]


@dataclass(frozen=True)
class Choices:
    """Answers to score after a prompt, as one tree of their tokens (answers sharing first tokens
    share nodes): `paths[i]` the nodes of answer i, root's child first."""

    tree: DraftTree
    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, answers: list[list[int]]) -> Choices:
        tree, paths = DraftTree(), []
        child: dict[tuple[int, int], int] = {}
        for ids in answers:
            if not ids:
                raise ValueError("an answer to score has no tokens")
            node, path = ROOT, []
            for token in ids:
                if (node, token) not in child:
                    child[(node, token)] = tree.add(token, node)
                node = child[(node, token)]
                path.append(node)
            paths.append(tuple(path))
        return cls(tree, tuple(paths))

    def logprobs(self, logits: torch.Tensor) -> list[float]:
        """Each answer's log-probability from the forward's logits [1 + N, V] at the root and at the
        tree's nodes: the sum over its tokens of the raw logits' log-softmax at the row before it."""
        logp = logits.float().log_softmax(-1)
        parents = torch.tensor([1 + self.tree.parents[n] for n in range(len(self.tree))], device=logp.device)
        tokens = torch.tensor(self.tree.tokens, device=logp.device)
        node = logp[parents, tokens].tolist()  # each node's token after its parent
        return [sum(node[n] for n in path) for path in self.paths]
