"""Acceptance rules: which drafted token the target keeps, so that output follows the target exactly.

Two families (verify.rule). The matched rules (`walk_matched`; at temperature 0 always) keep the
child that is the target's own token at each position: its argmax, or its sample by the request's
sampler, so the output is plain decoding's very tokens. The rejection rules (`walk_rejection`) are
pure functions on probability vectors [V], each recursive rejection sampling: the
candidates of one node are tried in the order they were drawn; candidate x_i, drawn from the
proposal q_i, is accepted with probability min(1, r(x_i) / q_i(x_i)), where r starts as the
target's distribution p; on rejection r becomes norm(max(0, r - q_i)). When every candidate is
rejected the token is drawn from the final r. This returns a token distributed exactly as p for
any proposals, as long as each x_i really was drawn from q_i; the rules differ only in q_i:

- "iid": every candidate drawn from the same q. One candidate is plain speculative sampling
  (SpS); several is SpecInfer's multi-candidate rule, which MCSD uses.
- "without_replacement": q_i is q with the earlier candidates removed and renormalised, uniform
  over the tokens not yet tried once q is used up (Sequoia, Algorithm 2).
- "top": candidates chosen deterministically, so q_i is a point mass on x_i: accept with r(x_i),
  else remove x_i from r.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from decoding.speculation.draft_tree import ROOT, DraftDist, DraftTree, Draw
from decoding.speculation.sampling import draw


def dense(q: DraftDist, vocab: int) -> torch.Tensor:
    """A draft distribution as a float64 [vocab] vector (N-gram drafters store (ids, probs) pairs)."""
    if isinstance(q, torch.Tensor):
        return q.double()
    ids, probs = q
    out = torch.zeros(vocab, dtype=torch.float64)
    out[torch.tensor(ids, dtype=torch.long)] = torch.tensor(probs, dtype=torch.float64)
    return out


def proposals(q: DraftDist | None, candidates: list[int], draw: Draw, vocab: int) -> list[torch.Tensor]:
    """The distribution each candidate was drawn from (float64, [vocab])."""
    if draw == "top":
        return [torch.nn.functional.one_hot(torch.tensor(x), vocab).double() for x in candidates]
    if q is None:
        raise ValueError(f"draw={draw!r} needs the draft distribution its candidates were drawn from")
    d = dense(q, vocab)
    if draw == "iid":
        return [d] * len(candidates)
    out = []
    for i in range(len(candidates)):
        if i > 0:
            d = d.clone()
            d[candidates[i - 1]] = 0.0
            if d.sum() <= 0:
                # Sequoia: once q is used up, draw uniformly among the tokens not yet tried.
                d = torch.ones_like(d)
                d[candidates[:i]] = 0.0
            d = d / d.sum()
        out.append(d)
    return out


def chain(p: torch.Tensor, candidates: list[int], props: list[torch.Tensor]) -> tuple[list[float], torch.Tensor]:
    """The rule with each candidate's own proposal (candidates from several drafters at one node)."""
    r = p.double()
    accept: list[float] = []
    for x, qi in zip(candidates, props):
        qx = float(qi[x])
        a = 0.0 if qx <= 0 else min(1.0, float(r[x]) / qx)
        accept.append(a)
        if a >= 1.0:
            break  # always accepted: later candidates and the residual are never reached
        r = residual(r, qi)
    return accept, r


def residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, r - q)); r itself when that is empty (then r <= q everywhere, so every
    candidate was accepted and the residual is never drawn from)."""
    d = (r - q).clamp_min(0.0)
    total = d.sum()
    return r if total <= 0 else d / total


def sample_chain(
    p: torch.Tensor, candidates: list[int], props: list[torch.Tensor], generator: torch.Generator
) -> tuple[int | None, int]:
    accept, r = chain(p, candidates, props)
    for i, a in enumerate(accept):
        if a >= 1.0 or float(torch.rand((), generator=generator, dtype=torch.float64)) < a:
            return i, candidates[i]
    return None, draw(r, generator)


def node_proposals(tree: DraftTree, node: int, children: list[int], vocab: int) -> list[torch.Tensor]:
    """Each child's proposal. Children from different drafters (a tree grafted from several, see
    DraftTree.sources) were drawn independently, each source from its own distribution, so each
    source's candidates get that source's proposals, in the order the children are listed."""
    by_source: dict[int, list[int]] = {}
    for c in children:
        by_source.setdefault(tree.source_of(c), []).append(c)
    props: dict[int, torch.Tensor] = {}
    for src, kids in by_source.items():
        draw, dists = tree.part(src)
        for c, q in zip(kids, proposals(dists.get(node), [tree.tokens[k] for k in kids], draw, vocab)):
            props[c] = q
    return [props[c] for c in children]


def walk_matched(tree: DraftTree, target: Callable[[int, int], int]) -> tuple[list[int], int]:
    """Verify one tree under a matched rule: from the root down, the child that is the target's own
    token is accepted; the first position where no child is ends the walk with that token.

    target(node, depth): the target's token after `node` (ROOT at depth 0): its argmax at
    temperature 0, else its own sample (verify.rule: Gumbel-max with the request's public noise, or
    a torch.multinomial draw from the request's generator, as `transformers` samples). The output is
    then plain decoding's very tokens whatever was drafted, with whom and how much ran at once.
    Only the positions the walk reaches are sampled.
    """
    kids = _children(tree)
    path: list[int] = []
    node = ROOT
    while True:
        want = target(node, len(path))
        match = next((c for c in kids.get(node, []) if tree.tokens[c] == want), None)
        if match is None:
            return path, want
        node = match
        path.append(node)


def walk_rejection(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator) -> tuple[list[int], int]:
    """Verify one tree by recursive rejection sampling (the module docstring): the accepted nodes
    from the root down, and the token after them (the bonus token when the path ends at a leaf, the
    residual's draw when the candidates at its end were all rejected). Row 0 of probs [1 + N, V] is
    the target's processed distribution at the root, row 1 + i at node i."""
    kids = _children(tree)
    path: list[int] = []
    node = ROOT
    while True:
        children = kids.get(node, [])
        p = probs[node + 1]
        if not children:
            return path, draw(p, generator)
        cands = [tree.tokens[c] for c in children]
        idx, token = sample_chain(p, cands, node_proposals(tree, node, children, p.shape[-1]), generator)
        if idx is None:
            return path, token
        node = children[idx]
        path.append(node)


def _children(tree: DraftTree) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, par in enumerate(tree.parents):
        kids.setdefault(par, []).append(i)
    return kids
