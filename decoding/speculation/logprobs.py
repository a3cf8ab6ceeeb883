"""What a request may ask of the distributions verification already computed: each kept token's
log-probability with the most likely tokens beside it (`GenRequest.logprobs`), and the probability
of given answers after the prompt (`GenRequest.choices`), read from one forward over their trie.

Both read the target's logits at the rows that predicted the tokens; neither changes a token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.base.values import TokenLogprob
from decoding.speculation.draft_tree import ROOT, DraftTree
from decoding.speculation.sampling import SamplingParams, processed_logits


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


def token_logprobs(
    logits: torch.Tensor,
    tokens: list[int],
    params: SamplingParams,
    top: int,
    processed: torch.Tensor | None = None,
) -> list[TokenLogprob]:
    """Each of `tokens`' log-probability at its row of `logits` [len(tokens), V] (the row that
    predicted it), with the `top` most likely tokens there; one read back for all of them.
    `processed`: the same rows' processed logits, where they were made already."""
    if not tokens:
        return []
    n = len(tokens)
    logp = log_distribution(logits[:n], params, None if processed is None else processed[:n])
    ids = torch.tensor(tokens, device=logp.device)
    chosen = logp.gather(-1, ids[:, None])[:, 0].tolist()
    if top:
        best = logp.topk(min(top, logp.shape[-1]), dim=-1)
        pairs = [tuple(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
    else:
        pairs = [()] * len(tokens)
    return [TokenLogprob(t, lp, p) for t, lp, p in zip(tokens, chosen, pairs)]


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
